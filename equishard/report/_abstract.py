"""A train step lowered from shapes alone: the state is never allocated.

`equishard inspect` and `abstract_train_step` read a step's collectives and memory
from the compiled program; the parameters and optimizer state only need their shapes,
dtypes and shardings, so a model too large for the machine running the report can
still be reported on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..sharding import is_array_like, specs_of
from ..sharding._internal import is_spec


def abstract_state(make_state: Callable[[], Any], mesh: Mesh) -> Any:
    """`make_state()` traced, not run: each array a `ShapeDtypeStruct` carrying the
    sharding of its spec on `mesh` (the boxes and every static field kept)."""
    tree = eqx.filter_eval_shape(make_state)

    def on_subtree(spec: P | None, sub: Any) -> Any:
        if spec is None:
            return sub
        sharding = NamedSharding(mesh, spec)

        def on_leaf(leaf: Any) -> Any:  # boxes are pytree nodes: their values are leaves
            if is_array_like(leaf):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            return leaf

        return jax.tree.map(on_leaf, sub)

    specs = specs_of(tree)
    return jax.tree.map(on_subtree, specs, tree, is_leaf=lambda s: s is None or is_spec(s))


def lower_from_shapes(step: Callable[[Any, Any], Any], state: Any, batch: Any) -> jax.stages.Lowered:
    """`step(state, batch)` lowered for `state` from `abstract_state` (the old state's
    buffers donated, as `make_train_step`'s step donates them); `batch` concrete or
    `ShapeDtypeStruct`s."""
    dynamic, static = eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def whole(dynamic: Any, batch: Any) -> Any:
        return step(eqx.combine(dynamic, static), batch)

    return jax.jit(whole, donate_argnums=0).lower(dynamic, batch)
