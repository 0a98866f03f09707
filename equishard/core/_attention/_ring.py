"""`ring_attention`: context-parallel attention with the keys and values passed around
the ring of the context axis, one blockwise step per neighbour, under one custom VJP.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..._axes import cast_varying
from ..._errors import LayerConfigError
from ..._names import ZIGZAG
from .._collectives import (
    AxisName,
    combined_axis_size,
    ring_shift,
)
from ._blockwise import _delta, _flash_backward, _flash_forward, _padded
from ._common import (
    CAUSAL,
    DEFAULT_BLOCK_SIZE,
    AttentionMask,
    KeysValues,
    Queries,
    _Canon,
    _canonical,
    _check_block,
    _check_shapes,
    _reduce_to,
    _scale,
    _vary_like,
)
from ._zigzag import _check_layout, context_positions


def _kv_of(c: _Canon, axis_name, segmented: bool) -> tuple[Array, ...]:
    """The block that travels the ring, typed as varying along the ring's axes (as it arrives).

    Keys, values and their positions, and their segment ids if `segmented`; otherwise
    the segment ids (all zero) and the padding mask (every device pads alike) are the
    same on every device and stay local.
    """
    kv = (c.k, c.v, c.kv_pos, c.kv_seg) if segmented else (c.k, c.v, c.kv_pos)
    return cast_varying(kv, axis_name)


def _with_kv(c: _Canon, kv: tuple[Array, ...]) -> _Canon:
    """`c` with the travelling block's keys, values, positions (and segment ids) replaced."""
    return c._replace(**dict(zip(("k", "v", "kv_pos", "kv_seg"), kv)))


def _ring_forward(c: _Canon, axis_name, causal: bool, scale: float, bq: int, bk: int, segmented: bool):
    """Ring forward: `(out f32, lse f32, computed block pairs i32[])` on this device.

    Step `t` attends to the key/value block of the device `t` places behind; the
    transfer of the next block is issued before the current block's compute.
    """
    n = combined_axis_size(axis_name)
    refs = (c.q, c.k, c.v)
    b, sq, hkv, g, d = c.q.shape
    out = _vary_like(jnp.zeros((b, sq, hkv, g, d), jnp.float32), *refs)
    lse = _vary_like(jnp.full((b, sq, hkv, g), -jnp.inf, jnp.float32), *refs)
    count = _vary_like(jnp.zeros((), jnp.int32), *refs)
    out, lse, count = cast_varying((out, lse, count), axis_name)

    def attend(kv, out, lse, count):
        out, lse, m = _flash_forward(_with_kv(c, kv), causal, scale, bq, bk, (out, lse))
        return out, lse, count + m

    def step(carry, _):
        kv, out, lse, count = carry
        nxt = ring_shift(kv, axis_name, 1)  # block of the device t + 1 places behind
        out, lse, count = attend(kv, out, lse, count)
        return (nxt, out, lse, count), None

    (kv, out, lse, count), _ = jax.lax.scan(step, (_kv_of(c, axis_name, segmented), out, lse, count), None, length=n - 1)
    return attend(kv, out, lse, count)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid, axis_name, causal, scale, bq, bk, segmented):
    c = _Canon(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid)
    return _ring_forward(c, axis_name, causal, scale, bq, bk, segmented)[0].astype(q.dtype)


def _ring_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid, axis_name, causal, scale, bq, bk, segmented):
    c = _Canon(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid)
    out, lse, _ = _ring_forward(c, axis_name, causal, scale, bq, bk, segmented)
    out = out.astype(q.dtype)
    return out, (c, out, lse)


def _ring_bwd(axis_name, causal, scale, bq, bk, segmented, res, dout):
    """Ring backward: key/value blocks travel as in the forward pass, each with its
    gradient accumulator, which arrives home after the last step."""
    c, out, lse = res
    n = combined_axis_size(axis_name)
    dout = _vary_like(dout.astype(c.q.dtype), out)
    delta = _delta(out, lse, dout, None)
    refs = (c.q, c.k, c.v, dout)
    dq = _vary_like(jnp.zeros(c.q.shape, jnp.float32), *refs)
    dkv = (_vary_like(jnp.zeros(c.k.shape, jnp.float32), *refs),) * 2

    def attend(kv, dkv, dq):
        dq, dk, dv = _flash_backward(_with_kv(c, kv), lse, delta, dout, causal, scale, bq, bk, (dq, *dkv))
        return (dk, dv), dq

    def step(carry, _):
        kv, dkv, dq = carry
        nxt = ring_shift(kv, axis_name, 1)  # issued before this block's compute
        dkv, dq = attend(kv, dkv, dq)
        return (nxt, ring_shift(dkv, axis_name, 1), dq), None

    (kv, dkv, dq), _ = jax.lax.scan(step, (_kv_of(c, axis_name, segmented), cast_varying(dkv, axis_name), cast_varying(dq, axis_name)), None, length=n - 1)
    dkv, dq = attend(kv, dkv, dq)
    dk, dv = ring_shift(dkv, axis_name, 1)  # the last block's gradients go home
    grads = tuple(_reduce_to(g.astype(x.dtype), x) for g, x in ((dq, c.q), (dk, c.k), (dv, c.v)))
    return (*grads, None, None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _context_canonical(name, q, k, v, axis_name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, layout):
    """Canonical local blocks with global positions (defaults from `layout`)."""
    _check_layout(name, layout)
    _check_shapes(name, q, k, v)
    if q.shape[-3] != k.shape[-3]:
        raise LayerConfigError(
            f"{name}: queries and keys must be split alike over {axis_name!r}; got local "
            f"lengths {q.shape[-3]} (q) and {k.shape[-3]} (k)."
        )
    if q_positions is None:
        q_positions = context_positions(q.shape[-3], axis_name, layout=layout)
    if kv_positions is None:
        kv_positions = context_positions(k.shape[-3], axis_name, layout=layout)
    return _canonical(name, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def _ring_blocks(local_len: int, block_size: int, layout: str) -> int:
    """The kernel's block size on a device: at most one zigzag chunk, so chunks never share a block."""
    chunk = local_len // 2 if layout == ZIGZAG else local_len
    return max(1, min(block_size, chunk))


def ring_attention(
    q: Queries, k: KeysValues, v: KeysValues, axis_name: AxisName, *,
    mask: AttentionMask = CAUSAL,
    layout: str = "contiguous",
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Queries:
    """Attention over a sequence split across `axis_name`: ring attention.

    Valid inside `shard_map`. Each device keeps its query block; the key/value blocks
    (with their positions and segment ids) travel round the ring with `ppermute`, one
    step per device, and each is attended to with `blockwise_attention`'s kernel and
    merged by its log-sum-exp. The transfer of the next block is issued before the
    current block's compute, so a backend that overlaps can hide it. The backward pass
    (a custom VJP) rings too: key/value blocks travel with their gradient
    accumulators, so no device ever holds the whole sequence's keys and values.
    Fully-masked block pairs are skipped, so with `layout="zigzag"` and a causal mask
    every device does the same work. See the "Long sequences" guide.

    **Arguments:**

    - `q`: this device's `[..., S/cp, n_heads, head_dim]`.
    - `k`, `v`: this device's `[..., S/cp, n_kv_heads, head_dim]`.
    - `axis_name`: the context-parallel mesh axis (or a tuple of axes).
    - `mask`: which keys each query sees (`AttentionMask`), its positions and segment
      ids this device's (positions default to `context_positions(S/cp, axis_name,
      layout=layout)`, global).
    - `layout`: how the sequence is split, when positions are not given:
      `"contiguous"` (device `i` holds the `i`-th slice) or `"zigzag"` (the tokens
      were ordered by `zigzag_permute`).
    - `scale`: the score scale, default `1 / sqrt(head_dim)`.
    - `block_size`: the kernel's block size (capped at one zigzag chunk).

    **Returns:**

    This device's attention output, `q`'s shape and dtype.
    """
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
    name = "ring_attention"
    _check_block(name, "block_size", block_size)
    c = _context_canonical(name, q, k, v, axis_name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, layout)
    bs = _ring_blocks(c.q.shape[1], block_size, layout)
    segmented = q_segment_ids is not None
    out = _run_ring(_padded(c, bs, bs), axis_name, causal, _scale(scale, q.shape[-1]), bs, segmented)
    return out[:, : q.shape[-3]].reshape(q.shape)


def _run_ring(c: _Canon, axis_name, causal: bool, scale: float, bs: int, segmented: bool) -> Array:
    out: Any = _ring(*c, axis_name, causal, scale, bs, bs, segmented)  # pyright: ignore[reportGeneralTypeIssues]
    return out


def ring_attention_block_pairs(
    q: Queries, k: KeysValues, v: KeysValues, axis_name: AxisName, *,
    mask: AttentionMask = CAUSAL,
    layout: str = "contiguous",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Int[Array, ""]:
    """How many (query block, key/value block) pairs `ring_attention`'s forward pass computes here.

    Runs the same ring as `ring_attention` with the same arguments and returns the
    kernel's count of block pairs it computed on this device (fully-masked pairs
    skipped): the per-device work, to compare the contiguous and zigzag layouts.

    **Arguments:**

    As `ring_attention` (without `scale`).

    **Returns:**

    An int32 scalar, this device's count.
    """
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
    name = "ring_attention_block_pairs"
    c = _context_canonical(name, q, k, v, axis_name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, layout)
    bs = _ring_blocks(c.q.shape[1], block_size, layout)
    return _ring_forward(_padded(c, bs, bs), axis_name, causal, 1.0, bs, bs, q_segment_ids is not None)[2]
