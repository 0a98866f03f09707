"""Optimizer-state sharding: how the optimizer state is laid out, as one object.

The train step asks an `OptStateSharding` these things, and nothing else about it:

- `split(opt_state)`: the optimizer state's layout, given to a freshly built state
  (`init_train_state`).
- `check(opt_state)`: raise if a state was not built with this layout.
- `view(tree)`: a tree of the parameters' structure (parameters, gradients) in the
  layout of the optimizer state, i.e. as the update reads and writes it.
- `reduce(grad, pending)`: inside `shard_map`, one local gradient summed over the data
  axes it still has to be summed over, delivered in `view`'s layout.
- `for_update(model)`: the parameters as the update reads them.
- `restore(model, like)`: the updated parameters back in their own layout.

`Mirror` (the state as its parameters) and `ZeRO1` (the state split over data axes) are
the two layouts; a new layout is a new subclass.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import combined_axis_size
from .._errors import LayerConfigError
from ..sharding import is_sharded, shard, zero_split
from ..sharding._internal import ZeroAxes, spec_axes, with_spec, zero_axes


class OptStateSharding:
    """The optimizer state's layout (the base class: the state mirrors its parameters)."""

    axes: tuple[str, ...] = ()
    reduces_gradients: bool = False
    """Whether `reduce` has work even without accumulation (the gradients then leave each
    micro-step unreduced, for it)."""

    def split(self, opt_state: PyTree) -> PyTree:
        """`opt_state` in this layout (only specs change outside `jit`)."""
        return opt_state

    def check(self, opt_state: PyTree) -> None:
        """Raise `LayerConfigError` unless `opt_state` was built in this layout."""

    def view(self, tree: PyTree) -> PyTree:
        """`tree` (of the parameters' structure) in the optimizer state's layout."""
        return tree

    def reduce(self, grad: Any, pending: tuple[str, ...] | None, like: Any) -> Any:
        """Inside `shard_map`: one local gradient summed over its `pending` data axes.

        `like`: the gradient's box in `view`'s layout (unused here).
        """
        value = grad.value if is_sharded(grad) else grad
        if not pending:
            return grad
        summed = jax.lax.psum(value, pending)
        return grad.with_value(summed) if is_sharded(grad) else summed

    def for_update(self, model: PyTree) -> PyTree:
        """The parameters as the update reads them (global arrays in `view`'s layout)."""
        return model

    def restore(self, model: PyTree, like: PyTree) -> PyTree:
        """The updated `model` (in `view`'s layout) back in `like`'s layout."""
        return model


class Mirror(OptStateSharding):
    """The default layout: every optimizer-state array as its parameter."""


class ZeRO1(OptStateSharding):
    """ZeRO-1: the optimizer state split over data axes beyond its parameters' specs.

    Each gradient the ZeRO rule splits (`equishard.sharding.zero_split`) is
    reduce-scattered over the axes, the update runs on the state's shards and the
    updated parameters are all-gathered once.
    """

    reduces_gradients = True

    def __init__(self, axes: tuple[str, ...], mesh: Mesh, min_weight_size: int):
        self.axes = axes
        self.mesh = mesh
        self.min_weight_size = min_weight_size

    def split(self, opt_state: PyTree) -> PyTree:
        return zero_split(opt_state, self.axes, mesh=self.mesh, min_weight_size=self.min_weight_size)

    def check(self, opt_state: PyTree) -> None:
        if jax.tree.structure(self.split(opt_state)) != jax.tree.structure(opt_state):
            raise LayerConfigError(
                f"make_train_step(zero={self.axes!r}): the optimizer state is not split over "
                f"{self.axes!r} as the step updates it; build the state with "
                f"init_train_state(..., zero={self.axes!r}) (the same zero_min_weight_size), "
                f"or restore a checkpoint into such a state (see the training guide)."
            )

    def view(self, tree: PyTree) -> PyTree:
        return self.split(tree)

    def reduce(self, grad: Any, pending: tuple[str, ...] | None, like: Any) -> Any:
        """Reduce-scatter over the ZeRO axes a gradient the rule splits (the other pending
        axes all-reduced), or, if it is already summed, slice this device's block."""
        value = grad.value if is_sharded(grad) else grad
        old = grad.spec if is_sharded(grad) else P(*((None,) * value.ndim))
        new = like.spec if is_sharded(like) else old
        dims = [d for d, (a, b) in enumerate(zip(old, new)) if a != b]
        if not dims:  # kept as the parameter is: all-reduced over its pending axes
            value = jax.lax.psum(value, pending) if pending else value
        else:
            dim = dims[0]
            split = tuple(a for a in self.axes if a in spec_axes(new) and a not in spec_axes(old))
            if pending is not None and set(split) <= set(pending):
                # f32[..., D, ...] -> f32[..., D/zero, ...]: reduce-scatter over the ZeRO
                # axes, then the shard summed over the other pending axes (1/zero of the bytes).
                value = jax.lax.psum_scatter(value, split, scatter_dimension=dim, tiled=True)
                rest = tuple(a for a in pending if a not in split)
                value = jax.lax.psum(value, rest) if rest else value
            else:
                value = jax.lax.psum(value, pending) if pending else value
                block = value.shape[dim] // combined_axis_size(split)
                start = jax.lax.axis_index(split) * block
                value = jax.lax.dynamic_slice_in_dim(value, start, block, axis=dim)
        if is_sharded(like):
            return with_spec(like.with_value(value), like.spec)
        return value

    def for_update(self, model: PyTree) -> PyTree:
        # A local slice of a replicated array: laid out as the optimizer state is.
        return shard(self.view(model), self.mesh)

    def restore(self, model: PyTree, like: PyTree) -> PyTree:
        # The updated shards, all-gathered once (by the step's final `shard`).
        return _with_specs_of(shard(model, self.mesh), like)


def opt_state_sharding(
    zero: ZeroAxes | None, mesh: Mesh, min_weight_size: int, what: str
) -> OptStateSharding:
    """The layout that `zero=` names: `ZeRO1` over its axes, or `Mirror` for `None`."""
    axes = zero_axes(zero, mesh, what)
    return ZeRO1(axes, mesh, min_weight_size) if axes else Mirror()


def _with_specs_of(tree: PyTree, like: PyTree) -> PyTree:
    """`tree`'s arrays in `like`'s boxes (the same structure but for the boxes' specs)."""
    return jax.tree.map(
        lambda new, old: old.with_value(new.value) if is_sharded(old) and is_sharded(new)
        else new.value if is_sharded(new) else new,
        tree,
        like,
        is_leaf=is_sharded,
    )
