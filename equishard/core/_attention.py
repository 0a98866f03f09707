"""Attention kernels on local blocks, valid inside `shard_map`.

- `dense_attention`: the plain softmax attention, the `[Sq, Sk]` scores in memory.
- `blockwise_attention`: the same result computed block by block with an online
  softmax (query blocks outside, key/value blocks inside); the `[Sq, Sk]` matrix never
  exists, and the backward pass (a custom VJP) recomputes each block's scores. Returns
  the per-row log-sum-exp, so partial results over disjoint keys merge exactly
  (`merge_attention`).
- `attention`: the dispatcher (cuDNN on a GPU where its rules allow; otherwise dense
  below `BLOCKWISE_THRESHOLD` keys and blockwise at or above it).

Every kernel supports grouped-query attention (`k` and `v` with `n_kv_heads` heads, a
divisor of the query's `n_heads`; query head `h` reads key/value head
`h // (n_heads // n_kv_heads)`), causal and non-causal masks, explicit positions (the
causal mask is `kv_position <= q_position`, so permuted or packed sequences mask
correctly) and segment ids (a query sees only keys of its own segment).

Shapes: `q` is `[..., Sq, n_heads, head_dim]`, `k` and `v` are
`[..., Sk, n_kv_heads, head_dim]`, positions and segment ids `[Sq]` / `[Sk]` or with
the same leading (batch) dimensions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._axes import cast_varying
from .._errors import LayerConfigError
from ._collectives import (
    AxisName,
    axis_tuple,
    combined_axis_size,
    mesh_ordered,
    ring_shift,
    varying_axes,
)

BLOCKWISE_THRESHOLD = 512
"""Key lengths at or above which `attention` uses the blockwise kernel (without cuDNN).

One default block: below it the blockwise kernel is a single block, the same
arithmetic as the dense one; from it on the blockwise kernel wins. Measured on XLA:CPU
(fp32, one row of 8 heads of 64, forward and backward, best of 3): 512 keys 0.20 s
dense vs 0.20 s blockwise, 1024 keys 1.66 s vs 0.58 s, 2048 keys 7.9 s vs 1.3 s.
"""

DEFAULT_BLOCK_SIZE = 512
"""The default query and key/value block size of the blockwise kernel."""

_IMPLEMENTATIONS = (None, "dense", "blockwise", "cudnn")


# ---------------------------------------------------------------------------
# Canonical layout: [B, S, Hkv, G, D] queries, [B, S, Hkv, D] keys/values, [B, S] ints


class _Canon(NamedTuple):
    q: Array  # [B, Sq, Hkv, G, D]
    k: Array  # [B, Sk, Hkv, D]
    v: Array  # [B, Sk, Hkv, D]
    q_pos: Array  # i32[B, Sq]
    kv_pos: Array  # i32[B, Sk]
    q_seg: Array  # i32[B, Sq]
    kv_seg: Array  # i32[B, Sk]
    kv_valid: Array  # bool[B, Sk]


def _check_shapes(name: str, q: Array, k: Array, v: Array) -> None:
    if q.ndim < 3 or k.ndim != q.ndim or v.shape != k.shape:
        raise LayerConfigError(
            f"{name}: expected q [..., Sq, n_heads, head_dim] and k, v [..., Sk, n_kv_heads, head_dim] "
            f"with the same leading dimensions; got q {q.shape}, k {k.shape}, v {v.shape}."
        )
    if q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1]:
        raise LayerConfigError(
            f"{name}: q {q.shape} and k {k.shape} differ in their leading dimensions or head_dim."
        )
    n_heads, n_kv = q.shape[-2], k.shape[-2]
    if n_heads % n_kv:
        raise LayerConfigError(
            f"{name}: n_kv_heads={n_kv} (k {k.shape}) does not divide n_heads={n_heads} (q {q.shape})."
        )


def _batch_ints(name: str, what: str, x: Array | None, batch: tuple[int, ...], seq: int, default: Array) -> Array:
    """`x` (`[S]` or `[*batch, S]`, integer) as i32[B, S]; `default` ([S]) when `x` is None."""
    b = math.prod(batch)
    if x is None:
        return jnp.broadcast_to(default.astype(jnp.int32), (b, seq))
    if x.shape not in ((seq,), (*batch, seq)):
        raise LayerConfigError(
            f"{name}: {what} has shape {x.shape}; expected ({seq},) or {(*batch, seq)}."
        )
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise LayerConfigError(f"{name}: {what} must be integers, got {x.dtype}.")
    return jnp.broadcast_to(x.astype(jnp.int32), (*batch, seq)).reshape(b, seq)


def _canonical(
    name: str, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids
) -> _Canon:
    _check_shapes(name, q, k, v)
    batch = q.shape[:-3]
    b = math.prod(batch)
    sq, h, d = q.shape[-3:]
    sk, hkv = k.shape[-3], k.shape[-2]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise LayerConfigError(f"{name}: give both q_segment_ids and kv_segment_ids, or neither.")
    zeros_q, zeros_k = jnp.zeros((sq,), jnp.int32), jnp.zeros((sk,), jnp.int32)
    return _Canon(
        q=q.reshape(b, sq, hkv, h // hkv, d),
        k=k.reshape(b, sk, hkv, d),
        v=v.reshape(b, sk, hkv, d),
        q_pos=_batch_ints(name, "q_positions", q_positions, batch, sq, jnp.arange(sq)),
        kv_pos=_batch_ints(name, "kv_positions", kv_positions, batch, sk, jnp.arange(sk)),
        q_seg=_batch_ints(name, "q_segment_ids", q_segment_ids, batch, sq, zeros_q),
        kv_seg=_batch_ints(name, "kv_segment_ids", kv_segment_ids, batch, sk, zeros_k),
        kv_valid=jnp.ones((b, sk), bool),
    )


def _mask(q_pos, kv_pos, q_seg, kv_seg, kv_valid, causal: bool) -> Array:
    """bool[B, Sq, Sk]: which keys each query sees."""
    mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & kv_valid[:, None, :]
    if causal:
        mask = mask & (kv_pos[:, None, :] <= q_pos[:, :, None])
    return mask


def _vary_like(x: Array, *refs: Array) -> Array:
    """`x` cast to vary along every manual axis any of `refs` varies along."""
    return cast_varying(x, frozenset().union(*(varying_axes(r) for r in refs)))


def _reduce_to(ct: Array, primal: Array) -> Array:
    """A cotangent summed over the manual axes it varies along but its primal does not."""
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, mesh_ordered(tuple(sorted(extra)))) if extra else ct


# ---------------------------------------------------------------------------
# Dense attention


def _select(pred: Array, x: Array, fill: float) -> Array:
    """`jnp.where(pred, x, fill)` as one `select_n` (`jnp.where` stages a nested function,
    which every transformation of a layer's trace then handles as a call)."""
    return jax.lax.select(jnp.broadcast_to(pred, x.shape), x, jax.lax.full_like(x, fill))


def _dense(c: _Canon, causal: bool, scale: float) -> tuple[Array, tuple[Array, Array, Array]]:
    """Dense attention on the canonical layout: f32[B, Sq, Hkv, G, D], and the row
    statistics `_dense_lse` takes (left to it, so a caller that does not read the
    log-sum-exp does not trace it)."""
    # [B, Sq, Hkv, G, D] x [B, Sk, Hkv, D] -> f32[B, Hkv, G, Sq, Sk]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", c.q, c.k, preferred_element_type=jnp.float32) * scale
    mask = _mask(c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, c.kv_valid, causal)[:, None, None]
    s = _select(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = _select(jnp.isfinite(m), m, 0.0)
    p = _select(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1)
    seen = l > 0  # bool[B, Hkv, G, Sq]: the query sees some key
    l = _select(seen, l, 1.0)
    p = p / l[..., None]
    # f32[B, Hkv, G, Sq, Sk] x [B, Sk, Hkv, D] -> f32[B, Sq, Hkv, G, D]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(c.v.dtype), c.v, preferred_element_type=jnp.float32)
    return out, (seen, l, m)


def _dense_lse(seen: Array, l: Array, m: Array) -> Array:
    """`_dense`'s log-sum-exp, f32[B, Sq, Hkv, G] (-inf for a row that sees no key)."""
    return jnp.moveaxis(_select(seen, jnp.log(l) + m[..., 0], -jnp.inf), -1, 1)


# ---------------------------------------------------------------------------
# Blockwise attention: forward and backward on the canonical layout, padded to blocks


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


# ---------------------------------------------------------------------------
# Public kernels


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check_block(name: str, what: str, size: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise LayerConfigError(f"{name}: {what} must be a positive int, got {size!r}.")


def _out_from_canonical(out: Array, q: Array) -> Array:
    """f32[B, Sq, Hkv, G, D] -> [..., Sq, H, D] in q's dtype."""
    return out[:, : q.shape[-3]].reshape(q.shape).astype(q.dtype)


def _from_canonical(out: Array, lse: Array, q: Array) -> tuple[Array, Array]:
    """(f32[B, Sq, Hkv, G, D], f32[B, Sq, Hkv, G]) -> ([..., Sq, H, D] in q's dtype, f32[..., Sq, H])."""
    return _out_from_canonical(out, q), lse[:, : q.shape[-3]].reshape(q.shape[:-1])


def dense_attention(
    q: Float[Array, "*batch q_seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    causal: bool = True,
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "*batch q_seq heads head_dim"], Float[Array, "*batch q_seq heads"]]:
    """Softmax attention with the whole `[Sq, Sk]` score matrix in memory.

    Fastest for short sequences; its memory grows with `Sq · Sk`. Grouped-query heads,
    masks and positions as described in the "Long sequences" guide.

    **Arguments:**

    - `q`: `[..., Sq, n_heads, head_dim]`.
    - `k`, `v`: `[..., Sk, n_kv_heads, head_dim]`, `n_kv_heads` dividing `n_heads`.
    - `causal`: mask keys whose position is after the query's.
    - `q_positions`, `kv_positions`: integer positions, `[Sq]` / `[Sk]` or with the
      leading dimensions of `q`; default `0, 1, 2, ...`.
    - `q_segment_ids`, `kv_segment_ids`: integer segment ids of packed sequences (a
      query sees only keys of its own segment); both or neither.
    - `scale`: the score scale, default `1 / sqrt(head_dim)`.

    **Returns:**

    `(out, lse)`: the attention output (`q`'s shape and dtype) and the float32
    log-sum-exp of each query row's scores (`-inf` for a row that sees no key, whose
    output is zero).
    """
    c = _canonical("dense_attention", q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out, stats = _dense(c, causal, _scale(scale, q.shape[-1]))
    return _from_canonical(out, _dense_lse(*stats), q)


def blockwise_attention(
    q: Float[Array, "*batch q_seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    causal: bool = True,
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
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


def cudnn_supported(q: Array, k: Array, *, causal: bool, positions: bool) -> bool:
    """Whether `jax.nn.dot_product_attention(implementation="cudnn")` serves this call.

    Its rules: a GPU backend, float16/bfloat16 inputs, a head size that is a multiple of
    8 and at most 128, default positions and no segment ids (`positions=False`), and equal
    query and key lengths when causal.

    **Arguments:**

    - `q`, `k`: the query and key arrays.
    - `causal`: whether the mask is causal.
    - `positions`: whether explicit positions or segment ids are given.

    **Returns:**

    `True` when the cuDNN kernel applies.
    """
    if jax.default_backend() != "gpu" or positions:
        return False
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 128:
        return False
    return not (causal and q.shape[-3] != k.shape[-3])


def attention(
    q: Float[Array, "*batch q_seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    causal: bool = True,
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    blockwise_threshold: int = BLOCKWISE_THRESHOLD,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Float[Array, "*batch q_seq heads head_dim"]:
    """Softmax attention by the kernel that suits the backend and the length.

    With `implementation=None`: `jax.nn.dot_product_attention`'s cuDNN kernel where
    `cudnn_supported` says it applies, otherwise `dense_attention` for fewer than
    `blockwise_threshold` keys and `blockwise_attention` from there on. All paths give
    the same values (see the "Long sequences" guide).

    **Arguments:**

    As `dense_attention`, and:

    - `implementation`: `None` (choose), `"dense"`, `"blockwise"` or `"cudnn"`.
    - `blockwise_threshold`: the key length from which `None` chooses the blockwise
      kernel (default `BLOCKWISE_THRESHOLD`, measured on the CPU).
    - `block_size`: the blockwise kernel's query and key/value block size.

    **Returns:**

    The attention output, `q`'s shape and dtype.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise LayerConfigError(
            f"attention: implementation={implementation!r}; expected one of {_IMPLEMENTATIONS}."
        )
    masks = {
        "q_positions": q_positions, "kv_positions": kv_positions,
        "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
    }  # fmt: skip
    explicit = any(x is not None for x in masks.values())
    if implementation is None:
        if cudnn_supported(q, k, causal=causal, positions=explicit):
            implementation = "cudnn"
        else:
            implementation = "blockwise" if k.shape[-3] >= blockwise_threshold else "dense"
    if implementation == "cudnn":
        if explicit:
            raise LayerConfigError(
                "attention: implementation='cudnn' takes no positions or segment ids; use "
                "'blockwise' or 'dense'."
            )
        _check_shapes("attention", q, k, v)
        batch = q.shape[:-3]
        flat = [x.reshape(math.prod(batch), *x.shape[-3:]) for x in (q, k, v)]
        out = jax.nn.dot_product_attention(
            *flat, scale=scale, is_causal=causal, implementation="cudnn"
        )
        return out.reshape(q.shape)
    if implementation == "dense":
        # The output alone: the log-sum-exp is not traced.
        c = _canonical("dense_attention", q, k, v, *masks.values())
        return _out_from_canonical(_dense(c, causal, _scale(scale, q.shape[-1]))[0], q)
    return blockwise_attention(
        q, k, v, causal=causal, scale=scale, q_block_size=block_size, kv_block_size=block_size, **masks
    )[0]


# ---------------------------------------------------------------------------
# Context parallelism: the sequence split over a mesh axis

_LAYOUTS = ("contiguous", "zigzag")


def _check_layout(name: str, layout: str) -> None:
    if layout not in _LAYOUTS:
        raise LayerConfigError(f"{name}: layout={layout!r}; expected one of {_LAYOUTS}.")


def zigzag_indices(seq_len: int, cp: int) -> np.ndarray:
    """The token order of the zigzag split: which global token goes to each slot.

    The sequence is cut into `2 * cp` equal chunks and device `i` of the `cp` axis
    holds chunks `i` and `2 * cp - 1 - i`, so under a causal mask every device has the
    same work. Sharding `x[..., zigzag_indices(S, cp)]` evenly over the axis gives each
    device its two chunks.

    **Arguments:**

    - `seq_len`: the global sequence length, a multiple of `2 * cp`.
    - `cp`: the size of the context-parallel axis.

    **Returns:**

    An int array `[seq_len]`: slot `j` holds token `zigzag_indices(S, cp)[j]` (which is
    also that slot's position).
    """
    if cp < 1 or seq_len % (2 * cp):
        raise LayerConfigError(
            f"zigzag split: seq_len={seq_len} must be a multiple of 2 * cp = {2 * cp}."
        )
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return chunks[order].reshape(-1)


def zigzag_permute(x: Array, cp: int, *, axis: int = -1) -> Array:
    """Reorder the sequence axis of `x` into the zigzag split (tokens, positions, labels, masks alike).

    **Arguments:**

    - `x`: a global array (before sharding over the `cp` axis).
    - `cp`: the size of the context-parallel axis.
    - `axis`: the sequence axis.

    **Returns:**

    `x` with its sequence axis in `zigzag_indices` order.
    """
    return jnp.take(x, jnp.asarray(zigzag_indices(x.shape[axis], cp)), axis=axis)


def zigzag_unpermute(x: Array, cp: int, *, axis: int = -1) -> Array:
    """Undo `zigzag_permute`: the sequence axis back in token order.

    **Arguments:**

    - `x`: a global array in zigzag order.
    - `cp`: the size of the context-parallel axis.
    - `axis`: the sequence axis.

    **Returns:**

    `x` with its sequence axis in token order.
    """
    inverse = np.argsort(zigzag_indices(x.shape[axis], cp))
    return jnp.take(x, jnp.asarray(inverse), axis=axis)


def context_positions(local_len: int, axis_name: AxisName, *, layout: str = "contiguous") -> Int[Array, " local_len"]:
    """The global positions of this device's tokens when the sequence is split over `axis_name`.

    Valid inside `shard_map`. `"contiguous"`: device `i` holds tokens
    `[i * local_len, (i + 1) * local_len)`; `"zigzag"`: the two chunks of
    `zigzag_indices`.

    **Arguments:**

    - `local_len`: this device's number of tokens.
    - `axis_name`: the context-parallel mesh axis (or a tuple of axes).
    - `layout`: `"contiguous"` or `"zigzag"`.

    **Returns:**

    int32 `[local_len]`.
    """
    _check_layout("context_positions", layout)
    n = combined_axis_size(axis_name)
    i = jax.lax.axis_index(axis_tuple(axis_name))
    if layout == "contiguous":
        return i * local_len + jnp.arange(local_len, dtype=jnp.int32)
    if local_len % 2:
        raise LayerConfigError(
            f"context_positions: the zigzag layout needs an even local length, got {local_len}."
        )
    c = local_len // 2
    chunk = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + chunk, (2 * n - 1 - i) * c + chunk])


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
    chunk = local_len // 2 if layout == "zigzag" else local_len
    return max(1, min(block_size, chunk))


def ring_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    axis_name: AxisName,
    *,
    causal: bool = True,
    layout: str = "contiguous",
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Float[Array, "*batch seq heads head_dim"]:
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
    - `causal`: mask keys whose position is after the query's.
    - `layout`: how the sequence is split, when positions are not given:
      `"contiguous"` (device `i` holds the `i`-th slice) or `"zigzag"` (the tokens
      were ordered by `zigzag_permute`).
    - `q_positions`, `kv_positions`: this device's global positions (default
      `context_positions(S/cp, axis_name, layout=layout)`).
    - `q_segment_ids`, `kv_segment_ids`: this device's segment ids of packed sequences.
    - `scale`: the score scale, default `1 / sqrt(head_dim)`.
    - `block_size`: the kernel's block size (capped at one zigzag chunk).

    **Returns:**

    This device's attention output, `q`'s shape and dtype.
    """
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
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    axis_name: AxisName,
    *,
    causal: bool = True,
    layout: str = "contiguous",
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
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
    name = "ring_attention_block_pairs"
    c = _context_canonical(name, q, k, v, axis_name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, layout)
    bs = _ring_blocks(c.q.shape[1], block_size, layout)
    return _ring_forward(_padded(c, bs, bs), axis_name, causal, 1.0, bs, bs, q_segment_ids is not None)[2]


def alltoall_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    axis_name: AxisName,
    *,
    causal: bool = True,
    layout: str = "contiguous",
    q_positions: Int[Array, "..."] | None = None,
    kv_positions: Int[Array, "..."] | None = None,
    q_segment_ids: Int[Array, "..."] | None = None,
    kv_segment_ids: Int[Array, "..."] | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    blockwise_threshold: int = BLOCKWISE_THRESHOLD,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Attention over a sequence split across `axis_name` by all-to-alls (Ulysses).

    Valid inside `shard_map`. An all-to-all turns the sequence split into a head split
    (`[S/cp, H]` → `[S, H/cp]`), each device attends over the whole sequence for its
    heads with `attention` (cuDNN, dense or blockwise), and a second all-to-all turns
    it back. Needs `n_heads` divisible by the axis size; key/value heads that do not
    divide are repeated to the least multiple that does. Positions and segment ids are
    all-gathered (small integer arrays). See the "Long sequences" guide.

    **Arguments:**

    As `ring_attention`, and `implementation`, `blockwise_threshold` as `attention`.

    **Returns:**

    This device's attention output, `q`'s shape and dtype.
    """
    name = "alltoall_attention"
    _check_layout(name, layout)
    _check_shapes(name, q, k, v)
    n = combined_axis_size(axis_name)
    axes = axis_tuple(axis_name)
    n_heads, n_kv = q.shape[-2], k.shape[-2]
    if n_heads % n:
        raise LayerConfigError(
            f"{name}: n_heads={n_heads} is not divisible by the size {n} of axis {axis_name!r}; "
            "use ring_attention."
        )
    wide = math.lcm(n_kv, n)
    if wide != n_kv:  # repeat each key/value head so the heads split evenly
        k, v = jnp.repeat(k, wide // n_kv, axis=-2), jnp.repeat(v, wide // n_kv, axis=-2)
    seq_axis, head_axis = q.ndim - 3, q.ndim - 2
    default = all(x is None for x in (q_positions, kv_positions, q_segment_ids, kv_segment_ids))

    def gather(x):  # i32[..., S/cp] -> i32[..., S]
        return None if x is None else jax.lax.all_gather(x, axes, axis=x.ndim - 1, tiled=True)

    if not (default and layout == "contiguous"):
        if q_positions is None:
            q_positions = context_positions(q.shape[-3], axis_name, layout=layout)
        if kv_positions is None:
            kv_positions = context_positions(k.shape[-3], axis_name, layout=layout)
    # f32[..., S/cp, H, D] -> f32[..., S, H/cp, D]
    q, k, v = (jax.lax.all_to_all(x, axes, head_axis, seq_axis, tiled=True) for x in (q, k, v))
    out = attention(
        q, k, v, causal=causal, scale=scale, implementation=implementation, block_size=block_size,
        blockwise_threshold=blockwise_threshold, q_positions=gather(q_positions),
        kv_positions=gather(kv_positions), q_segment_ids=gather(q_segment_ids),
        kv_segment_ids=gather(kv_segment_ids),
    )  # fmt: skip
    # f32[..., S, H/cp, D] -> f32[..., S/cp, H, D]
    return jax.lax.all_to_all(out, axes, seq_axis, head_axis, tiled=True)
