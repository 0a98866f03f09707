"""Randomness that belongs to the example, not to the device.

A per-example random draw (dropout, noise, sampling) that splits the step's key by the
*local* batch gives each device the same few keys, and a different set of masks on every
layout. These functions derive keys from *global* positions instead — the example's
index in the global batch, a feature's index in the global activation — so every draw
is the one the one-device program makes, whatever the mesh, the process count or the
number of micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Key, PRNGKeyArray

from ._collectives import AxisName, axis_tuple, combined_axis_size


def global_index(size: int, axis_name: AxisName | None = None) -> Int[Array, " size"]:
    """The global indices of this device's `size` positions of a split dimension.

    Inside `shard_map`, a dimension split over `axis_name` (one mesh axis or a tuple,
    blocks in the order the tuple names them, as in `P(("dp", "fsdp"))`) holds positions
    `i * size, ..., (i + 1) * size - 1` on the device with combined index `i`. With
    `axis_name=None` (or outside `shard_map`) the dimension is whole: `0, ..., size - 1`.

    **Arguments:**

    - `size`: the local length of the dimension.
    - `axis_name`: the mesh axis or axes it is split over, or `None`.

    **Returns:**

    `int32[size]`, the global positions.
    """
    local = jnp.arange(size, dtype=jnp.int32)
    if axis_name is None:
        return local
    return jax.lax.axis_index(axis_tuple(axis_name)).astype(jnp.int32) * size + local


def example_keys(key: PRNGKeyArray, index: Int[Array, " batch"]) -> Key[Array, " batch"]:
    """One key per example, from its global index: `fold_in(key, index[b])`.

    The same example gets the same key on one device and on any mesh, in any
    micro-batch: `make_train_step` hands a loss function that takes `index` the global
    indices of its local examples (see the "Your own model" guide, section Dropout).

    **Arguments:**

    - `key`: the step's key (the same on every device).
    - `index`: `int32[batch]`, the global indices of the local examples.

    **Returns:**

    A key array of shape `[batch]`, e.g. for `jax.vmap(model)(x, key=keys)`.
    """
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


def bernoulli_block(
    key: PRNGKeyArray,
    p: float | Array,
    shape: tuple[int, ...],
    *,
    axis_name: AxisName | None = None,
    dim: int = -1,
) -> Bool[Array, "..."]:
    """This device's block of the mask `jax.random.bernoulli(key, p, global_shape)`.

    For dropout on an activation split over `axis_name` along `dim` (the hidden
    features of a column-parallel layer): every feature draws by its global index, so
    the mask equals the one-device mask of the whole activation. The global mask is
    drawn on every device and sliced (random bits cost the whole activation, not its
    block).

    **Arguments:**

    - `key`: the key the one-device program would use for this activation.
    - `p`: the probability of `True`.
    - `shape`: the local shape.
    - `axis_name`: the mesh axis or axes `dim` is split over (`None`: not split).
    - `dim`: the split dimension.

    **Returns:**

    `bool[*shape]`.
    """
    if axis_name is None:
        return jax.random.bernoulli(key, p, shape)
    dim = dim % len(shape)
    n = combined_axis_size(axis_name)
    full = list(shape)
    full[dim] *= n
    mask = jax.random.bernoulli(key, p, tuple(full))
    start = jax.lax.axis_index(axis_tuple(axis_name)) * shape[dim]
    return jax.lax.dynamic_slice_in_dim(mask, start, shape[dim], axis=dim)
