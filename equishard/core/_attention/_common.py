"""What every attention kernel shares: the canonical layout (`[B, S, Hkv, G, D]` queries,
`[B, S, Hkv, D]` keys and values, `[B, S]` positions and segment ids), the mask, the
scale, and the way back to the caller's shapes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..._axes import cast_varying
from ..._errors import LayerConfigError
from .._collectives import (
    mesh_ordered,
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

Queries = Float[Array, "*batch seq heads head_dim"]
"""Queries (and an attention's output): `[..., T, H, hd]`."""
KeysValues = Float[Array, "*batch seq kv_heads head_dim"]
"""Keys or values: `[..., T, Hkv, hd]`, `Hkv` dividing `H` (grouped-query attention)."""


class AttentionMask(eqx.Module):
    """Which keys each query sees: what every attention kernel takes beside `q`, `k`, `v`.

    **Fields:**

    - `causal`: mask keys whose position is after the query's (default `True`).
    - `q_positions`, `kv_positions`: integer positions, `[Sq]` / `[Sk]` or with the
      leading dimensions of `q`; default `0, 1, 2, ...` (the context-parallel kernels:
      this device's global positions, by their `layout`). The causal mask is
      `kv_position <= q_position`, so permuted or packed sequences mask correctly.
    - `q_segment_ids`, `kv_segment_ids`: integer segment ids of packed sequences (a
      query sees only keys of its own segment); both or neither.
    """

    causal: bool = eqx.field(static=True, default=True)
    q_positions: Int[Array, "..."] | None = None
    kv_positions: Int[Array, "..."] | None = None
    q_segment_ids: Int[Array, "..."] | None = None
    kv_segment_ids: Int[Array, "..."] | None = None

    def fields(self) -> tuple[bool, Array | None, Array | None, Array | None, Array | None]:
        """`(causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids)`."""
        return self.causal, self.q_positions, self.kv_positions, self.q_segment_ids, self.kv_segment_ids


CAUSAL = AttentionMask()
"""The default mask: causal, positions `0, 1, 2, ...`, one segment."""


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
