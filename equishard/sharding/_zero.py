"""Optimizer-state sharding (ZeRO-1): the optimizer state's specs split over the data axes.

The parameters stay as their specs say (replicated over the data axes, as plain data
parallelism); the optimizer state's arrays are split over the ZeRO axes on a dimension
their spec leaves free, by the FSDP rule (`fsdp_dimension`, and arrays below
`min_weight_size` elements stay replicated). The rule reads a box's spec and global
shape only, never its value, so the parameters, their gradients and every state tree
optax builds from them get the same boxes (optax maps over them together). A box optax
rebuilt around an array of another shape (adafactor's factored moments, its `(1,)`
placeholders) keeps the new spec but does not fit it (`box_fits`): `specs_of` reads it
as replicated, and it is placed so.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._errors import LayerConfigError
from ._box import is_sharded, with_spec
from ._fsdp import DEFAULT_MIN_WEIGHT_SIZE, AutoSharded, fsdp_dimension
from ._specs import describe_mesh, is_array_like, spec_axes

ZeroAxes = str | tuple[str, ...]


def zero_axes(zero: ZeroAxes | None, mesh: Mesh | AbstractMesh, fn_name: str) -> tuple[str, ...]:
    """`zero` as a tuple of mesh axes (`()` for `None`), checked against `mesh`."""
    if zero is None:
        return ()
    axes = (zero,) if isinstance(zero, str) else tuple(zero)
    missing = [a for a in axes if a not in mesh.shape]
    if not axes or missing or not all(isinstance(a, str) for a in axes):
        raise LayerConfigError(
            f"{fn_name}(zero={zero!r}): zero names the mesh axes the optimizer state is "
            f"split over, e.g. 'dp'; {describe_mesh(mesh)} has the axes {tuple(mesh.shape)}."
        )
    return axes


def zero_spec(
    spec: P, shape: tuple[int, ...], axes: tuple[str, ...], size: int, min_weight_size: int
) -> P:
    """The spec of an optimizer-state array of global `shape` whose parameter has `spec`.

    `axes` (of combined `size`) go on the dimension `fsdp_dimension` picks (the largest
    one `spec` leaves free and `size` divides); `spec` is returned unchanged if it
    already uses one of `axes`, if the array has fewer than `min_weight_size` elements,
    or if no dimension qualifies.
    """
    if not axes or size == 1 or set(axes) & set(spec_axes(spec)):
        return spec
    if math.prod(shape) < min_weight_size:
        return spec
    padded = P(*spec, *((None,) * (len(shape) - len(spec))))
    dim = fsdp_dimension(shape, padded, size)
    if dim is None:
        return spec
    entry = axes[0] if len(axes) == 1 else axes
    return P(*(entry if d == dim else e for d, e in enumerate(padded)))


def zero_split(
    tree: PyTree,
    zero: ZeroAxes | None,
    *,
    mesh: Mesh | AbstractMesh,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
) -> PyTree:
    """Split the specs of `tree`'s arrays over the ZeRO axes `zero` (optimizer-state sharding).

    Each box gets `zero_spec` of its spec and global shape (a plain array is boxed in
    `AutoSharded` if it gets split); arrays already split over a ZeRO axis, smaller than
    `min_weight_size` elements or divisible on no free dimension keep their specs.
    Outside `jit` and `shard_map` only specs change: place the result with `shard`.
    Idempotent. `init_train_state(..., opt_sharding=ZeRO1(...))` applies it to the
    optimizer state and `make_train_step(..., opt_sharding=ZeRO1(...))` to the parameters and gradients in the update (see
    the training guide).

    **Arguments:**

    - `tree`: any pytree (an optimizer state, a model, gradients).
    - `zero`: the mesh axis (or axes) to split over, e.g. `"dp"`; `None` returns `tree`.
    - `mesh`: the mesh (for the axes' sizes).
    - `min_weight_size`: arrays with fewer elements (global) stay as they are.

    **Returns:**

    `tree` with the split arrays' boxes carrying the new specs.

    **Raises:**

    `LayerConfigError` if an axis of `zero` is not on `mesh`.
    """
    axes = zero_axes(zero, mesh, "zero_split")
    if not axes:
        return tree
    size = math.prod(int(mesh.shape[a]) for a in axes)

    def split(leaf: Any) -> Any:
        if is_sharded(leaf):
            new = zero_spec(leaf.spec, leaf.global_shape, axes, size, min_weight_size)
            return leaf if new == leaf.spec else with_spec(leaf, new)
        if not is_array_like(leaf):
            return leaf
        shape = tuple(leaf.shape)
        new = zero_spec(P(), shape, axes, size, min_weight_size)
        # Boxed replicated (its value fits in either view), then given the new spec.
        return leaf if new == P() else with_spec(AutoSharded(leaf, P(), shape), new)

    return jax.tree.map(split, tree, is_leaf=is_sharded)
