"""Which mesh axes a collective runs over: replica groups mapped back to axis names.

A compiled program names the devices of a collective by their *partition index*: the
position of the device in the mesh's flattened (row-major) device array. A set of
mesh axes `A` defines a partition of those indices — devices that agree on every axis
outside `A` form one group — so a collective's replica groups name `A` exactly when
they are that partition. The groups are those the HLO reader parsed
(`CollectiveOp.replica_groups`, every printed form); a collective-permute runs over the
axes along which its source and target devices differ.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ._hlo import CollectiveOp

__all__ = ["axes_of_groups", "axes_of_pairs", "collective_axes"]


def _coordinates(mesh_shape: Mapping[str, int]) -> np.ndarray:
    """`int[num_devices, num_axes]`: each partition index's coordinate on each axis."""
    sizes = tuple(mesh_shape.values())
    return np.stack(np.unravel_index(np.arange(math.prod(sizes)), sizes), axis=1)


def axes_of_groups(groups: Sequence[Sequence[int]], mesh_shape: Mapping[str, int]) -> tuple[str, ...] | None:
    """The mesh axes whose partition of the devices is `groups`.

    **Arguments:**

    - `groups`: replica groups as lists of partition indices.
    - `mesh_shape`: the mesh's `{axis: size}` in mesh order.

    **Returns:**

    The axis names in mesh order (`()` for groups of one device), or `None` when no set
    of axes gives these groups (e.g. a collective over a sub-axis).
    """
    names = tuple(mesh_shape)
    coords = _coordinates(mesh_shape)
    wanted = {frozenset(g) for g in groups if len(g)}
    covered = set().union(*wanted) if wanted else set()
    for r in range(len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            others = [i for i in range(len(names)) if i not in subset]
            keys = [tuple(row) for row in coords[:, others]]
            found: dict[tuple[int, ...], set[int]] = {}
            for device, key in enumerate(keys):
                found.setdefault(key, set()).add(device)
            partition = {frozenset(g) for g in found.values()}
            # Groups may list only some devices (the others idle): match those listed.
            if {g for g in partition if g & covered} == wanted:
                return tuple(names[i] for i in subset)
    return None


def axes_of_pairs(pairs: Sequence[tuple[int, int]], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which a collective-permute's source and target devices differ.

    **Arguments:**

    - `pairs`: `(source, target)` partition indices.
    - `mesh_shape`: the mesh's `{axis: size}` in mesh order.

    **Returns:**

    The axis names in mesh order (`()` if every device sends to itself).
    """
    coords = _coordinates(mesh_shape)
    moved = np.zeros(len(mesh_shape), bool)
    for source, target in pairs:
        moved |= coords[source] != coords[target]
    return tuple(name for name, m in zip(mesh_shape, moved) if m)


def collective_axes(op: CollectiveOp, mesh_shape: Mapping[str, int]) -> tuple[str, ...] | None:
    """The mesh axes one collective runs over (`None` if they cannot be named).

    **Arguments:**

    - `op`: a collective from `read_collectives`.
    - `mesh_shape`: the mesh's `{axis: size}` in mesh order.

    **Returns:**

    Axis names in mesh order, or `None`.
    """
    num_devices = math.prod(mesh_shape.values())
    if op.kind == "collective-permute":
        pairs = op.source_target_pairs
        if pairs is None or any(max(p) >= num_devices for p in pairs):
            return None
        return axes_of_pairs(pairs, mesh_shape)
    groups = op.replica_groups
    if groups is None or any(max(g, default=0) >= num_devices for g in groups):
        return None
    return axes_of_groups(groups, mesh_shape)
