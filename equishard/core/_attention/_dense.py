"""`dense_attention`: the plain softmax attention, the `[Sq, Sk]` scores in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._common import CAUSAL, AttentionMask, _Canon, _canonical, _from_canonical, _mask, _scale


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

def dense_attention(
    q: Float[Array, "*batch q_seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    *,
    mask: AttentionMask = CAUSAL,
    scale: float | None = None,
) -> tuple[Float[Array, "*batch q_seq heads head_dim"], Float[Array, "*batch q_seq heads"]]:
    """Softmax attention with the whole `[Sq, Sk]` score matrix in memory.

    Fastest for short sequences; its memory grows with `Sq · Sk`. Grouped-query heads,
    masks and positions as described in the "Long sequences" guide.

    **Arguments:**

    - `q`: `[..., Sq, n_heads, head_dim]`.
    - `k`, `v`: `[..., Sk, n_kv_heads, head_dim]`, `n_kv_heads` dividing `n_heads`.
    - `mask`: which keys each query sees (`AttentionMask`: causal or not, positions,
      segment ids of packed sequences); default causal.
    - `scale`: the score scale, default `1 / sqrt(head_dim)`.

    **Returns:**

    `(out, lse)`: the attention output (`q`'s shape and dtype) and the float32
    log-sum-exp of each query row's scores (`-inf` for a row that sees no key, whose
    output is zero).
    """
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
    c = _canonical("dense_attention", q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out, stats = _dense(c, causal, _scale(scale, q.shape[-1]))
    return _from_canonical(out, _dense_lse(*stats), q)
