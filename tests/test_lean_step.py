"""The lean train step: the layer scan's unrolling and the GPU benchmark's CPU path."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import equinox as eqx
import jax
import numpy as np
import pytest

from equishard import LayerConfigError
from equishard.models import GPT, GPTConfig
from equishard.sharding import Parallelism

from .helpers import assert_tree_allclose

TINY = GPTConfig(d_model=32, n_heads=4, n_layers=4, d_ff=64)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _value_and_grad(config):
    model = GPT(config, Parallelism(), key=jax.random.key(0))
    batch = jax.numpy.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 17), dtype=np.int32))
    return eqx.filter_jit(eqx.filter_value_and_grad(lambda m: m.loss(batch)[0]))(model)


def test_layer_scan_unrolling_gives_the_same_values_and_gradients():
    """`scan_unroll` changes the compiled loop, not the numbers (on the CPU, "auto" is 1)."""
    loss, grads = _value_and_grad(TINY)
    for unroll in (2, 4):
        other_loss, other_grads = _value_and_grad(dataclasses.replace(TINY, scan_unroll=unroll))
        assert_tree_allclose(other_loss, loss)
        assert_tree_allclose(jax.tree.leaves(other_grads), jax.tree.leaves(grads))


def test_a_bad_scan_unroll_is_refused():
    with pytest.raises(LayerConfigError, match="scan_unroll=0"):
        GPT(dataclasses.replace(TINY, scan_unroll=0), Parallelism(), key=jax.random.key(0))


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    assert spec and spec.loader
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_runs_its_path_on_the_cpu(capsys):
    """Without a GPU the command says so and exits 0; its measurement runs on the CPU
    (the reference GPT with its plain-jit twin, a user's Llama-style model) and its
    table reads the rows."""
    bench = _bench_gpu()
    assert bench.main([]) == 0
    assert "no GPU here" in capsys.readouterr().out
    gpt = bench.measure("tiny", bench.VARIANTS["base"], steps=1, plain=True)
    llama = bench.measure("llama-tiny", bench.combine([]), steps=1, plain=False)
    for row in (gpt, llama):
        assert row["es_tokens_s"] > 0 and row["params"] > 0 and "es_temp_GiB" in row
    assert gpt["es_over_plain_time"] > 0
    table = bench.format_table([dict(gpt, framework="jax"), {"config": "x", "error": "not measured"}])
    assert table.count("\n") == 3 and "not measured" in table
