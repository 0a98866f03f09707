"""The one mechanism by which arrays carry their `PartitionSpec`.

An array that is sharded (or deliberately replicated) is held in a `Sharded` box: an
`eqx.Module` whose only child is the array and whose `spec` is a static field. Being a
pytree node with static metadata, the box survives every `jax.tree.map`: gradients,
optax states (`optax.adamw(...).init(params)` maps over the leaves and rebuilds the
boxes), checkpoints and `eqx.filter_*` transforms all carry the spec with no extra code.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, PyTree

from .._axes import bound_axis_size, entry_axes, local_shape
from .._errors import SpecError


class Sharded(eqx.Module):
    """An array together with the `PartitionSpec` that says how it is split.

    `value` is the global array outside `shard_map` and this device's block inside it
    (the local view); `spec` and `global_shape` are static and the same in both. Layers read `self.weight.value`; a plain module that was given boxes by
    `apply_rules` is called through `unbox`.

    Because the box is an ordinary pytree node, `jax.tree.map` rebuilds it around new
    values with the same spec and shape: gradients and optax states inherit their
    parameters' specs by structure. A rebuilt box whose value no longer has the shape
    it was made for (adafactor's factored moments, a placeholder) does not fit its spec,
    and `specs_of` treats it as replicated.

    **Arguments:**

    - `value`: the array (global outside `shard_map`, a local block inside it).
    - `spec`: a `jax.sharding.PartitionSpec`, one entry per leading dimension (missing
      trailing entries mean "not split"; the box stores it padded with `None`).
    - `global_shape`: the global shape; defaults to `value.shape` (pass it when boxing
      a local block inside `shard_map`).
    """

    value: ArrayLike
    spec: P = eqx.field(static=True)
    global_shape: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        value: ArrayLike,
        spec: P = P(),
        global_shape: tuple[int, ...] | None = None,
    ):
        if not isinstance(spec, P):
            raise SpecError(
                f"Sharded(spec=...) takes a jax.sharding.PartitionSpec, got {spec!r}."
            )
        shape = global_shape
        if shape is not None:
            _check_value_shape(value, P(*spec), tuple(int(d) for d in shape))
        if shape is None:
            scalar = isinstance(value, (int, float, complex, bool))
            shape = tuple(np.shape(value) if scalar else value.shape)  # type: ignore[union-attr]
        shape = tuple(int(d) for d in shape)
        if len(spec) > len(shape):
            raise SpecError(
                f"spec {spec} has {len(spec)} entries but the array it boxes has shape "
                f"{shape}."
            )
        self.value = value
        self.spec = P(*spec, *((None,) * (len(shape) - len(spec))))
        self.global_shape = shape

    def with_value(self, value: ArrayLike) -> "Sharded":
        """The same box (type, spec, global shape) around another value."""
        return _rebuilt(self, value, self.spec)


def with_spec(box: Sharded, spec: P) -> Sharded:
    """The same box (class, value, global shape) under another spec.

    The value is not checked against the new spec: a box optax rebuilt around an array
    of another shape (adafactor's factored moments) keeps not fitting it, and `specs_of`
    keeps reading it as replicated. Every box of a tree rewritten this way by the same
    rule keeps the tree's structure the same as its parameters' (optax maps over both).
    """
    return _rebuilt(box, box.value, P(*spec, *((None,) * (len(box.global_shape) - len(spec)))))


def _rebuilt(box: Sharded, value: ArrayLike, spec: P) -> Sharded:
    """A box of `box`'s class and global shape around `value` under `spec`, made
    as unflattening a tree makes it: without `__init__`'s checks, and cheaply (boxes are
    rewritten for every array at every trace)."""
    new = object.__new__(type(box))
    object.__setattr__(new, "value", value)
    object.__setattr__(new, "spec", spec)
    object.__setattr__(new, "global_shape", box.global_shape)
    return new


def _check_value_shape(value: Any, spec: P, global_shape: tuple[int, ...]) -> None:
    """A box's value is its global array outside `shard_map` and its block inside.

    Checked where the global shape is given (without it, it is the value's shape).
    Outside (no axis of `spec` bound) the value must have the global shape; inside
    (every axis of `spec` bound) the shape of this device's block. A value of another
    shape would otherwise not fit its spec and be treated as replicated without a word.
    Boxes that optax rebuilds around other shapes (adafactor's factored moments) do not
    come through here and keep falling back to replicated.
    """
    value_shape = getattr(value, "shape", None)
    if value_shape is None:
        return
    names = [a for entry in spec for a in entry_axes(entry)]
    sizes = {a: bound_axis_size(a) for a in names}
    if all(size is None for size in sizes.values()):
        expected, holds = global_shape, "outside `shard_map` a box holds the global array"
    elif all(size is not None for size in sizes.values()):
        bound = {a: int(size) for a, size in sizes.items() if size is not None}
        expected = local_shape(global_shape, spec, bound)
        holds = "inside `shard_map` a box holds this device's block of the global shape"
    else:
        return  # some axes manual, some not (shard_map over part of the mesh)
    if tuple(value_shape) != expected:
        raise SpecError(
            f"Sharded: the value has shape {tuple(value_shape)} but the box's global shape "
            f"is {global_shape} with spec {spec}, so {holds}, of shape {expected}. Pass "
            f"`global_shape=` the global shape when boxing a block inside `shard_map`, and "
            f"only there."
        )


def is_sharded(x: Any) -> bool:
    """Whether `x` is a `Sharded` box (use as `is_leaf=` when mapping over boxes)."""
    return isinstance(x, Sharded)


def unbox(tree: PyTree) -> PyTree:
    """Replace every `Sharded` box in `tree` by the array it holds.

    Use it where a plain module is called: `unbox(model)(x)`. Outside `shard_map` this
    gives global arrays, inside it local blocks — except an `equishard.nn.FSDP` unit's,
    which inside `shard_map` over its axis are all-gathered (their gradients
    reduce-scattered), so that the plain module computes with its global parameters in
    either view (calling the model itself keeps one unit's parameters whole at a time).

    **Arguments:**

    - `tree`: any pytree.

    **Returns:**

    The same pytree with each box replaced by its `value`, and each module that
    defines `__unbox__` replaced by the plain module it stands for: an
    `equishard.nn.FSDP` unit by the module it wraps, a `PipelineModule` by the
    `eqx.nn.Sequential` of its layers, the layers `equishard.parallelize` made by the
    `eqx.nn.Linear`, `eqx.nn.Embedding`, `eqx.nn.Dropout` and attention classes they
    were made from. equishard's other layers keep their class and compute with plain
    arrays as with boxes. So `unbox(gather(model))` is a model a plain Equinox user
    calls on one device (see the "Your own model" guide).
    """

    def opens(x: Any) -> bool:
        return is_sharded(x) or callable(getattr(x, "__unbox__", None))

    def open_(x: Any) -> Any:
        if is_sharded(x):
            return x.value
        if callable(getattr(x, "__unbox__", None)):
            return unbox(x.__unbox__())
        return x

    return jax.tree.map(open_, tree, is_leaf=opens)


def box(tree: PyTree, specs: PyTree) -> PyTree:
    """Wrap the arrays of `tree` in `Sharded` boxes with the matching specs.

    **Arguments:**

    - `tree`: a pytree of arrays (already boxed arrays are re-boxed with the new spec).
    - `specs`: a pytree of `PartitionSpec`s with the structure of `specs_of(tree)`;
      `None` leaves arrays unboxed.

    **Returns:**

    `tree` with each array leaf held in a `Sharded` box.
    """
    plain = unbox(tree)

    def _wrap(spec: P | None, x: Array) -> Any:
        if spec is None or not eqx.is_array(x):
            return x
        return Sharded(x, spec)

    return jax.tree.map(
        _wrap, specs, plain, is_leaf=lambda s: s is None or isinstance(s, P)
    )


def plain_arrays(tree: PyTree) -> tuple[bool, ...]:
    """Which leaves of `tree` are plain (unboxed) arrays, boxes counting as leaves.

    The marker a module that boxes a tree with `add_leading_axis(..., box_arrays=True)`
    keeps (as a static field), so `drop_leading_axis(..., unbox=marker)` gives back
    plain arrays where the tree had them and boxes where it had boxes.
    """
    return tuple(eqx.is_array(x) for x in jax.tree.leaves(tree, is_leaf=is_sharded))


def add_leading_axis(
    tree: PyTree,
    entry: str | tuple[str, ...] | None = None,
    *,
    size: int | None = None,
    box_arrays: bool = False,
) -> PyTree:
    """Prepend one entry to the spec, and one dimension to the global shape, of every box.

    For trees whose arrays gained a leading axis: layers built with `eqx.filter_vmap`
    and stacked for `jax.lax.scan` (`entry=None`), pipeline stages stacked over a stage
    axis (`entry="pp"`), per-device copies of a module.

    **Arguments:**

    - `tree`: a pytree whose boxes hold arrays with one more leading dimension than
      their specs describe.
    - `entry`: the spec entry for the new leading dimension.
    - `size`: the global size of the new dimension; defaults to each value's leading
      size (right outside `shard_map`; inside it, pass the global size).
    - `box_arrays`: also box the plain arrays of `tree` (spec `P(entry)`); keep
      `plain_arrays(tree)` to unbox them again with `drop_leading_axis`.

    **Returns:**

    `tree` with every box's spec `P(entry, *spec)` and global shape
    `(size, *global_shape)`. Boxes keep their class.
    """

    def _prepend(x: Any) -> Any:
        if is_sharded(x):
            lead = tuple(x.value.shape)[:1] if size is None else (size,)
            return type(x)(x.value, P(entry, *x.spec), lead + x.global_shape)
        if box_arrays and eqx.is_array(x):
            shape = tuple(x.shape) if size is None else (size, *x.shape[1:])
            return Sharded(x, P(entry), shape)
        return x

    return jax.tree.map(_prepend, tree, is_leaf=is_sharded)


def drop_leading_axis(tree: PyTree, *, unbox: tuple[bool, ...] | None = None) -> PyTree:
    """Remove the first entry of every box's spec and global shape (inverse of `add_leading_axis`).

    For one layer taken out of a stack, e.g. inside the body of a `jax.lax.scan` over
    stacked layers, whose values have already lost the leading dimension. The global
    shape stays global inside `shard_map`.

    **Arguments:**

    - `tree`: a pytree of boxes made for stacked arrays.
    - `unbox`: the marker `plain_arrays` gave before `add_leading_axis(...,
      box_arrays=True)`: the boxes it marks are replaced by their values.

    **Returns:**

    `tree` with every box's spec and global shape for one slice.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
    marks = (False,) * len(leaves) if unbox is None else unbox
    if len(marks) != len(leaves):
        raise SpecError(
            f"drop_leading_axis: the marker has {len(marks)} entries but the tree has "
            f"{len(leaves)} leaves; it was made for another tree."
        )

    def _drop(x: Any, plain: bool) -> Any:
        if not is_sharded(x):
            return x
        if plain:
            return x.value
        return type(x)(x.value, P(*tuple(x.spec)[1:]), x.global_shape[1:])

    return jax.tree.unflatten(treedef, [_drop(x, m) for x, m in zip(leaves, marks)])


def restrict_specs(tree: PyTree, axis_names: Any) -> PyTree:
    """Drop from every box's spec the mesh axes that are not in `axis_names`.

    A model written for a `"tp"` axis runs unchanged on a mesh without one: its specs
    lose `"tp"` (those dimensions become replicated) and its layers, finding the axis
    unbound inside `shard_map`, compute locally.

    **Arguments:**

    - `tree`: a pytree with boxes.
    - `axis_names`: the axes to keep (e.g. `mesh.axis_names`).

    **Returns:**

    `tree` with each spec entry restricted to `axis_names` (`None` where none is left).
    """
    keep = set(axis_names)

    def entry(e: Any) -> Any:
        names = tuple(n for n in entry_axes(e) if n in keep)
        return None if not names else names[0] if len(names) == 1 else names

    def _restrict(x: Any) -> Any:
        if not is_sharded(x):
            return x
        return type(x)(x.value, P(*(entry(e) for e in x.spec)), x.global_shape)

    return jax.tree.map(_restrict, tree, is_leaf=is_sharded)
