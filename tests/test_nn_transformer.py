"""The tensor-parallel transformer block in both styles (Megatron TP, TP + sequence
parallelism), with and without rotary embeddings / SwiGLU / biases: forward and every
gradient against an independent single-device block on tp = 1, 2, 4, 8 and dp=2 x tp=4."""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.nn import TransformerBlock

from .helpers import assert_tree_allclose, check_against_single_device, perturb

B, S, D, H, F = 2, 16, 32, 8, 64
LAYOUTS = ["dp=1,tp=1", "dp=1,tp=2", "dp=1,tp=4", "dp=1,tp=8", "dp=2,tp=4"]
# One block per style (rotary in both; SwiGLU in one, GELU and biases in the other).
CONFIGS: dict[str, dict[str, Any]] = {
    "megatron": dict(rotary=True, swiglu=True),
    "sequence": dict(rotary=True, bias=True),
}
STYLE_SPECS = {"megatron": P("dp"), "sequence": P("dp", "tp")}


def masters(block):
    """The block's global parameters in the plain layout (works on its gradients too)."""
    lin = lambda layer: {"w": layer.master_weight, **({"b": layer.master_bias} if layer.bias is not None else {})}  # noqa: E731
    return {
        "norm1": block.norm1.weight.value,
        "qkv": lin(block.attn.qkv),
        "proj": lin(block.attn.proj),
        "norm2": block.norm2.weight.value,
        "up": lin(block.mlp.up),
        "down": lin(block.mlp.down),
    }


# ------------------------------------------------------ an independent single-device block


def dense(p, x):
    y = jnp.einsum("bsi,oi->bso", x, p["w"])
    return y + jnp.broadcast_to(p["b"], y.shape) if "b" in p else y


def rms(x, w, eps=1e-6):
    scale = 1.0 / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps)
    return x * scale * jnp.broadcast_to(w, x.shape)


def rope(x):
    """RoPE as a complex rotation of (first half, second half) pairs: x [B, S, H, hd]."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half) * 2.0 / x.shape[-1])
    angle = jnp.arange(x.shape[1])[:, None] * freq[None, :]
    z = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * angle)[None, :, None, :]
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def plain_block(p, x, rotary=False, swiglu=False, bias=False):
    del bias  # present in `p` or not
    hd = D // H
    qkv = dense(p["qkv"], rms(x, p["norm1"]))
    q, k, v = (a.reshape(B, S, H, hd) for a in jnp.split(qkv, 3, axis=-1))
    if rotary:
        q, k = rope(q), rope(k)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, D)
    x = x + dense(p["proj"], att)
    h = dense(p["up"], rms(x, p["norm2"]))
    if swiglu:
        gate, up = jnp.split(h, 2, axis=-1)
        h = jax.nn.silu(gate) * up
    else:
        h = jax.nn.gelu(h)
    return x + dense(p["down"], h)


# ------------------------------------------------------------------------------- fixture


@functools.cache
def problem():
    key = jax.random.key(2)
    kb, kp, kx = jax.random.split(key, 3)
    blocks = {
        style: perturb(TransformerBlock(D, H, F, style=style, key=jax.random.fold_in(kb, i), **CONFIGS[style]), kp)
        for i, style in enumerate(STYLE_SPECS)
    }
    x = jax.random.normal(kx, (B, S, D))
    return blocks, x


def apply(blocks, xs):
    return {style: block(xs[style]) for style, block in blocks.items()}


def reference(blocks, xs):
    """The independent single-device block on the blocks' master weights."""
    return {n: plain_block(masters(b), xs[n], **CONFIGS[n]) for n, b in blocks.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_equals_single_device_block_in_both_styles(layout):
    blocks, x = problem()
    xs = {style: es.Sharded(x, spec) for style, spec in STYLE_SPECS.items()}
    check_against_single_device(blocks, apply, xs, [layout], out_specs=STYLE_SPECS, reference=reference)


def test_same_key_same_parameters_in_both_styles_and_outside_shard_map(getkey):
    key = getkey()
    meg = TransformerBlock(D, H, F, style="megatron", rotary=True, key=key)
    seq = TransformerBlock(D, H, F, style="sequence", rotary=True, key=key)
    for a, b in zip(jax.tree.leaves(meg), jax.tree.leaves(seq), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Outside any shard_map (the axis not bound) either style is the plain block.
    blocks, x = problem()
    for style, block in blocks.items():
        got = eqx.filter_jit(lambda b, x: b(x))(block, x)
        want = jax.jit(functools.partial(plain_block, **CONFIGS[style]))(masters(block), x)
        assert_tree_allclose(got, want)


def test_configuration_errors_name_the_layer_and_value():
    key = jax.random.key(0)
    with pytest.raises(es.LayerConfigError, match=r"TransformerBlock: unknown style 'sequential'"):
        TransformerBlock(D, H, F, style="sequential", key=key)
    with pytest.raises(es.LayerConfigError, match=r"ParallelAttention: n_heads=5 does not divide d_model=32"):
        TransformerBlock(D, 5, F, key=key)
    with pytest.raises(es.LayerConfigError, match=r"ParallelAttention: rotary embeddings need an even head size, got d_model/n_heads = 3"):
        TransformerBlock(12, 4, F, rotary=True, key=key)
    # Heads that do not split over the axis: refused at trace time, before XLA.
    mesh = es.make_mesh("tp=4")
    block = TransformerBlock(24, 6, F, key=key)
    fn = es.filter_shard_map(lambda block, x: block(x), mesh=mesh)
    with pytest.raises(es.LayerConfigError, match=r"ParallelAttention: n_heads=6 is not divisible by 4, the size of mesh axis 'tp'"):
        jax.eval_shape(fn, block, jnp.ones((S, 24)))


# ------------------------------------------------------------- grouped-query attention

# Per block: (n_kv_heads, kv_replicated, style) and the layouts it runs on: split key/value
# heads need tp | n_kv_heads; replicated ones serve any tp (Megatron's rule for tp > n_kv).
GQA_BLOCKS: dict[str, tuple[int, bool, str]] = {
    "gqa_split": (4, False, "megatron"),
    "gqa_replicated": (2, True, "sequence"),
    "mqa": (1, True, "megatron"),
}
GQA_LAYOUTS = {
    "dp=1,tp=4": ("gqa_split", "gqa_replicated", "mqa"),
    "dp=1,tp=8": ("gqa_replicated", "mqa"),
    "dp=2,tp=4": ("gqa_split", "gqa_replicated", "mqa"),
}


def gqa_masters(block):
    """Global parameters of a GQA block: q and kv weights `[out, in]` (kv: keys then values)."""
    attn = block.attn
    kv = attn.kv
    kv_w = kv.master_weight if isinstance(kv, es.nn.ColumnParallelLinear) else kv.weight.value.reshape(-1, D)
    return {
        "norm1": block.norm1.weight.value,
        "q": {"w": attn.q.master_weight},
        "kv": {"w": kv_w},
        "proj": {"w": attn.proj.master_weight},
        "norm2": block.norm2.weight.value,
        "up": {"w": block.mlp.up.master_weight},
        "down": {"w": block.mlp.down.master_weight},
    }


def plain_gqa_block(p, x, n_kv):
    """An independent single-device GQA block (rotary, SwiGLU): key/value heads repeated."""
    hd = D // H
    h = rms(x, p["norm1"])
    q = dense(p["q"], h).reshape(B, S, H, hd)
    k, v = (a.reshape(B, S, n_kv, hd) for a in jnp.split(dense(p["kv"], h), 2, axis=-1))
    k, v = (jnp.repeat(a, H // n_kv, axis=2) for a in (k, v))
    q, k = rope(q), rope(k)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, D)
    x = x + dense(p["proj"], att)
    gate, up = jnp.split(dense(p["up"], rms(x, p["norm2"])), 2, axis=-1)
    return x + dense(p["down"], jax.nn.silu(gate) * up)


@functools.cache
def gqa_problem():
    kb, kp, kx = jax.random.split(jax.random.key(3), 3)
    blocks = {
        name: perturb(
            TransformerBlock(D, H, F, n_kv_heads=n_kv, kv_replicated=rep, style=style, rotary=True, swiglu=True, key=jax.random.fold_in(kb, i)),
            kp,
        )
        for i, (name, (n_kv, rep, style)) in enumerate(GQA_BLOCKS.items())
    }
    return blocks, jax.random.normal(kx, (B, S, D))


@pytest.mark.parametrize("layout", list(GQA_LAYOUTS))
def test_grouped_query_attention_equals_single_device_reference(layout):
    """GQA and MQA blocks, key/value heads split (tp <= n_kv) or replicated (tp > n_kv)."""
    all_blocks, x = gqa_problem()
    blocks = {n: all_blocks[n] for n in GQA_LAYOUTS[layout]}
    specs = {n: STYLE_SPECS[GQA_BLOCKS[n][2]] for n in blocks}
    xs = {n: es.Sharded(x, specs[n]) for n in blocks}

    def reference(blocks, xs):
        return {n: plain_gqa_block(gqa_masters(b), xs[n], GQA_BLOCKS[n][0]) for n, b in blocks.items()}

    check_against_single_device(blocks, apply, xs, [layout], out_specs=specs, reference=reference)


def test_grouped_query_layouts_share_parameters_and_mha_keeps_its_layout(getkey):
    """The same key: the same global key/value weight split or replicated; MHA stays fused."""
    key = getkey()
    split = TransformerBlock(D, H, F, n_kv_heads=2, key=key)
    shared = TransformerBlock(D, H, F, n_kv_heads=2, kv_replicated=True, key=key)
    assert isinstance(split.attn.kv, es.nn.ColumnParallelLinear) and isinstance(shared.attn.kv, es.nn.SharedKVLinear)
    np.testing.assert_array_equal(split.attn.kv.weight.value, shared.attn.kv.weight.value)
    assert split.attn.kv.weight.spec == P(None, "tp", None) and shared.attn.kv.weight.spec == P(None, None, None)
    mha = TransformerBlock(D, H, F, n_kv_heads=H, key=key)
    assert mha.attn.qkv is not None and mha.attn.q is None and mha.attn.kv is None
    for a, b in zip(jax.tree.leaves(mha), jax.tree.leaves(TransformerBlock(D, H, F, key=key)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # GQA parameter count: q [D, D] + kv [2 * 2 * hd, D] instead of qkv [3 D, D].
    assert np.asarray(split.attn.kv.weight.value).size == 2 * 2 * (D // H) * D


def test_grouped_query_configuration_errors():
    key = jax.random.key(0)
    with pytest.raises(es.LayerConfigError, match=r"ParallelAttention: n_kv_heads=3 does not divide n_heads=8"):
        TransformerBlock(D, H, F, n_kv_heads=3, key=key)
    block = TransformerBlock(D, H, F, n_kv_heads=2, key=key)
    fn = es.filter_shard_map(lambda block, x: block(x), mesh=es.make_mesh("tp=4"), in_specs=(None, P()), out_specs=P())
    with pytest.raises(es.LayerConfigError, match=r"n_kv_heads=2 is not divisible by 4, the size of mesh axis 'tp'; build the layer with kv_replicated=True"):
        jax.eval_shape(fn, block, jnp.ones((S, D)))
