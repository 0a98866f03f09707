"""The lean train step: the layer scan's unrolling, mixed precision as a step option, and
the GPU benchmark's CPU path."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P

import equishard.models
from equishard import LayerConfigError
from equishard._cli import main
from equishard.models import GPT, GPTConfig, abstract_train_step, cast_floating
from equishard.models._gpt import to_single_device
from equishard.sharding import Layout, Parallelism
from equishard.train import MixedPrecision, init_train_state, make_train_step

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


def test_the_gpu_benchmark_names_a_kernel_by_its_compiled_instruction():
    """A profile's kernel (`concatenate_1`) is found as its HLO instruction
    (`concatenate.1`): its shape and the JAX operation it came from."""

    def f(x, w):
        gate, up = jnp.split(x @ w, 2, axis=-1)
        return jnp.sum(gate * up)

    hlo = jax.jit(jax.grad(f)).lower(jnp.ones((8, 4)), jnp.ones((4, 16))).compile().as_text()
    assert hlo is not None
    instruction = re.search(r"%(\w*concatenate[\w.]*) = ", hlo)
    assert instruction, hlo
    kernel = instruction.group(1).replace(".", "_")
    [(name, source)] = _bench_gpu().kernel_sources(hlo, [kernel, "no_such_kernel"]).items()
    assert name == kernel and source.startswith("f32[8,16]") and "transpose" in source, source


@pytest.mark.parametrize("patch", ["one_product", "rmsnorm_autodiff"])
def test_the_gpu_benchmarks_patches_change_no_value(patch, monkeypatch):
    """A variant that patches the layers (the library's previous ways) computes the same
    loss and gradients; the patched methods are restored afterwards."""
    from equishard.nn import _transformer as t

    for cls, name in ((t.ParallelMLP, "__call__"), (t.ParallelAttention, "qkv_heads"), (t.RMSNorm, "__call__")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored at teardown
    loss, grads = _value_and_grad(TINY)
    _bench_gpu().PATCHES[patch]()
    other_loss, other_grads = _value_and_grad(TINY)
    assert_tree_allclose(other_loss, loss)
    assert_tree_allclose(jax.tree.leaves(other_grads), jax.tree.leaves(grads))


def test_in_bfloat16_no_activation_is_saved_twice(capsys):
    """What the bf16 loss keeps for its backward pass (`print_saved_residuals`): every
    `[batch, tokens, features]` activation once, in bf16 (the residual stream's dtype),
    none beside a float32 copy of itself: RMSNorm's own backward pass keeps the inverse
    RMS (`f32[batch, tokens, 1]`), not the upcast input, the normalised values and the
    broadcast weight that differentiating it would keep (`benchmarks/RESULTS.md`)."""
    model = to_single_device(GPT(dataclasses.replace(TINY, remat="none"), key=jax.random.key(0)))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 17), dtype=np.int32))
    loss = lambda p: cast_floating(eqx.combine(p, static), jnp.bfloat16).loss(batch)[0]  # noqa: E731
    print_saved_residuals(loss, params)
    saved = capsys.readouterr().out.splitlines()
    # [layers,] 2 sequences, 16 tokens, d_model 32 or d_ff 64
    activations = [line.split(" ")[0] for line in saved if re.match(r"\w+\[(\d+,)?2,16,(32|64)\] ", line)]
    assert "bf16[4,2,16,32]" in activations and not [a for a in activations if a.startswith("f32[")], saved


# Mixed precision as a step option ------------------------------------------------------

MP = GPTConfig(d_model=64, n_heads=8, n_layers=2, d_ff=128)


def _gpt_step(spec, **options):
    layout = Layout(spec)
    mesh = layout.mesh()
    optimizer = optax.adamw(3e-3)
    state = init_train_state(
        lambda k: GPT(MP, layout.resolve(), key=k), optimizer, jax.random.key(0), mesh=mesh
    )
    loss_fn = options.pop("loss_fn", lambda model, batch, key: model.loss(batch, key))
    step = make_train_step(loss_fn, optimizer, mesh=mesh, batch_spec=layout.resolve().batch_spec, **options)
    return state, step


def _collective_dtypes(text):
    """`{(collective, operand dtype): count}` of a lowered step's StableHLO."""
    counts = collections.Counter()
    for match in re.finditer(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce)"', text):
        # The operand types follow the op's attributes (`}> : (`) or its region (`}) : (`).
        operand = re.compile(r"[)>] : \(tensor<(?:[0-9]+x)*(\w+)>").search(text, match.end())
        assert operand is not None
        counts[(match.group(1), operand.group(1))] += 1
    return counts


def test_compute_dtype_equals_the_cast_written_into_the_loss_on_one_device():
    batch = jax.numpy.asarray(np.random.default_rng(0).integers(0, MP.vocab_size, (8, 17), dtype=np.int32))
    cast = lambda model, batch, key: cast_floating(model, jnp.bfloat16).loss(batch, key)  # noqa: E731
    results = []
    for options in ({"loss_fn": cast}, {"precision": MixedPrecision(jnp.bfloat16)}):
        state, step = _gpt_step("dp=1", **options)
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((metrics["loss"], state.model, state.opt_state))
    assert_tree_allclose(results[0], results[1], rtol=0.0)
    floats = [x for x in jax.tree.leaves(results[1]) if eqx.is_inexact_array(x)]
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}


def test_mixed_precision_gathers_in_the_compute_dtype_and_reduces_in_float32():
    """dp=4,fsdp=2 (FSDP's gathers and reduce-scatters, the data axes' all-reduce): the
    shards gathered in bf16, every gradient reduced in f32 by default and in bf16 when
    asked; the master weights and moments stay f32."""
    batch = jax.ShapeDtypeStruct((16, 33), jnp.int32)
    state, step = _gpt_step("dp=4,fsdp=2", precision=MixedPrecision(jnp.bfloat16))
    default = _collective_dtypes(step.lower(state, batch).as_text())
    state, step = _gpt_step("dp=4,fsdp=2", precision=MixedPrecision(jnp.bfloat16, reduce_dtype=jnp.bfloat16))
    reduced = _collective_dtypes(step.lower(state, batch).as_text())
    gathers = {k: n for k, n in default.items() if k[0] == "all_gather" and k[1] != "i32"}
    assert gathers and set(gathers) == {("all_gather", "bf16")}
    assert default[("reduce_scatter", "f32")] > 0 and not default[("reduce_scatter", "bf16")]
    # Every all-reduce of an array is in f32 (bf16 ones would be gradients reduced after
    # the cast); the scalars (loss, norms) are f32 too.
    assert not default[("all_reduce", "bf16")]
    assert reduced[("reduce_scatter", "bf16")] == default[("reduce_scatter", "f32")]
    assert reduced[("all_reduce", "bf16")] > 0


class _Reported(Exception):
    pass


def test_inspect_and_plan_lower_the_step_train_runs_in_bfloat16(monkeypatch):
    """`equishard inspect/plan --dtype bfloat16` report on the program `train --dtype
    bfloat16` runs: the step casts (gathers in bf16, reductions in f32), not the loss."""
    batch = jax.ShapeDtypeStruct((16, 33), jnp.int32)
    state, step = _gpt_step("dp=4,fsdp=2", precision=MixedPrecision(jnp.bfloat16))
    trained = _collective_dtypes(step.lower(state, batch).as_text())
    abstract = abstract_train_step(
        MP, Layout("dp=4,fsdp=2"), batch_size=16, seq_len=32, optimizer=optax.adamw(3e-3),
        precision=MixedPrecision(jnp.bfloat16),
    )  # fmt: skip
    assert _collective_dtypes(abstract.lowered.as_text()) == trained
    asked = {}

    def lower(*args, **kwargs):
        asked.update(kwargs)
        raise _Reported

    monkeypatch.setattr(equishard.models, "abstract_train_step", lower)
    with pytest.raises(_Reported):
        main(["inspect", "--dtype", "bfloat16"])
    assert asked["precision"] == MixedPrecision(jnp.bfloat16)


def test_mixed_precision_on_a_layout_follows_one_device():
    """fsdp=4,tp=2 with compute_dtype bf16 against one device with the same option: the
    losses of 3 steps within bf16's tolerance."""
    batch = jax.numpy.asarray(np.random.default_rng(1).integers(0, MP.vocab_size, (8, 17), dtype=np.int32))
    curves = []
    for spec in ("dp=1", "fsdp=4,tp=2"):
        state, step = _gpt_step(spec, precision=MixedPrecision(jnp.bfloat16))
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        curves.append(losses)
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"compute_dtype": jnp.int32}, "compute_dtype must be a floating dtype"),
        ({"compute_dtype": "bfloat17"}, "compute_dtype must be a floating dtype"),
        ({"compute_dtype": None}, "FULL_PRECISION"),
        ({"compute_dtype": jnp.bfloat16, "reduce_dtype": jnp.int8}, "reduce_dtype must be a floating dtype"),
    ],
)
def test_a_bad_precision_option_is_refused(options, match):
    with pytest.raises(LayerConfigError, match=match):
        MixedPrecision(**options)


def test_a_float32_batch_trains_under_mixed_precision_in_both_views():
    """A conv net fed float32 images, its loss written as on one device (no pmean, no
    cast): under MixedPrecision(bfloat16) the step casts the floating batch with the
    model (`cast_batch`, the default) in the local and the global view, and the losses
    follow the float32 one-device curve within bfloat16's 1e-2 (with `cast_batch=False`
    the conv refuses float32 images beside bfloat16 weights)."""
    import equishard as es

    net = lambda k: eqx.nn.Sequential([  # noqa: E731
        eqx.nn.Conv2d(3, 8, 3, padding=1, key=jax.random.fold_in(k, 0)),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Lambda(lambda x: jnp.mean(x, axis=(1, 2))),
        eqx.nn.Linear(8, 1, key=jax.random.fold_in(k, 1)),
    ])
    images = jax.random.normal(jax.random.key(1), (16, 3, 8, 8))  # float32
    targets = jax.random.normal(jax.random.key(2), (16, 1))

    def loss_fn(model, batch, key):
        x, y = batch
        out = jax.vmap(es.unbox(model))(x)
        return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2), {}

    def curve(spec, view, precision):
        mesh = es.make_mesh(spec, devices=jax.devices()[: 1 if spec == "dp=1" else 8])
        step = make_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, batch_spec=P("dp"), view=view, precision=precision)
        state = step.init_state(net, jax.random.key(0))
        out = []
        for _ in range(3):
            state, metrics = step(state, (images, targets))
            out.append(float(metrics["loss"]))
        return out

    reference = curve("dp=1", "local", None)
    for view in ("local", "global"):
        np.testing.assert_allclose(curve("dp=8", view, MixedPrecision(jnp.bfloat16)), reference, rtol=1e-2)
