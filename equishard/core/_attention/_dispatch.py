"""`attention`, the dispatcher: cuDNN on a GPU where its rules allow (`cudnn_supported`);
otherwise dense below `BLOCKWISE_THRESHOLD` keys and blockwise at or above it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..._errors import LayerConfigError
from ._blockwise import blockwise_attention
from ._common import (
    _IMPLEMENTATIONS,
    BLOCKWISE_THRESHOLD,
    CAUSAL,
    DEFAULT_BLOCK_SIZE,
    AttentionMask,
    _canonical,
    _check_shapes,
    _out_from_canonical,
    _scale,
)
from ._dense import _dense


def cudnn_supported(q: Array, k: Array, *, causal: bool, positions: bool) -> bool:
    """Whether `jax.nn.dot_product_attention(implementation="cudnn")` serves this call.

    Its rules: a GPU backend, float16/bfloat16 inputs, a head size that is a multiple of
    8 and at most 128, default positions and no segment ids (`positions=False`), and equal
    query and key lengths when causal.

    **Arguments:**

    - `q`, `k`: the query and key arrays.
    - `mask`: which keys each query sees (see `dense_attention`).
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
    mask: AttentionMask = CAUSAL,
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
    causal, q_positions, kv_positions, q_segment_ids, kv_segment_ids = mask.fields()
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
    return blockwise_attention(q, k, v, mask=mask, scale=scale, q_block_size=block_size, kv_block_size=block_size)[0]
