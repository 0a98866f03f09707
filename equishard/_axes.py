"""Mesh-axis bookkeeping shared by every floor: the one home of these primitives.

- `AxisName`, `axis_tuple`, `entry_axes`: naming one mesh axis or a combined one.
- `bound_axis_size`, `is_bound`, `axis_size`: whether an axis is bound here (inside a
  `shard_map` over it) and its size.
- `varying_axes`, `mesh_ordered`, `cast_varying`: the varying-manual-axes types of
  `shard_map` (read, and cast to varying in the mesh's axis order).
- `vmap_names`: the `vmap`s that batch a value, innermost first, by their axis names.
- `spec_divisors`, `local_shape`, `global_shape`, `bound_sizes`: the shapes of a
  `PartitionSpec`'s blocks.

Private: the public floors re-export what users need (`equishard.core`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import jax
from jax._src.interpreters.batching import BatchTracer
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from ._errors import SpecError

AxisName: TypeAlias = str | tuple[str, ...]
"""One mesh axis name, or a tuple of them naming one combined axis.

A tuple's devices are ordered as the tuple names them (the *logical* order of
`P(("tp", "dp"))`), which need not be the mesh's order.
"""


# ---------------------------------------------------------------------------
# Naming axes


def axis_tuple(axis_name: AxisName) -> tuple[str, ...]:
    """`axis_name` as a tuple of mesh axis names, in the order given (logical order).

    **Raises:**

    `SpecError` for an empty tuple, an axis named twice, or anything but strings.
    """
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, (tuple, list)) and all(isinstance(a, str) for a in axis_name):
        axes = tuple(axis_name)
        if len(set(axes)) != len(axes):
            raise SpecError(f"axis_name {axis_name!r} names an axis twice")
        if not axes:
            raise SpecError("axis_name is an empty tuple; name at least one mesh axis")
        return axes
    raise SpecError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one `PartitionSpec` entry names: `()` for `None`, else a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


# ---------------------------------------------------------------------------
# Bound axes


def axis_sizes(axis_name: AxisName) -> tuple[int, ...]:
    """The size of each axis in `axis_name`, in the order given (all must be bound)."""
    return tuple(int(jax.lax.axis_size(a)) for a in axis_tuple(axis_name))


def combined_axis_size(axis_name: AxisName) -> int:
    """The number of devices along `axis_name`, the product of its axes' sizes (all bound)."""
    return math.prod(axis_sizes(axis_name))


def bound_axis_size(axis_name: AxisName) -> int | None:
    """The number of devices along `axis_name` if all its axes are bound here, else `None`.

    An axis is bound inside a `shard_map` (or `vmap`) over it; a tuple's size is the
    product of its axes' sizes.
    """
    try:
        return combined_axis_size(axis_name)
    except NameError:
        return None


def is_bound(axis_name: AxisName) -> bool:
    """Whether every axis of `axis_name` is bound here (inside a `shard_map` over it)."""
    return bound_axis_size(axis_name) is not None


def axis_size(axis_name: AxisName) -> int:
    """The size of `axis_name` where it is bound, or 1 where it is not.

    A layer called outside any `shard_map` (or inside one that does not map
    `axis_name`) holds its global weights and computes the unsharded function.
    """
    size = bound_axis_size(axis_name)
    return 1 if size is None else size


# ---------------------------------------------------------------------------
# Varying manual axes


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes along which `x` is typed as varying (empty when unchecked).

    `x` is an array, a tracer or a `jax.ShapeDtypeStruct` (what `jax.eval_shape`
    returns). JAX records the axes as `aval.vma` in some versions and
    `aval.manual_axis_type.varying` in others; both are read.
    """
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def invariant_along(x: Any, axes: Iterable[str]) -> str | tuple[str, ...] | None:
    """Those of `axes` along which `x` is typed invariant (one name, or a tuple of
    several), or `None` if it varies along all of them: the check both local-loss
    functions (a mean-gradient gather, `sync_gradients`) make before averaging a
    gradient over `axes` (an invariant one has no per-device gradient to average)."""
    invariant = tuple(a for a in axes if a not in varying_axes(x))
    if not invariant:
        return None
    return invariant[0] if len(invariant) == 1 else invariant


def mesh_ordered(axes: Iterable[str]) -> tuple[str, ...]:
    """`axes` sorted into the order the current mesh declares them.

    Axes unknown to the current abstract mesh (e.g. a `vmap` axis name) keep the order
    given; a set is then sorted by name so the order is deterministic.
    """
    given = tuple(axes) if not isinstance(axes, (set, frozenset)) else tuple(sorted(axes))
    names = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()) or ())
    if all(a in names for a in given):
        return tuple(sorted(given, key=names.index))
    return given


def cast_varying(x: PyTree, axes: AxisName | Iterable[str]) -> PyTree:
    """`pcast` each array of `x` to varying over the axes of `axes` it is not yet varying on.

    The missing axes are cast in the mesh's order (`mesh_ordered`), whoever calls.
    """
    wanted = mesh_ordered((axes,) if isinstance(axes, str) else axes)

    def cast(leaf: Any) -> Any:
        if not hasattr(leaf, "dtype"):
            return leaf
        have = varying_axes(leaf)
        missing = tuple(a for a in wanted if a not in have)
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)


def vmap_names(x: Any) -> tuple[Any, ...]:
    """The `axis_name`s of the `vmap`s that batch `x`, innermost first (`None`: unnamed).

    Read from `x`'s batching tracers (a JAX internal: a collective over a `vmap` axis
    cannot be bound inside a `shard_map` with the varying-axes check, so what needs one
    reads the names here and reduces the batched array itself). Empty for an unbatched `x`.
    """
    names: list[Any] = []
    while isinstance(x, BatchTracer):
        names.append(x._trace.axis_data.name)
        x = x.val
    return tuple(names)


def vma_checked(axis_name: AxisName) -> bool:
    """Whether `shard_map`'s varying-manual-axes check is on for `axis_name`.

    With the check on, `axis_index` is typed as varying along the axis; with
    `check_vma=False` nothing carries a type.
    """
    # One probe per axis (each checked, as the tuple's would be): `axis_index` of one
    # axis is one dead equation in the trace, of a tuple the linear index, five.
    return any([a in varying_axes(jax.lax.axis_index(a)) for a in axis_tuple(axis_name)])


# ---------------------------------------------------------------------------
# Shapes of a spec's blocks


def spec_divisors(spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per entry of `spec`, the number of blocks its dimension is split into.

    `sizes` maps each mesh axis the spec names to its size (a mesh's `shape`, or
    `bound_sizes(spec)` inside `shard_map`).
    """
    return tuple(math.prod(sizes[a] for a in entry_axes(e)) for e in spec)


def local_shape(shape: tuple[int, ...], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's block of an array of global `shape` split by `spec`."""
    div = spec_divisors(spec, sizes)
    return tuple(d // div[i] if i < len(div) else d for i, d in enumerate(shape))


def global_shape(shape: tuple[int, ...], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The global shape of an array whose blocks of `shape` are split by `spec`."""
    div = spec_divisors(spec, sizes)
    return tuple(d * div[i] if i < len(div) else d for i, d in enumerate(shape))


def bound_sizes(spec: P) -> dict[str, int] | None:
    """The sizes of the axes `spec` names where all are bound here, else `None`."""
    sizes: dict[str, int] = {}
    for entry in spec:
        for a in entry_axes(entry):
            size = bound_axis_size(a)
            if size is None:
                return None
            sizes[a] = size
    return sizes
