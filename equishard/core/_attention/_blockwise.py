"""`blockwise_attention`: attention block by block with an online softmax, and
`merge_attention`, which merges partial results over disjoint keys by their
log-sum-exp.

Query blocks outside, key/value blocks inside; the `[Sq, Sk]` matrix never exists, and
the backward pass (a custom VJP) recomputes each block's scores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._common import (
    CAUSAL,
    DEFAULT_BLOCK_SIZE,
    AttentionMask,
    _Canon,
    _canonical,
    _check_block,
    _from_canonical,
    _mask,
    _reduce_to,
    _scale,
    _vary_like,
)


def _pad_to(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _padded(c: _Canon, bq: int, bk: int) -> _Canon:
    """Pad queries to a multiple of `bq` and keys to a multiple of `bk` (padded keys invalid)."""
    sq, sk = c.q.shape[1], c.k.shape[1]
    nq, nk = -(-sq // bq) * bq, -(-sk // bk) * bk
    return _Canon(
        q=_pad_to(c.q, 1, nq), k=_pad_to(c.k, 1, nk), v=_pad_to(c.v, 1, nk),
        q_pos=_pad_to(c.q_pos, 1, nq), kv_pos=_pad_to(c.kv_pos, 1, nk),
        q_seg=_pad_to(c.q_seg, 1, nq), kv_seg=_pad_to(c.kv_seg, 1, nk),
        kv_valid=_pad_to(c.kv_valid, 1, nk, False),
    )  # fmt: skip


def _rows(x: Array, start: Array, size: int) -> Array:
    """`x[:, start:start + size]` for a traced `start` (a view of one block, no copy of `x`)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _set_rows(x: Array, block: Array, start: Array) -> Array:
    """`x` with `x[:, start:start + len(block)] = block` (in place in the compiled loop)."""
    return jax.lax.dynamic_update_slice_in_dim(x, block, start, axis=1)


def _repeat(n: int, body: Callable[[Array, Any], Any], init: Any) -> Any:
    """`body(i, carry)` for `i` in `0, ..., n - 1`, as a `while_loop`.

    Not `fori_loop`, which becomes a `scan` for a static trip count: differentiating a
    model whose layers are a `scan` partially evaluates the layer's body, and JAX hoists
    out of that scan whatever depends only on values the same for every layer; inside
    a nested `scan` that means stacking per-iteration copies of each block pair's mask
    and fill values, `O(S^2)` memory for what the kernel computes block by block. A
    `while_loop` is not split that way. The kernels never differentiate their loops
    (they have custom VJPs), so they lose nothing.
    """

    def step(state: tuple[Array, Any]) -> tuple[Array, Any]:
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < n, step, (jnp.int32(0), init))[1]


def _flash_forward(
    c: _Canon, causal: bool, scale: float, bq: int, bk: int, state: tuple[Array, Array] | None = None
) -> tuple[Array, Array, Array]:
    """Online-softmax forward on a padded canonical layout.

    A loop over query blocks, each looping over the key/value blocks; the output is
    written block by block into one buffer. `state`, if given, is a running
    `(out f32[B, Sq, Hkv, G, D], lse f32[B, Sq, Hkv, G])` over other keys: the online
    softmax continues from it, so the result covers both key sets (the ring's merge,
    with no extra buffers).

    **Returns:** `(out f32[B, Sq, Hkv, G, D], lse f32[B, Sq, Hkv, G], computed i32[])`, the
    last the number of (query block, key block) pairs computed (fully masked ones skipped).
    """
    b, sq, hkv, g, d = c.q.shape
    refs = (c.q, c.k, c.v)
    if state is None:
        state = (
            _vary_like(jnp.zeros((b, sq, hkv, g, d), jnp.float32), *refs),
            _vary_like(jnp.full((b, sq, hkv, g), -jnp.inf, jnp.float32), *refs),
        )

    def q_block(i, carry):
        out, lse, n = carry
        start = i * bq
        qi, qp, qs = _rows(c.q, start, bq), _rows(c.q_pos, start, bq), _rows(c.q_seg, start, bq)

        def kv_step(j, carry):
            kstart = j * bk
            kj, vj, kp, ks, kval = (_rows(x, kstart, bk) for x in (c.k, c.v, c.kv_pos, c.kv_seg, c.kv_valid))
            mask = _mask(qp, kp, qs, ks, kval, causal)  # bool[B, bq, bk]

            def compute(carry):
                m, l, acc, n = carry
                # [B, bq, Hkv, G, D] x [B, bk, Hkv, D] -> f32[B, Hkv, G, bq, bk]
                s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kj, preferred_element_type=jnp.float32) * scale
                s = jnp.where(mask[:, None, None], s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                l = l * corr + jnp.sum(p, axis=-1)
                # f32[B, Hkv, G, bq, bk] x [B, bk, Hkv, D] -> f32[B, Hkv, G, bq, D]
                pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, l, acc * corr[..., None] + pv, n + 1

            return jax.lax.cond(jnp.any(mask), compute, lambda carry: carry, carry)

        # The running state as (max, normaliser, unnormalised output): (lse, 1, out).
        lse0 = jnp.moveaxis(_rows(lse, start, bq), 1, 3)  # f32[B, Hkv, G, bq]
        init = (lse0, jnp.where(jnp.isfinite(lse0), 1.0, 0.0), jnp.moveaxis(_rows(out, start, bq), 1, 3), n)
        m, l, acc, n = _repeat(c.k.shape[1] // bk, kv_step, init)
        ok = l > 0
        acc = acc / jnp.where(ok, l, 1.0)[..., None]
        m = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
        # f32[B, Hkv, G, bq(, D)] -> rows [start, start + bq) of f32[B, Sq, Hkv, G(, D)]
        return _set_rows(out, jnp.moveaxis(acc, 3, 1), start), _set_rows(lse, jnp.moveaxis(m, 3, 1), start), n

    n0 = _vary_like(jnp.zeros((), jnp.int32), *refs, *state)
    return _repeat(sq // bq, q_block, (*state, n0))


def _flash_backward(
    c: _Canon, lse: Array, delta: Array, dout: Array, causal: bool, scale: float, bq: int, bk: int,
    grads: tuple[Array, Array, Array] | None = None,
) -> tuple[Array, Array, Array]:
    """The backward pass of `_flash_forward`, recomputing each block's probabilities.

    `lse` (f32[B, Sq, Hkv, G]) normalises the probabilities (the merged log-sum-exp when
    the keys are one part of a larger set); `delta` is `sum(dout * out, -1) - dlse`.
    A loop over key/value blocks, each looping over the query blocks; the gradients are
    accumulated block by block in place. `grads`, if given, are running f32
    `(dq, dk, dv)` the results are added to.

    **Returns:** `(dq, dk, dv)` in f32, laid out like `c.q`, `c.k`, `c.v`.
    """
    refs = (c.q, c.k, c.v, dout)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    if grads is None:
        dq0, dk0, dv0 = (_vary_like(jnp.zeros(x.shape, jnp.float32), *refs) for x in (c.q, c.k, c.v))
        grads = (dq0, dk0, dv0)

    def kv_block(j, carry):
        dq, dk, dv = carry
        kstart = j * bk
        kj, vj = _rows(c.k, kstart, bk), _rows(c.v, kstart, bk)  # [B, bk, Hkv, D]
        kp, ks, kval = (_rows(x, kstart, bk) for x in (c.kv_pos, c.kv_seg, c.kv_valid))

        def q_block(i, carry):
            dq, dkj, dvj = carry
            start = i * bq
            qi, doi = _rows(c.q, start, bq), _rows(dout, start, bq)  # [B, bq, Hkv, G, D]
            li, di = (jnp.moveaxis(_rows(x, start, bq), 1, 3) for x in (lse_safe, delta))  # f32[B, Hkv, G, bq]
            mask = _mask(_rows(c.q_pos, start, bq), kp, _rows(c.q_seg, start, bq), ks, kval, causal)

            def compute(operand):
                dqi, dkj, dvj = operand
                # f32[B, Hkv, G, bq, bk]
                s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kj, preferred_element_type=jnp.float32) * scale
                p = jnp.where(mask[:, None, None], jnp.exp(s - li[..., None]), 0.0)
                # f32[B, Hkv, G, bq, bk] x [B, bq, Hkv, G, D] -> f32[B, bk, Hkv, D]
                dvj = dvj + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - di[..., None]) * scale
                dqi = dqi + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
                dkj = dkj + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
                return dqi, dkj, dvj

            dqi, dkj, dvj = jax.lax.cond(jnp.any(mask), compute, lambda o: o, (_rows(dq, start, bq), dkj, dvj))
            return _set_rows(dq, dqi, start), dkj, dvj

        dq, dkj, dvj = _repeat(c.q.shape[1] // bq, q_block, (dq, _rows(dk, kstart, bk), _rows(dv, kstart, bk)))
        return dq, _set_rows(dk, dkj, kstart), _set_rows(dv, dvj, kstart)

    dq, dk, dv = _repeat(c.k.shape[1] // bk, kv_block, grads)
    return dq, dk, dv


def _delta(out: Array, lse: Array, dout: Array, dlse: Array | None) -> Array:
    """`sum(dout * out, -1) - dlse` (f32[B, Sq, Hkv, G]); rows that see no key give 0."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if dlse is not None:
        delta = delta - jnp.where(jnp.isfinite(lse), dlse, 0.0)
    return delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid, causal, scale, bq, bk):
    c = _Canon(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid)
    out, lse, _ = _flash_forward(c, causal, scale, bq, bk)
    return out.astype(q.dtype), lse


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid, causal, scale, bq, bk):
    c = _Canon(q, k, v, q_pos, kv_pos, q_seg, kv_seg, kv_valid)
    out, lse, _ = _flash_forward(c, causal, scale, bq, bk)
    out = out.astype(q.dtype)
    return (out, lse), (c, out, lse)


def _flash_bwd(causal, scale, bq, bk, res, cts):
    c, out, lse = res
    dout, dlse = cts
    dout = _vary_like(dout.astype(c.q.dtype), out)
    delta = _delta(out, lse, dout, dlse)
    dq, dk, dv = _flash_backward(c, lse, delta, dout, causal, scale, bq, bk)
    grads = tuple(_reduce_to(g.astype(x.dtype), x) for g, x in ((dq, c.q), (dk, c.k), (dv, c.v)))
    return (*grads, None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _run_flash(c: _Canon, causal: bool, scale: float, bq: int, bk: int) -> tuple[Array, Array]:
    """`_flash` (the custom-VJP kernel) on a padded canonical layout: (out in q's dtype, f32 lse)."""
    out, lse = _flash(*c, causal, scale, bq, bk)  # pyright: ignore[reportGeneralTypeIssues]
    return out, lse

def blockwise_attention(
    q: Float[Array, "*batch q_seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    mask: AttentionMask = CAUSAL,
    scale: float | None = None,
    q_block_size: int = DEFAULT_BLOCK_SIZE,
    kv_block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[Float[Array, "*batch q_seq heads head_dim"], Float[Array, "*batch q_seq heads"]]:
    """Memory-efficient attention: an online softmax over key/value blocks.

    Queries are processed `q_block_size` rows at a time; for each query block the
    key/value blocks are visited in turn, keeping a running maximum, normaliser and
    output (the online softmax), so memory holds one `[q_block, kv_block]` score block,
    never the `[Sq, Sk]` matrix. Block pairs in which no query sees any key (above the
    causal diagonal, across segments) are skipped. The backward pass is a custom VJP
    that recomputes each block's probabilities from the saved log-sum-exp
    (FlashAttention's scheme). Lengths that do not divide by the block sizes are padded
    inside. See the "Long sequences" guide.

    **Arguments:**

    As `dense_attention`, and:

    - `q_block_size`, `kv_block_size`: rows per query block and per key/value block.

    **Returns:**

    `(out, lse)` as `dense_attention`: two partial results over disjoint key sets merge
    exactly with `merge_attention`.
    """
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
    name = "blockwise_attention"
    _check_block(name, "q_block_size", q_block_size)
    _check_block(name, "kv_block_size", kv_block_size)
    c = _canonical(name, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    bq, bk = min(q_block_size, c.q.shape[1]), min(kv_block_size, c.k.shape[1])
    out, lse = _run_flash(_padded(c, bq, bk), causal, _scale(scale, q.shape[-1]), bq, bk)
    return _from_canonical(out, lse, q)


def merge_attention(
    out_a: Float[Array, "*batch seq heads head_dim"],
    lse_a: Float[Array, "*batch seq heads"],
    out_b: Float[Array, "*batch seq heads head_dim"],
    lse_b: Float[Array, "*batch seq heads"],
) -> tuple[Float[Array, "*batch seq heads head_dim"], Float[Array, "*batch seq heads"]]:
    """Combine two attention results of the same queries over disjoint sets of keys.

    `out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)` with
    `lse = logaddexp(lse_a, lse_b)`: exactly the attention over the union of the keys.

    **Arguments:**

    - `out_a`, `lse_a`, `out_b`, `lse_b`: the outputs and log-sum-exps returned by
      `blockwise_attention` or `dense_attention`.

    **Returns:**

    `(out, lse)` over both key sets (`out` in `out_a`'s dtype).
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)[..., None]
    wb = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)[..., None]
    out = out_a.astype(jnp.float32) * wa + out_b.astype(jnp.float32) * wb
    return out.astype(out_a.dtype), lse
