"""`alltoall_attention`: context-parallel attention by all-to-alls (Ulysses): the sequence split
turned into a head split and back, `attention` in between.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..._errors import LayerConfigError
from ..._names import CONTIGUOUS
from .._collectives import (
    AxisName,
    axis_tuple,
    combined_axis_size,
)
from ._common import (
    BLOCKWISE_THRESHOLD,
    CAUSAL,
    DEFAULT_BLOCK_SIZE,
    AttentionMask,
    KeysValues,
    Queries,
    _check_shapes,
)
from ._dispatch import attention
from ._zigzag import _check_layout, context_positions


def alltoall_attention(
    q: Queries, k: KeysValues, v: KeysValues, axis_name: AxisName, *,
    mask: AttentionMask = CAUSAL,
    layout: str = "contiguous",
    scale: float | None = None,
    implementation: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    blockwise_threshold: int = BLOCKWISE_THRESHOLD,
) -> Queries:
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
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
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

    if not (default and layout == CONTIGUOUS):
        if q_positions is None:
            q_positions = context_positions(q.shape[-3], axis_name, layout=layout)
        if kv_positions is None:
            kv_positions = context_positions(k.shape[-3], axis_name, layout=layout)
    # f32[..., S/cp, H, D] -> f32[..., S, H/cp, D]
    q, k, v = (jax.lax.all_to_all(x, axes, head_axis, seq_axis, tiled=True) for x in (q, k, v))
    whole = AttentionMask(causal, *(gather(x) for x in (q_positions, kv_positions, q_segment_ids, kv_segment_ids)))
    out = attention(
        q, k, v, mask=whole, scale=scale, implementation=implementation, block_size=block_size,
        blockwise_threshold=blockwise_threshold,
    )  # fmt: skip
    # f32[..., S, H/cp, D] -> f32[..., S/cp, H, D]
    return jax.lax.all_to_all(out, axes, seq_axis, head_axis, tiled=True)
