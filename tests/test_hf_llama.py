"""Hugging Face checkpoints of the Llama family onto the reference GPT under every layout,
against the logits, loss and greedy continuation `transformers` recorded
(`scripts/make_hf_fixtures.py`), and back out again."""

import functools
import json
import os
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import from_last_stage
from equishard.models import GPT, export_hf, gpt_config_from_hf, load_hf, read_hf_config
from equishard.train import checkpoint_tensors
from equishard.train import _safetensors

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["llama3", "llama32_bf16", "mistral", "qwen2"]
# "+sp": Megatron sequence parallelism over tp.
LAYOUTS = ["dp=8", "fsdp=8", "tp=2", "tp=4", "fsdp=4,tp=2", "pp=2,dp=2,tp=2", "dp=2,tp=4+sp"]


@functools.cache
def _forward(layout: str):
    """The jitted sharded forward pass of a GPT under `layout`: global `int32[8, 16]` ids
    in, global float32 logits `[8, 16, V]` out."""
    spec, sp = layout.removesuffix("+sp"), layout.endswith("+sp")
    resolved = es.Layout(spec, sequence_parallel=sp).resolve()
    mesh, batch = resolved.mesh(), resolved.batch_spec
    par = resolved.parallelism
    vocab_axis = "tp" if "tp" in mesh.axis_names else None

    def body(model, ids):
        logits = model(ids.value)  # f32[B/data, T, V/tp]
        return from_last_stage(logits, par.pipeline) if par.pipeline else logits

    call = es.filter_shard_map(body, mesh=mesh, out_specs=P(batch[0] if len(batch) else None, None, vocab_axis))
    return mesh, par, batch, eqx.filter_jit(lambda m, ids: call(m, es.Sharded(ids, batch)))


def _logits(model, ids, layout):
    _, _, _, fn = _forward(layout)
    out = np.asarray(fn(model, jnp.asarray(ids)))
    real = model.config.real_vocab_size or model.config.vocab_size
    assert (out[..., real:] == np.finfo(np.float32).min).all()  # padded ids never win
    return out[..., :real]


def _greedy(model, prompt, layout, n):
    """The greedy continuation of `prompt` by `n` tokens (one compiled forward pass of a
    fixed window, the causal mask making the tokens after the cursor irrelevant)."""
    window = np.zeros((8, 16), np.int32)
    window[:, : len(prompt)] = prompt
    out = []
    for i in range(n):
        at = len(prompt) + i
        token = int(np.argmax(_logits(model, window, layout)[0, at - 1]))
        window[:, at] = token
        out.append(token)
    return np.array(out, np.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_loads_under_every_layout(family, layout):
    folder = FIXTURES / family
    expected = np.load(folder / "expected.npz")
    mesh, par, _, _ = _forward(layout)
    model = load_hf(str(folder), par, mesh)
    logits = _logits(model, expected["ids"], layout)
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-5, rtol=0)
    # The loss, from the logits (transformers' shift: position t predicts t + 1).
    lse = jax.nn.logsumexp(logits[:, :-1], axis=-1)
    picked = np.take_along_axis(logits[:, :-1], expected["ids"][:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(float(np.mean(lse - picked)), float(expected["loss"]), rtol=1e-5)
    if layout in ("fsdp=4,tp=2", "pp=2,dp=2,tp=2"):
        greedy = _greedy(model, expected["prompt"], layout, len(expected["greedy"]))
        np.testing.assert_array_equal(greedy, expected["greedy"])
