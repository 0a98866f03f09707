"""Reading specs off pytrees, naming parameters by path, and validating specs.

Every error names the parameter's path (`blocks[3].mlp.w1`), its shape, the spec and
the mesh, and is raised before anything reaches XLA.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import bound_sizes, entry_axes, local_shape, spec_divisors
from .._errors import SpecError
from ._box import is_sharded


def is_array_like(x: Any) -> bool:
    """Whether `x` is an array, a tracer or a `jax.ShapeDtypeStruct` (a shape-only array)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_spec(x: Any) -> bool:
    """Whether `x` is a `PartitionSpec` (use as `is_leaf=` when mapping over spec trees)."""
    return isinstance(x, P)


def path_str(path: Sequence[Any]) -> str:
    """Format a `jax.tree_util` key path the way a user writes it: `blocks[3].mlp.w1`."""
    out = ""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            out += f".{key.name}"
        elif isinstance(key, jax.tree_util.SequenceKey):
            out += f"[{key.idx}]"
        elif isinstance(key, jax.tree_util.DictKey):
            out += f"[{key.key!r}]"
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            out += f"[{key.key}]"
        else:
            out += f"[{key}]"
    out = out.removeprefix(".")
    return out or "<root>"


def spec_axes(spec: P) -> list[str]:
    """The mesh axis names a spec uses, in order (a tuple entry contributes each name)."""
    return [a for entry in spec for a in entry_axes(entry)]


def describe_mesh(mesh: Mesh | jax.sharding.AbstractMesh | None) -> str:
    """A short description of a mesh for error messages: `Mesh('dp': 4, 'tp': 2)`."""
    if mesh is None:
        return "<no mesh>"
    axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
    return f"Mesh({axes})"


def box_fits(box: Any) -> bool:
    """Whether a box's value still has the shape its spec was made for.

    Outside `shard_map` that is the box's global `shape`; inside, this device's block of
    it. A box rebuilt by `jax.tree.map` around an array of another shape (an optimizer
    state that does not mirror its parameter) does not fit.
    """
    shape = tuple(box.value.shape)
    if shape == box.global_shape:
        return True
    sizes = bound_sizes(box.spec)  # None outside shard_map, where the axes are unbound
    return sizes is not None and shape == local_shape(box.global_shape, box.spec, sizes)


def spec_of_leaf(x: Any) -> P | None:
    """The spec of one leaf of a tree walked with `is_leaf=is_sharded`.

    A box gives its spec if its value fits it (`box_fits`) and `P()` (replicated)
    otherwise — an optimizer state that does not mirror its parameter, e.g. adafactor's
    factored moments. A plain array is replicated. A non-array gives `None` (it is left
    out, as `eqx.filter_jit` leaves it out).
    """
    if is_sharded(x):
        if not is_array_like(x.value):
            return None
        return x.spec if box_fits(x) else P()
    if is_array_like(x):
        return P()
    return None


def specs_of(tree: PyTree) -> PyTree:
    """The `PartitionSpec` tree of a pytree of modules, arrays and optax states.

    **Arguments:**

    - `tree`: any pytree. Arrays in `Sharded` boxes give their spec; optax states built
      from boxed parameters contain the same boxes, so they inherit their parameters'
      specs by structure; a state array whose shape does not fit its box's spec
      (factored second moments) falls back to replicated.

    **Returns:**

    A pytree with a `PartitionSpec` at the position of every box and every plain array
    (`P()`: replicated) and `None` at every non-array leaf. It is a tree prefix of
    `tree`, so it can be given to `shard_map` as `in_specs`, or mapped over together
    with `tree` using `is_leaf=equishard.is_sharded`.
    """
    return jax.tree.map(spec_of_leaf, tree, is_leaf=is_sharded)


def leaves_with_specs(
    tree: PyTree, specs: PyTree | None = None
) -> Iterator[tuple[str, Any, P]]:
    """Yield `(path, array, spec)` for every array of `tree`.

    **Arguments:**

    - `tree`: any pytree; boxes are looked through.
    - `specs`: a spec tree that is a prefix of `tree` (one `PartitionSpec` may stand
      for a whole subtree); defaults to `specs_of(tree)`.
    """
    if specs is None:
        specs = specs_of(tree)
    is_node_spec = lambda s: s is None or is_spec(s)  # noqa: E731
    spec_items, spec_def = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_node_spec)
    sub_trees = spec_def.flatten_up_to(tree)
    for (spec_path, spec), sub in zip(spec_items, sub_trees, strict=True):
        if spec is None:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(sub, is_leaf=is_sharded)[0]:
            value = leaf.value if is_sharded(leaf) else leaf
            if is_array_like(value):
                yield path_str((*spec_path, *path)), value, spec


def check_spec(
    path: str,
    shape: tuple[int, ...],
    spec: P,
    mesh: Mesh | jax.sharding.AbstractMesh,
    *,
    what: str = "parameter",
) -> None:
    """Raise a `SpecError` unless `spec` can shard an array of `shape` on `mesh`.

    Checks, in order: the spec is a `PartitionSpec`; it has no more entries than the
    array has dimensions; every axis it names is on the mesh; no axis is named twice;
    every split dimension is divisible by the product of its axes' sizes.

    **Arguments:**

    - `path`: the parameter's path, for the message.
    - `shape`: the array's global shape.
    - `spec`: the spec to check.
    - `mesh`: the mesh it will be used on.
    - `what`: what the array is, for the message ("parameter", "input", ...).
    """
    where = f"{what} `{path}` (shape {tuple(shape)}) with spec {spec} on {describe_mesh(mesh)}"
    if not is_spec(spec):
        raise SpecError(f"{where}: a spec must be a jax.sharding.PartitionSpec, got {spec!r}.")
    if len(spec) > len(shape):
        raise SpecError(
            f"{where}: the spec has {len(spec)} entries but the array has only "
            f"{len(shape)} dimensions."
        )
    axes = spec_axes(spec)
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise SpecError(
            f"{where}: axis {unknown[0]!r} is not an axis of the mesh "
            f"(its axes are {tuple(mesh.shape)})."
        )
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if repeated:
        raise SpecError(f"{where}: mesh axis {repeated[0]!r} is used more than once.")
    for dim, (entry, size) in enumerate(zip(spec, spec_divisors(spec, mesh.shape))):
        if shape[dim] % size:
            names = entry_axes(entry)
            raise SpecError(
                f"{where}: dimension {dim} has size {shape[dim]}, which is not divisible "
                f"by {size} (the size of {' x '.join(repr(n) for n in names)})."
            )


def check_tree_specs(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | jax.sharding.AbstractMesh,
    *,
    what: str = "parameter",
    prefix: str = "",
) -> None:
    """Validate every array of `tree` against its spec in `specs` (see `check_spec`).

    Also raises a `SpecError` naming both structures when `specs` is not a tree prefix
    of `tree`.
    """
    try:
        items = list(leaves_with_specs(tree, specs))
    except ValueError as err:
        raise SpecError(
            f"the specs given for {what} `{prefix or '<root>'}` do not match its structure "
            f"on {describe_mesh(mesh)}: specs {jax.tree.structure(specs, is_leaf=is_spec)} "
            f"vs {jax.tree.structure(tree, is_leaf=is_sharded)} ({err})"
        ) from None
    for path, value, spec in items:
        check_spec(join_path(prefix, path), tuple(value.shape), spec, mesh, what=what)


def join_path(prefix: str, path: str) -> str:
    """Join a parent path and a child path: `join_path("args[0]", "mlp.w1")`."""
    if not prefix:
        return path
    if path == "<root>":
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"
