"""`TrainState`, what a run carries from one step to the next, and `init_train_state`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._errors import TrainStepError
from ..sharding import path_str, sharded_init
from ._format import FORMAT_VERSION, TRAIN_STATE_FIELDS
from ._opt_sharding import OptStateSharding, bind_opt_sharding
from ._trainable import Trainable, check_trainable, resolve_mask


class TrainState(eqx.Module):
    """Everything a training run carries from one step to the next.

    Its specs come from its contents: the model's boxes, the optimizer state's
    (inherited by structure), and replicated scalars.

    **Fields:**

    - `step`: `int32[]`, steps taken (skipped ones included).
    - `model`: the model (arrays in `Sharded` boxes).
    - `opt_state`: the optax state.
    - `key`: the run's PRNG key; step `s` uses `fold_in(key, s)`.
    - `data_position`: `int32[]`, the global number of samples consumed.
    - `skipped`: `int32[]`, steps whose loss or gradient was not finite (not applied).
    - `model_state`: the model's `eqx.nn.State` (batch norms' running statistics, ...)
      for a model built by `eqx.nn.make_with_state`, replicated; `None` for a model
      without one. Not differentiated, not optimized, not cast by a compute dtype; a
      skipped step keeps it as it was.
    """

    step: Int[Array, ""]
    model: PyTree
    opt_state: PyTree
    key: PRNGKeyArray
    data_position: Int[Array, ""]
    skipped: Int[Array, ""]
    model_state: PyTree = None


def _check_fields() -> None:
    """Raise unless `TrainState`'s fields are those of the checkpoint format's version."""
    fields = tuple(f.name for f in dataclasses.fields(TrainState))
    saved = TRAIN_STATE_FIELDS.get(FORMAT_VERSION)
    if fields != saved:
        raise RuntimeError(
            f"TrainState's fields {fields} are not those of checkpoint format_version "
            f"{FORMAT_VERSION}, {saved}: a change to TrainState needs a new FORMAT_VERSION "
            f"and its entry in TRAIN_STATE_FIELDS (equishard/train/_format.py)."
        )


_check_fields()


def _state_index_path(model: PyTree) -> str | None:
    """The path of the first `eqx.nn.StateIndex` of `model` (`None`: it has none)."""
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)  # noqa: E731
    for path, leaf in jax.tree_util.tree_leaves_with_path(model, is_leaf=is_index):
        if is_index(leaf):
            return path_str(path).lstrip(".")
    return None


def split_model_state(made: Any) -> tuple[PyTree, eqx.nn.State | None]:
    """`(model, state)` from what `make_model` returned: a model, or a `(model, state)`
    pair (`eqx.nn.make_with_state`'s); the state's arrays strongly typed."""
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], eqx.nn.State):
        model, state = made
        # Not weakly typed (make_with_state's counters are): a step and a restored
        # checkpoint then see the same types.
        return model, jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), state)
    where = _state_index_path(made)
    if where is not None:
        raise TrainStepError(
            f"init_train_state: the model holds a stateful layer's eqx.nn.StateIndex at "
            f"`{where}` and make_model returned no state. Build it with "
            f"eqx.nn.make_with_state (`make_model = lambda k: "
            f"eqx.nn.make_with_state(Model)(..., key=k)`), which returns (model, state): "
            f"the state is then trained beside the model (see the \"Your own model\" guide)."
        )
    return made, None


def init_train_state(
    make_model: Callable[[PRNGKeyArray], PyTree],
    optimizer: optax.GradientTransformation,
    key: PRNGKeyArray,
    *,
    mesh: Mesh,
    opt_sharding: OptStateSharding | None = None,
    trainable: Trainable | Any = None,
) -> TrainState:
    """Build a `TrainState` directly sharded on `mesh` (mesh-invariant).

    **Arguments:**

    - `make_model`: `make_model(key) -> model`, e.g. `lambda k: GPT(config, key=k)`, or
      `-> (model, state)` for a model with a state (`eqx.nn.State`, e.g. batch norms'
      running statistics): `lambda k: eqx.nn.make_with_state(Model)(..., key=k)`. The
      state is kept in `TrainState.model_state` and the loss function takes the stateful
      form (see `make_train_step`).
    - `optimizer`: an optax optimizer; its state inherits the parameters' specs. It sees
      the trainable floating arrays only (`None` in place of the others): integer and
      boolean fields and frozen arrays are carried unchanged.
    - `key`: the run's key; the model is built from `fold_in(key, 0)`.
    - `mesh`: the mesh.
    - `opt_sharding`: the optimizer state's layout, the train step's: `Mirror()` (the
      default, `None`: the state mirrors the parameters' specs) or `ZeRO1(axes)`
      (optimizer-state sharding: its arrays split over those data axes beyond their
      parameters' specs, `equishard.sharding.zero_split`). `TrainStep.init_state`
      passes the step's own; see the training guide.
    - `trainable`: the trainable filter, the train step's (`None`: every floating
      array): a `Trainable`, a callable `(path, leaf) -> bool` or a pytree of bools
      (see `make_train_step`). `optimizer.init` sees only the trainable arrays: the
      frozen ones have no optimizer state. `TrainStep.init_state` passes the step's own.

    **Returns:**

    The initial state, every array placed by its spec.
    """
    # checked before tracing
    layout = bind_opt_sharding(opt_sharding, mesh, "init_train_state")
    trainable = check_trainable(trainable, "init_train_state")

    def make(key: PRNGKeyArray) -> TrainState:
        model, model_state = split_model_state(make_model(jax.random.fold_in(key, 0)))
        opt_state = optimizer.init(resolve_mask(trainable, model, "init_train_state").trained(model))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            model=model,
            opt_state=layout.split(opt_state),
            key=key,
            data_position=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            model_state=model_state,
        )

    return sharded_init(make, key, mesh=mesh)
