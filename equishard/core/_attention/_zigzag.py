"""Context parallelism's sequence layouts: `contiguous` and `zigzag` (`zigzag_indices`,
`zigzag_permute`, `zigzag_unpermute`), and the positions of this device's tokens
(`context_positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ..._errors import LayerConfigError
from ..._names import CONTIGUOUS, SEQUENCE_ORDERS
from .._collectives import (
    AxisName,
    axis_tuple,
    combined_axis_size,
)


def _check_layout(name: str, layout: str) -> None:
    if layout not in SEQUENCE_ORDERS:
        raise LayerConfigError(f"{name}: layout={layout!r}; expected one of {SEQUENCE_ORDERS}.")


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
    if layout == CONTIGUOUS:
        return i * local_len + jnp.arange(local_len, dtype=jnp.int32)
    if local_len % 2:
        raise LayerConfigError(
            f"context_positions: the zigzag layout needs an even local length, got {local_len}."
        )
    c = local_len // 2
    chunk = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + chunk, (2 * n - 1 - i) * c + chunk])
