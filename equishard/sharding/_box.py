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

from .._errors import SpecError


class Sharded(eqx.Module):
    """An array together with the `PartitionSpec` that says how it is split.

    `value` is the global array outside `shard_map` and this device's block inside it
    (the local view); `spec` and `shape` (the global shape) are static and the same in
    both. Layers read `self.weight.value`; a plain module that was given boxes by
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
    - `shape`: the global shape; defaults to `value.shape` (pass it when boxing a local
      block inside `shard_map`).
    """

    value: ArrayLike
    spec: P = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, value: ArrayLike, spec: P = P(), shape: tuple[int, ...] | None = None):
        if not isinstance(spec, P):
            raise SpecError(
                f"Sharded(spec=...) takes a jax.sharding.PartitionSpec, got {spec!r}."
            )
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
        self.shape = shape

    def with_value(self, value: ArrayLike) -> "Sharded":
        """The same box (type, spec, global shape) around another value."""
        return eqx.tree_at(lambda b: b.value, self, value)


def is_sharded(x: Any) -> bool:
    """Whether `x` is a `Sharded` box (use as `is_leaf=` when mapping over boxes)."""
    return isinstance(x, Sharded)


def unbox(tree: PyTree) -> PyTree:
    """Replace every `Sharded` box in `tree` by the array it holds.

    Use it where a plain module is called: `unbox(model)(x)`. Outside `shard_map` this
    gives global arrays, inside it local blocks.

    **Arguments:**

    - `tree`: any pytree.

    **Returns:**

    The same pytree with each box replaced by its `value`, and each wrapper that
    defines `__unbox__` (`equishard.nn.FSDP`) replaced by the plain module it wraps:
    `unbox(gather(model))` of an FSDP-wrapped model is the model as it was written.
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


def add_leading_axis(tree: PyTree, entry: str | tuple[str, ...] | None = None) -> PyTree:
    """Prepend one entry to the spec of every box in `tree`.

    For trees whose arrays gained a leading axis, e.g. layers built with
    `eqx.filter_vmap` and stacked for `jax.lax.scan` (`entry=None`), or pipeline stages
    stacked over a stage axis (`entry="pp"`).

    **Arguments:**

    - `tree`: a pytree whose boxes hold arrays with one more leading dimension than
      their specs describe.
    - `entry`: the spec entry for the new leading dimension.

    **Returns:**

    `tree` with every box's spec `P(entry, *spec)`.
    """

    def _prepend(x: Any) -> Any:
        if not is_sharded(x):
            return x
        return type(x)(x.value, P(entry, *x.spec), tuple(x.value.shape)[:1] + x.shape)

    return jax.tree.map(_prepend, tree, is_leaf=is_sharded)


def drop_leading_axis(tree: PyTree) -> PyTree:
    """Remove the first entry of every box's spec and shape (inverse of `add_leading_axis`).

    For one layer taken out of a stack, e.g. inside the body of a `jax.lax.scan` over
    stacked layers, whose values have already lost the leading dimension.

    **Arguments:**

    - `tree`: a pytree of boxes made for stacked arrays.

    **Returns:**

    `tree` with every box's spec and global shape for one slice.
    """

    def _drop(x: Any) -> Any:
        if not is_sharded(x):
            return x
        return type(x)(x.value, P(*tuple(x.spec)[1:]), x.shape[1:])

    return jax.tree.map(_drop, tree, is_leaf=is_sharded)


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
        if e is None:
            return None
        names = tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in keep)
        return None if not names else names[0] if len(names) == 1 else names

    def _restrict(x: Any) -> Any:
        if not is_sharded(x):
            return x
        return type(x)(x.value, P(*(entry(e) for e in x.spec)), x.shape)

    return jax.tree.map(_restrict, tree, is_leaf=is_sharded)
