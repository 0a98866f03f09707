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
the two layouts; a new layout is a new subclass. A layout is a value the user passes
(`make_train_step(..., opt_sharding=ZeRO1("dp"))`); the step binds it to its mesh
(`bind`) and holds it, and `TrainStep.init_state` builds the state in it.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import combined_axis_size
from .._errors import LayerConfigError
from ..sharding import is_sharded, shard, zero_split
from ..sharding._internal import DEFAULT_MIN_WEIGHT_SIZE, ZeroAxes, spec_axes, with_spec, zero_axes


class OptStateSharding(eqx.Module):
    """The optimizer state's layout (the base class: the state mirrors its parameters)."""

    @property
    def axes(self) -> tuple[str, ...]:
        """The data axes the state is split over beyond its parameters' specs."""
        return ()

    @property
    def reduces_gradients(self) -> bool:
        """Whether `reduce` has work even without accumulation (the gradients then leave
        each micro-step unreduced, for it)."""
        return False

    def bind(self, mesh: Mesh, what: str) -> "OptStateSharding":
        """This layout on `mesh`, checked against it (`what` names the caller in errors)."""
        return self

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

    zero_axes: tuple[str, ...] = eqx.field(static=True)
    min_weight_size: int = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)

    def __init__(
        self, axes: ZeroAxes, *, min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE, mesh: Mesh | None = None
    ):
        """**Arguments:**

        - `axes`: the data axis or axes the state is split over (e.g. `"dp"`).
        - `min_weight_size`: optimizer-state arrays of fewer elements stay as their
          parameters are.
        - `mesh`: the mesh (`None`: bound by the train step, `bind`).
        """
        self.zero_axes = (axes,) if isinstance(axes, str) else tuple(axes)
        self.min_weight_size = min_weight_size
        self.mesh = mesh

    @property
    def axes(self) -> tuple[str, ...]:
        return self.zero_axes

    @property
    def reduces_gradients(self) -> bool:
        return True

    def bind(self, mesh: Mesh, what: str) -> "ZeRO1":
        axes = zero_axes(self.zero_axes, mesh, what)
        return ZeRO1(axes, min_weight_size=self.min_weight_size, mesh=mesh)

    def split(self, opt_state: PyTree) -> PyTree:
        return zero_split(opt_state, self.axes, mesh=self.mesh, min_weight_size=self.min_weight_size)

    def check(self, opt_state: PyTree) -> None:
        if jax.tree.structure(self.split(opt_state)) != jax.tree.structure(opt_state):
            raise LayerConfigError(
                f"make_train_step(opt_sharding={self!r}): the optimizer state is not split over "
                f"{self.axes!r} as the step updates it; build the state with "
                f"step.init_state(...) (or init_train_state(..., opt_sharding=) of the same "
                f"value), or restore a checkpoint into such a state (see the training guide)."
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


def bind_opt_sharding(opt_sharding: Any, mesh: Mesh, what: str) -> OptStateSharding:
    """`opt_sharding` (`None`: `Mirror()`) bound to `mesh`, refused by name if it is not one."""
    if opt_sharding is None:
        return Mirror()
    if not isinstance(opt_sharding, OptStateSharding):
        raise LayerConfigError(
            f"{what}: opt_sharding must be an optimizer-state layout, equishard.train.Mirror() "
            f"(the default) or equishard.train.ZeRO1(axes), got {opt_sharding!r}."
        )
    return opt_sharding.bind(mesh, what)


def _with_specs_of(tree: PyTree, like: PyTree) -> PyTree:
    """`tree`'s arrays in `like`'s boxes (the same structure but for the boxes' specs)."""
    return jax.tree.map(
        lambda new, old: old.with_value(new.value) if is_sharded(old) and is_sharded(new)
        else new.value if is_sharded(new) else new,
        tree,
        like,
        is_leaf=is_sharded,
    )
