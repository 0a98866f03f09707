"""Placing trees on a mesh by their specs (`shard`) and bringing them back (`gather`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._errors import SpecError
from ._box import is_sharded
from ._specs import check_spec, check_tree_specs, is_array_like, is_spec, spec_of_leaf, specs_of


def is_tracer(x: Any) -> bool:
    return isinstance(x, Tracer)


def _all_explicit(mesh: Mesh | AbstractMesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def place(x: Any, mesh: Mesh | AbstractMesh, spec: P) -> Any:
    """Place one array on `mesh` with `spec`, outside or inside `jit`.

    Outside `jit` this is `jax.device_put` (a no-op for an array already placed so);
    inside, `jax.sharding.reshard` on a mesh of Explicit axes and
    `with_sharding_constraint` on one with Auto axes.
    """
    sharding = NamedSharding(mesh, spec)
    if not is_tracer(x):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)
    if _all_explicit(mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _map_with_specs(fn, tree: PyTree, specs: PyTree) -> PyTree:
    """Apply `fn(array, spec)` to every array of `tree`, keeping boxes and non-arrays."""

    def on_subtree(spec: P | None, sub: Any) -> Any:
        if spec is None:
            return sub

        def on_leaf(leaf: Any) -> Any:
            if is_sharded(leaf):
                return leaf.with_value(on_leaf(leaf.value))
            return fn(leaf, spec) if is_array_like(leaf) else leaf

        return jax.tree.map(on_leaf, sub, is_leaf=is_sharded)

    return jax.tree.map(on_subtree, specs, tree, is_leaf=lambda s: s is None or is_spec(s))


def shard(tree: PyTree, mesh: Mesh, specs: PyTree | None = None) -> PyTree:
    """Place every array of `tree` on `mesh` according to its spec.

    Outside `jit` arrays are transferred (`device_put`); inside, the layout is imposed
    (`reshard` / sharding constraint). Non-array leaves are left as they are.

    **Arguments:**

    - `tree`: any pytree: a model, an optimizer state, a batch.
    - `mesh`: the mesh to place it on.
    - `specs`: a spec tree that is a prefix of `tree`; defaults to `specs_of(tree)`.

    **Returns:**

    The same pytree with its arrays placed.

    **Raises:**

    `SpecError`, naming the parameter's path, shape, spec and mesh, if a spec does not
    fit.
    """
    if specs is None:
        return _shard_by_own_specs(tree, mesh)
    check_tree_specs(tree, specs, mesh)
    return _map_with_specs(lambda x, spec: place(x, mesh, spec), tree, specs)


def _shard_by_own_specs(tree: PyTree, mesh: Mesh) -> PyTree:
    """`shard(tree, mesh)`: every array by its own spec (`specs_of`), in one pass over
    `tree` (a train step places its whole state so, at every trace)."""
    nodes, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
    placed = []
    for node in nodes:
        spec = spec_of_leaf(node)
        if spec is None:
            placed.append(node)
            continue
        value = node.value if is_sharded(node) else node
        try:
            check_spec("", tuple(value.shape), spec, mesh)
        except SpecError:
            check_tree_specs(tree, specs_of(tree), mesh)  # raises, naming the path
            raise
        value = place(value, mesh, spec)
        placed.append(node.with_value(value) if is_sharded(node) else value)
    return jax.tree.unflatten(treedef, placed)


def gather(tree: PyTree, *, mesh: Mesh | None = None, device: Any = None) -> PyTree:
    """Bring every array of `tree` back whole (the PyTorch library's `master_weight`).

    Outside `jit` the arrays are copied onto one device (never aliased, so donating the
    sharded originals later leaves them intact): give `unbox(gather(model))` to code
    that knows nothing of equishard. Inside `jit` they are made replicated on
    the mesh read off the arrays' types, or on `mesh` if given.

    **Arguments:**

    - `tree`: any pytree.
    - `mesh`: inside `jit`, the mesh to replicate the arrays on (default: the one in
      each array's type).
    - `device`: outside `jit`, the `jax.Device` to put the arrays on (default: the
      first local device).

    **Returns:**

    The same pytree (boxes kept) with full global arrays.
    """
    if device is None:
        device = jax.local_devices()[0]

    def whole(x: Any) -> Any:
        if is_tracer(x):
            target = mesh if mesh is not None else jax.typeof(x).sharding.mesh
            # A traced array with no mesh in its type is not sharded: already whole.
            return x if target.empty else place(x, target, P())
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        # A copy: a later step that donates the sharded state must not free it
        # (`device_put` of a replicated array may hand back the device's own shard).
        return jnp.copy(jax.device_put(x, device))

    return jax.tree.map(lambda x: whole(x) if eqx.is_array(x) else x, tree)
