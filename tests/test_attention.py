"""Attention kernels and context-parallel attention against a plain softmax attention.

The reference (`reference_attention`) repeats the key/value heads for grouped queries,
builds the mask from positions and segment ids and applies `jax.nn.softmax`: the
textbook computation, single device. Every kernel is compared with it, value and
gradient, per array ‖a − b‖/‖b‖ ≤ 1e-5 in fp32. Shapes are small (head size 8) and one
jitted program serves each configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    AttentionMask,
    alltoall_attention,
    attention,
    blockwise_attention,
    context_positions,
    dense_attention,
    merge_attention,
    ring_attention,
    ring_attention_block_pairs,
    zigzag_indices,
    zigzag_permute,
    zigzag_unpermute,
)
from equishard.report import memory_stats

from .helpers import BF16_RTOL, FP32_RTOL, assert_tree_allclose, rel_err, subjaxprs


def reference_attention(q, k, v, *, causal=True, q_pos=None, kv_pos=None, q_seg=None, kv_seg=None):
    """Plain single-device softmax attention, `[B, S, H, D]`, keys repeated per group."""
    sq, sk = q.shape[-3], k.shape[-3]
    group = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
    q_pos = jnp.arange(sq) if q_pos is None else q_pos
    kv_pos = jnp.arange(sk) if kv_pos is None else kv_pos
    mask = jnp.ones((sq, sk), bool)
    if causal:
        mask = kv_pos[..., None, :] <= q_pos[..., :, None]
    if q_seg is not None and kv_seg is not None:
        mask = mask & (q_seg[..., :, None] == kv_seg[..., None, :])
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[..., None, :, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def qkv(b=2, s=40, h=4, hkv=2, d=8, dtype=jnp.float32, seed=0):
    return rand(seed, (b, s, h, d), dtype), rand(seed + 1, (b, s, hkv, d), dtype), rand(seed + 2, (b, s, hkv, d), dtype)


def value_and_grads(fn, q, k, v, *masks):
    """`fn`'s output and the gradients of a random projection of it w.r.t. q, k, v."""
    w = rand(99, q.shape, jnp.float32)

    def loss(q, k, v):
        out = fn(q, k, v, *masks)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def kernel_fn(name: str, causal: bool, masked: bool, block: int = 16):
    """`name`'s attention output as a function of `q, k, v` (and the masks if `masked`)."""

    def fn(q, k, v, *masks):
        kw = dict(zip(("q_pos", "kv_pos", "q_seg", "kv_seg"), masks)) if masked else {}
        if name == "reference":
            return reference_attention(q, k, v, causal=causal, **kw)
        mask = AttentionMask(causal, kw.get("q_pos"), kw.get("kv_pos"), kw.get("q_seg"), kw.get("kv_seg"))
        if name == "dense":
            return dense_attention(q, k, v, mask=mask)[0]
        return blockwise_attention(q, k, v, mask=mask, q_block_size=block, kv_block_size=block)[0]

    return fn


@functools.cache
def kernel(name: str, causal: bool, masked: bool, block: int = 16):
    """One jitted value-and-gradients program per kernel configuration."""
    return jax.jit(functools.partial(value_and_grads, kernel_fn(name, causal, masked, block)))


@functools.cache
def all_kernels(masked: bool):
    """One program: {(name, causal): (out, grads)} for the reference, dense and blockwise."""
    cases = [(n, c) for n in ("reference", "dense", "blockwise") for c in (True, False)]
    cases = [(n, c) for n, c in cases if c or not masked]

    def run(q, k, v, *masks):
        return {f"{n}-{c}": value_and_grads(kernel_fn(n, c, masked), q, k, v, *masks) for n, c in cases}

    return jax.jit(run)


def packed_masks(b: int, s: int):
    """Positions restarting at each document and segment ids of packed rows."""
    lengths = [[7, 13, s - 20], [s - 9, 9]][:b]
    seg = np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths])
    pos = np.stack([np.concatenate([np.arange(n) for n in ls]) for ls in lengths])
    return jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg)


# ---------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_kernel_equals_reference(heads):
    # Causal and not; 40 tokens in blocks of 16: the last query and key blocks are padded.
    q, k, v = qkv(h=heads[0], hkv=heads[1])
    results = all_kernels(False)(q, k, v)
    for causal in (True, False):
        for name in ("dense", "blockwise"):
            assert_tree_allclose(results[f"{name}-{causal}"], results[f"reference-{causal}"], FP32_RTOL)


def test_packed_sequences_with_positions_and_segments():
    q, k, v = qkv()
    results = all_kernels(True)(q, k, v, *packed_masks(2, 40))
    for name in ("dense", "blockwise"):
        assert_tree_allclose(results[f"{name}-True"], results["reference-True"], FP32_RTOL)


def test_blockwise_permuted_positions():
    # Tokens in a shuffled order with their positions: the causal mask follows positions.
    q, k, v = qkv(b=1, s=32)
    perm = np.random.default_rng(0).permutation(32)
    pos = jnp.asarray(perm)
    run = jax.jit(functools.partial(blockwise_attention, q_block_size=8, kv_block_size=8))
    out, _ = run(q[:, perm], k[:, perm], v[:, perm], mask=AttentionMask(True, pos, pos))
    want = reference_attention(q, k, v)[:, perm]
    assert rel_err(out, want) <= FP32_RTOL


def test_merge_of_disjoint_key_sets_is_exact():
    q, k, v = qkv(b=1, s=32)
    full, full_lse = dense_attention(q, k, v, mask=AttentionMask(False))
    # Keys split in two halves; queries see all of them.
    a = blockwise_attention(q, k[:, :12], v[:, :12], mask=AttentionMask(False), q_block_size=8, kv_block_size=8)
    b = dense_attention(q, k[:, 12:], v[:, 12:], mask=AttentionMask(False))
    out, lse = merge_attention(*a, *b)
    assert rel_err(out, full) <= FP32_RTOL
    assert rel_err(lse, full_lse) <= FP32_RTOL


def test_lse_gradient_flows():
    # A loss on the log-sum-exp too: the custom VJP handles its cotangent.
    q, k, v = qkv(b=1, s=24)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    blockwise = functools.partial(blockwise_attention, q_block_size=8, kv_block_size=8)
    both = jax.jit(lambda q, k, v: [jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v) for fn in (blockwise, dense_attention)])
    got, want = both(q, k, v)
    assert_tree_allclose(got, want, FP32_RTOL)


def test_rows_without_keys_give_zero():
    # A query whose segment has no key: output 0, lse -inf, finite gradients.
    q, k, v = qkv(b=1, s=16)
    q_seg = jnp.asarray([0] * 8 + [1] * 8)
    kv_seg = jnp.zeros(16, jnp.int32)
    run = functools.partial(
        blockwise_attention, mask=AttentionMask(False, q_segment_ids=q_seg, kv_segment_ids=kv_seg), q_block_size=8, kv_block_size=8
    )

    @jax.jit
    def outputs_and_grads(q, k, v):
        return run(q, k, v), jax.grad(lambda q: jnp.sum(run(q, k, v)[0]))(q)

    (out, lse), grads = outputs_and_grads(q, k, v)
    assert np.all(np.asarray(out[:, 8:]) == 0) and np.all(np.isneginf(np.asarray(lse[:, 8:])))
    assert np.all(np.isfinite(np.asarray(grads)))


def test_bf16_blockwise_close_to_fp32_reference():
    q, k, v = qkv(s=64, d=16)
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    got_out, got_grads = kernel("blockwise", True, False)(*low)
    want_out, want_grads = kernel("reference", True, False)(q, k, v)
    assert got_out.dtype == jnp.bfloat16
    assert rel_err(got_out, want_out) <= BF16_RTOL
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= BF16_RTOL


def test_blockwise_inside_shard_map():
    # Batch over dp=4, heads over tp=2: the varying types of the custom VJP line up.
    mesh = es.make_mesh("dp=4,tp=2")
    q, k, v = qkv(b=4, s=24)
    spec = P("dp", None, "tp", None)

    def local(q, k, v):
        return blockwise_attention(q, k, v, q_block_size=8, kv_block_size=8)[0]

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    got = jax.jit(functools.partial(value_and_grads, lambda q, k, v: sharded(q, k, v)))(q, k, v)
    want = kernel("reference", True, False)(q, k, v)
    assert_tree_allclose(got, want, FP32_RTOL)


def test_dispatcher_choices_agree():
    q, k, v = qkv(b=1, s=24)

    @jax.jit
    def each(q, k, v):
        return [attention(q, k, v, implementation=impl, block_size=8) for impl in (None, "dense", "blockwise")]

    want = reference_attention(q, k, v)
    for got in each(q, k, v):
        assert rel_err(got, want) <= FP32_RTOL
    # Below the threshold the dispatcher traces no loop; at or above it, the blockwise loops.
    small = jax.make_jaxpr(lambda q, k, v: attention(q, k, v, blockwise_threshold=25))(q, k, v)
    large = jax.make_jaxpr(lambda q, k, v: attention(q, k, v, blockwise_threshold=24, block_size=8))(q, k, v)
    assert "while" not in str(small) and "while" in str(large)


def test_misconfiguration_raises():
    q, k, v = qkv(h=4, hkv=3)
    with pytest.raises(es.LayerConfigError, match="n_kv_heads=3"):
        blockwise_attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(es.LayerConfigError, match="implementation"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(es.LayerConfigError, match="q_positions has shape"):
        blockwise_attention(q, k, v, mask=AttentionMask(q_positions=jnp.arange(7)))
    with pytest.raises(es.LayerConfigError, match="both q_segment_ids and kv_segment_ids"):
        dense_attention(q, k, v, mask=AttentionMask(q_segment_ids=jnp.zeros(40, jnp.int32)))
    with pytest.raises(es.LayerConfigError, match="q_block_size"):
        blockwise_attention(q, k, v, q_block_size=0)


def attention_temp_bytes(seq: int, *, heads: int = 2, head_dim: int = 16, block: int = 512, layers: int = 0) -> int:
    """Temporaries of a compiled blockwise-attention forward+backward program at `seq`
    tokens: one call, or (`layers`) a `scan` of that many layers, each attending from the
    previous one's output, as a model's layers run."""

    def attend(q, k, v):
        return blockwise_attention(q, k, v, q_block_size=block, kv_block_size=block)[0]

    def loss(q, k, v):
        if layers:
            out, _ = jax.lax.scan(lambda x, _: (x + attend(x, x, x), None), q + k + v, None, length=layers)
        else:
            out = attend(q, k, v)
        return jnp.sum(out * out)

    shape = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    stats = memory_stats(compiled)
    assert stats is not None
    return stats.temp_bytes


@pytest.mark.parametrize("layers", [0, 2])
def test_blockwise_memory_grows_linearly(layers):
    # Quadratic scores would give 4x from 4096 to 8192 tokens; the blockwise program's
    # temporaries (per-block scores plus O(S) carries) grow by at most 2.2x. Inside a
    # scan of layers too: there JAX's partial evaluation would hoist whatever depends
    # only on the positions (every block pair's mask) out of the layers' loop, had the
    # kernel's loops been scans.
    t4, t8 = attention_temp_bytes(4096, layers=layers), attention_temp_bytes(8192, layers=layers)
    assert t8 <= 2.2 * t4, (t4, t8)


# ---------------------------------------------------------------------------- context parallelism

SEQ_SPEC = P(None, "cp", None, None)


def cp_variants(cp: int, heads: int):
    """(name, layout, implementation) of the context-parallel variants `cp` and `heads` allow."""
    out = [("ring-contiguous", "contiguous", "ring"), ("ring-zigzag", "zigzag", "ring")]
    if heads % cp == 0:
        out += [("alltoall-contiguous", "contiguous", "alltoall"), ("alltoall-zigzag", "zigzag", "alltoall")]
    return out


@functools.cache
def context_parallel_program(cp: int, heads: int):
    """One program: every variant, causal and not, value and gradients, against the reference."""
    mesh = es.make_mesh(f"cp={cp}")

    def sharded(layout, impl, causal):
        def local(q, k, v):
            if impl == "ring":
                return ring_attention(q, k, v, "cp", mask=AttentionMask(causal), layout=layout, block_size=4)
            return alltoall_attention(q, k, v, "cp", mask=AttentionMask(causal), layout=layout, block_size=8)

        fn = jax.shard_map(local, mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC)
        if layout == "contiguous":
            return fn
        # Tokens enter in zigzag order and leave in token order again.
        zz = functools.partial(zigzag_permute, cp=cp, axis=1)
        return lambda q, k, v: zigzag_unpermute(fn(zz(q), zz(k), zz(v)), cp, axis=1)

    def run(q, k, v):
        results = {}
        for causal in (True, False):
            results[f"reference-{causal}"] = value_and_grads(kernel_fn("reference", causal, False), q, k, v)
            for name, layout, impl in cp_variants(cp, heads):
                results[f"{name}-{causal}"] = value_and_grads(sharded(layout, impl, causal), q, k, v)
        return results

    return jax.jit(run)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_equals_reference(cp):
    # GQA (4 query heads, 2 key/value heads), 64 tokens; causal and not; ring with the
    # contiguous and the zigzag split, all-to-all where the heads divide by cp.
    q, k, v = qkv(b=2, s=64, h=4, hkv=2)
    results = context_parallel_program(cp, 4)(q, k, v)
    for causal in (True, False):
        for name, _, _ in cp_variants(cp, 4):
            assert_tree_allclose(results[f"{name}-{causal}"], results[f"reference-{causal}"], FP32_RTOL)


def test_context_parallel_inside_dp_cp_tp():
    # dp=2 (batch), cp=2 (sequence), tp=2 (heads: 2 query heads and 1 key/value head each).
    mesh = es.make_mesh("dp=2,cp=2,tp=2")
    spec = P("dp", "cp", "tp", None)
    zz = functools.partial(zigzag_permute, cp=2, axis=1)
    q, k, v = qkv(b=2, s=32, h=4, hkv=2)

    def sharded(attend):
        fn = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return lambda q, k, v: zigzag_unpermute(fn(zz(q), zz(k), zz(v)), 2, axis=1)

    ring = sharded(lambda q, k, v: ring_attention(q, k, v, "cp", layout="zigzag", block_size=4))
    ulysses = sharded(lambda q, k, v: alltoall_attention(q, k, v, "cp", layout="zigzag"))

    @jax.jit
    def run(q, k, v):
        return [value_and_grads(fn, q, k, v) for fn in (ring, ulysses, kernel_fn("reference", True, False))]

    got_ring, got_ulysses, want = run(q, k, v)
    assert_tree_allclose(got_ring, want, FP32_RTOL)
    assert_tree_allclose(got_ulysses, want, FP32_RTOL)


def test_ring_padded_blocks_unchecked_and_over_an_axis_tuple():
    # On dp=2,cp=4: 40 tokens over cp, 10 per device in blocks of 4 (padded inside),
    # without the varying-axes check; and a ring over the combined axis ("cp", "dp"),
    # 5 tokens per device.
    q, k, v = qkv(b=2, s=40)
    mesh2 = es.make_mesh("dp=2,cp=4")
    batch_spec, tuple_spec = P("dp", "cp", None, None), P(None, ("cp", "dp"), None, None)
    unchecked = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, "cp", block_size=4),
        mesh=mesh2, in_specs=(batch_spec,) * 3, out_specs=batch_spec, check_vma=False,
    )  # fmt: skip
    over_tuple = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, ("cp", "dp"), block_size=4),
        mesh=mesh2, in_specs=(tuple_spec,) * 3, out_specs=tuple_spec,
    )  # fmt: skip

    @jax.jit
    def run(q, k, v):
        return [value_and_grads(fn, q, k, v) for fn in (unchecked, over_tuple, kernel_fn("reference", True, False))]

    got_unchecked, got_tuple, want = run(q, k, v)
    assert_tree_allclose(got_unchecked, want, FP32_RTOL)
    assert_tree_allclose(got_tuple, want, FP32_RTOL)


def test_ring_with_packed_segments():
    # Packed documents: positions restart per document; zigzag-permuted with the tokens.
    cp, mesh = 4, es.make_mesh("cp=4")
    q, k, v = qkv(b=2, s=64)
    pos, _, seg, _ = packed_masks(2, 64)
    zz = functools.partial(zigzag_permute, cp=cp, axis=1)
    row = P(None, "cp")

    def local(q, k, v, pos, seg):
        return ring_attention(q, k, v, "cp", mask=AttentionMask(True, pos, pos, seg, seg), block_size=4)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(SEQ_SPEC,) * 3 + (row, row), out_specs=SEQ_SPEC)

    @jax.jit
    def both(q, k, v):
        got = value_and_grads(lambda q, k, v: zigzag_unpermute(fn(zz(q), zz(k), zz(v), zz(pos), zz(seg)), cp, axis=1), q, k, v)
        want = value_and_grads(kernel_fn("reference", True, True), q, k, v, pos, pos, seg, seg)
        return got, want

    got, want = both(q, k, v)
    assert_tree_allclose(got, want, FP32_RTOL)


def test_zigzag_helpers():
    idx = zigzag_indices(16, 4)
    # Device i holds chunks i and 2*cp-1-i (chunks of 2 tokens).
    np.testing.assert_array_equal(idx.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
    x = jnp.arange(32.0).reshape(2, 16)
    np.testing.assert_array_equal(zigzag_unpermute(zigzag_permute(x, 4), 4), x)
    # Inside shard_map each device's positions are its slots' tokens.
    mesh = es.make_mesh("cp=4")
    for layout, want in (("zigzag", idx), ("contiguous", np.arange(16))):
        fn = jax.shard_map(lambda layout=layout: context_positions(4, "cp", layout=layout), mesh=mesh, in_specs=(), out_specs=P("cp"))
        np.testing.assert_array_equal(jax.jit(fn)(), want)


def test_zigzag_balances_causal_work():
    # Block pairs the kernel computes per device (fully-masked pairs skipped), cp=8, 256
    # tokens in blocks of 8: zigzag within 5 % between devices; the contiguous split
    # gives the last device ~(2 cp - 1)x the first's work.
    cp, mesh = 8, es.make_mesh("cp=8")
    q, k, v = qkv(b=1, s=256, h=2, hkv=1)
    counts = {}
    for layout in ("contiguous", "zigzag"):
        fn = jax.shard_map(
            lambda q, k, v, layout=layout: ring_attention_block_pairs(q, k, v, "cp", layout=layout, block_size=8)[None],
            mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=P("cp"),
        )  # fmt: skip
        counts[layout] = np.asarray(jax.jit(fn)(q, k, v))
    zz, plain = counts["zigzag"], counts["contiguous"]
    assert (zz.max() - zz.min()) / zz.max() <= 0.05, zz
    # Contiguous (chunks of 4 blocks): device i computes i full chunk pairs of 16 block
    # pairs and a diagonal of 10: 10 to 122 pairs, the last device 12.2x the first.
    np.testing.assert_array_equal(plain, [16 * i + 10 for i in range(cp)])
    # Zigzag (chunks of 2 blocks): 2 cp - 1 full chunk pairs of 4 and two diagonals of 3.
    np.testing.assert_array_equal(zz, [4 * (2 * cp - 1) + 2 * 3] * cp)


def _ancestors(eqns, var) -> set[int]:
    """Indices of the equations `var` depends on (transitively) within one jaxpr."""
    producer = {id(o): i for i, e in enumerate(eqns) for o in e.outvars}
    seen: set[int] = set()
    stack = [var]
    while stack:
        i = producer.get(id(stack.pop()))
        if i is None or i in seen:
            continue
        seen.add(i)
        stack.extend(v for v in eqns[i].invars if not isinstance(v, jax.extend.core.Literal))
    return seen


def _ring_bodies(jaxpr) -> list:
    """The bodies of the scans that contain a ppermute (the ring loops), found recursively."""
    found = []
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn):
            if eqn.primitive.name == "scan" and any(e.primitive.name == "ppermute" for e in sub.eqns):
                found.append(sub)
            found.extend(_ring_bodies(sub))
    return found


def test_ring_transfer_does_not_wait_for_compute():
    # In the forward and backward ring loops, the ppermute that fetches the next key/value
    # block depends on no computation of the current block (no dot_general, no loop over
    # blocks): it is issued first and a backend that overlaps can hide it.
    mesh = es.make_mesh("cp=4")
    q, k, v = qkv(b=1, s=32)
    fn = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "cp", block_size=4), mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC)
    jaxpr = jax.make_jaxpr(lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v))(q, k, v)
    bodies = _ring_bodies(jaxpr.jaxpr)
    assert len(bodies) == 2, "expected one forward and one backward ring loop"
    compute = {"dot_general", "scan", "while", "cond"}
    for body in bodies:
        eqns = body.eqns
        first_compute = min(i for i, e in enumerate(eqns) if e.primitive.name in compute)
        kv_transfer = next(e for e in eqns if e.primitive.name == "ppermute")
        index = eqns.index(kv_transfer)
        assert index < first_compute
        deps = set().union(*(_ancestors(eqns, v) for v in kv_transfer.invars))
        assert not any(eqns[i].primitive.name in compute for i in deps)


def test_context_parallel_misconfiguration():
    mesh = es.make_mesh("cp=8")
    q, k, v = qkv(b=1, s=64, h=4, hkv=2)
    fn = jax.shard_map(lambda q, k, v: alltoall_attention(q, k, v, "cp"), mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC)
    with pytest.raises(es.LayerConfigError, match="n_heads=4 is not divisible by the size 8"):
        jax.jit(fn)(q, k, v)
    with pytest.raises(es.LayerConfigError, match="seq_len=20 must be a multiple of 2 \\* cp = 8"):
        zigzag_indices(20, 4)
    with pytest.raises(es.LayerConfigError, match="layout='zig'"):
        jax.jit(jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "cp", layout="zig"), mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC))(q, k, v)


def ring_temp_bytes(cp: int, *, seq: int, heads: int, kv_heads: int, head_dim: int, block: int) -> int:
    """Per-device temporaries of a compiled ring-attention forward+backward program."""
    mesh = es.make_mesh(f"cp={cp}")
    fn = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, "cp", block_size=block),
        mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC,
    )  # fmt: skip

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * out)

    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.float32)
    stats = memory_stats(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile())
    assert stats is not None
    return stats.temp_bytes


def test_ring_memory_scales_with_one_over_cp():
    # S = 4096, 8 query heads and 1 key/value head of 64, blocks of 32. The formula:
    # the cp = 1 temporaries divided by cp, plus the two blocks in flight on the ring (the
    # next K and V, each f32[S/cp, kv_heads, head_dim]) when cp > 1.
    shape = {"seq": 4096, "heads": 8, "kv_heads": 1, "head_dim": 64, "block": 32}
    temps = {cp: ring_temp_bytes(cp, **shape) for cp in (1, 2, 4, 8)}
    for cp, measured in temps.items():
        in_flight = 2 * (4096 // cp) * 1 * 64 * 4 if cp > 1 else 0
        formula = temps[1] / cp + in_flight
        assert abs(measured - formula) <= 0.15 * formula, (cp, measured, formula)
    assert temps[4] <= 0.45 * temps[1], temps
