"""`TrainState`, what a run carries from one step to the next, and `init_train_state`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ..sharding import sharded_init
from ..sharding._internal import DEFAULT_MIN_WEIGHT_SIZE, ZeroAxes
from ._format import FORMAT_VERSION, TRAIN_STATE_FIELDS
from ._opt_sharding import opt_state_sharding


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
    """

    step: Int[Array, ""]
    model: PyTree
    opt_state: PyTree
    key: PRNGKeyArray
    data_position: Int[Array, ""]
    skipped: Int[Array, ""]


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


def init_train_state(
    make_model: Callable[[PRNGKeyArray], PyTree],
    optimizer: optax.GradientTransformation,
    key: PRNGKeyArray,
    *,
    mesh: Mesh,
    zero: ZeroAxes | None = None,
    zero_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
) -> TrainState:
    """Build a `TrainState` directly sharded on `mesh` (mesh-invariant).

    **Arguments:**

    - `make_model`: `make_model(key) -> model`, e.g. `lambda k: GPT(config, key=k)`.
    - `optimizer`: an optax optimizer; its state inherits the parameters' specs.
    - `key`: the run's key; the model is built from `fold_in(key, 0)`.
    - `mesh`: the mesh.
    - `zero`: optimizer-state sharding (ZeRO-1): the mesh axis or axes (e.g. `"dp"`)
      the optimizer state's arrays are split over, beyond their parameters' specs
      (`equishard.sharding.zero_split`); the state then trains with
      `make_train_step(..., zero=...)` of the same axes. `None`: the state mirrors the
      parameters' specs. See the training guide.
    - `zero_min_weight_size`: with `zero`, optimizer-state arrays of fewer elements stay
      as their parameters are.

    **Returns:**

    The initial state, every array placed by its spec.
    """
    # checked before tracing
    layout = opt_state_sharding(zero, mesh, zero_min_weight_size, "init_train_state")

    def make(key: PRNGKeyArray) -> TrainState:
        model = make_model(jax.random.fold_in(key, 0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            model=model,
            opt_state=layout.split(opt_state),
            key=key,
            data_position=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )

    return sharded_init(make, key, mesh=mesh)
