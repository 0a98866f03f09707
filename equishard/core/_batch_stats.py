"""Means over the examples of a batch, for statistics a layer takes over its batch.

A layer called one example at a time (under the user's `jax.vmap(..., axis_name=...)`)
reduces over the batch with a collective over the `vmap`'s axis name (`lax.pmean`).
Inside a `shard_map` with the varying-axes check that collective cannot be bound (JAX
refuses a collective over an axis that is not a mesh axis); `example_mean` reduces the
batched array itself instead, one `vmap` level at a time, and then over the mesh's data
axes, so that the statistics span the global batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._axes import is_bound, vmap_names
from .._errors import LayerConfigError


def _names(axis_name: Hashable | Sequence[Hashable]) -> tuple[Hashable, ...]:
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def _reduce(x: Array, levels: tuple[bool, ...], data_axes: tuple[str, ...]) -> Array:
    """`x` averaged over the `vmap` levels flagged in `levels` (innermost first), then
    over `data_axes`."""
    if not levels:
        return jax.lax.pmean(x, data_axes) if data_axes else x
    reduce_here, outer = levels[0], levels[1:]

    @jax.custom_batching.custom_vmap
    def reduced(x: Array) -> Array:  # not batched at this level
        return _reduce(x, outer, data_axes)

    @reduced.def_vmap
    def over_level(axis_size: int, in_batched: Any, x: Array) -> Any:
        del axis_size
        (batched,) = in_batched
        if not batched:  # the same value for every example of this level
            return _reduce(x, outer, data_axes), False
        if reduce_here:  # x: [n, ...], this level's examples first
            return _reduce(jnp.mean(x, axis=0), outer, data_axes), False
        return jax.vmap(lambda one: _reduce(one, outer, data_axes))(x), True

    return reduced(x)


def example_mean(
    x: Array, axis_name: Hashable | Sequence[Hashable], data_axes: tuple[str, ...] = ()
) -> Array:
    """The mean of `x` over the examples of the `vmap`s named `axis_name` and over the
    mesh axes `data_axes`: `lax.pmean(x, (*axis_name, *data_axes))`, valid inside a
    `shard_map` with the varying-axes check.

    Called on one example (inside the `vmap`s), as a layer computes batch statistics.
    Every device's block of the batch has the same size, so the mean over the data axes
    of the local means is the mean over the global batch.

    **Arguments:**

    - `x`: one example's value (e.g. `f32[C]`, a per-channel mean).
    - `axis_name`: the `vmap` axis name, or a sequence of them, to average over.
    - `data_axes`: mesh axes the batch is split over (inside `shard_map`); `()`: none.

    **Returns:**

    The mean, the same for every example of those `vmap`s (unbatched along them).

    **Raises:**

    `LayerConfigError` if a name of `axis_name` is no `vmap` around the call.
    """
    names = _names(axis_name)
    levels = vmap_names(x)
    # A name bound here that batches nothing of `x` (a function traced once unbatched,
    # as `custom_vmap` traces its own) has nothing to average over.
    missing = [n for n in names if n not in levels and not (isinstance(n, str) and is_bound(n))]
    if missing:
        raise LayerConfigError(
            f"batch statistics over the axis {missing[0]!r}: no `jax.vmap(..., "
            f"axis_name={missing[0]!r})` is around this call (the vmaps batching it are "
            f"named {list(levels)}). vmap the model over the batch with that axis_name, as "
            f"on one device."
        )
    return _reduce(x, tuple(n in names for n in levels), data_axes)
