"""The reference GPT's training under a layout, built once for every caller.

`gpt_training` wires the GPT to `make_train_step` for a resolved layout: the model's
constructor, the loss, the initial state (mesh-invariant, the optimizer state split under
ZeRO) and the train step, whose precision policy decides every cast. `equishard
train` runs it (the application's `Run`); `abstract_train_step` lowers the same step from
shapes alone for a mesh of any size, nothing allocated or run, so a 2048-device mesh of
a 70B-parameter model compiles on a laptop's simulated CPU devices; `gpt_report`
compiles it and reads the report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PRNGKeyArray

from .._errors import LayerConfigError, MeshError
from ..nn import LoRA
from ..report._internal import abstract_state, lower_from_shapes
from ..sharding import Layout, Parallelism
from ..sharding._internal import resolve_layout
from ..train import (
    MixedPrecision,
    Precision,
    Trainable,
    TrainState,
    TrainStep,
    ZeRO1,
    make_train_step,
)
from ._gpt import GPT, PRESETS, GPTConfig, cast_floating, check_context_split
from ._lora import adapters_trainable

__all__ = [
    "AbstractStep",
    "GPTTraining",
    "abstract_train_step",
    "check_gpt_layout",
    "gpt_training",
    "precision_policy",
    "preset",
]


def precision_policy(dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> Precision | None:
    """The train step's precision policy for a compute and a parameter dtype.

    **Arguments:**

    - `dtype`: the dtype the loss computes in.
    - `param_dtype`: the dtype the parameters (and the optimizer's moments) are stored in.

    **Returns:**

    `MixedPrecision(dtype)` (FSDP gathering in `dtype`, gradients reduced in float32) when
    the two differ, `None` (no cast) when they are the same.
    """
    return None if jnp.dtype(dtype) == jnp.dtype(param_dtype) else MixedPrecision(dtype)


def preset(name: str) -> GPTConfig:
    """The `GPTConfig` of a preset name from `equishard.models.PRESETS`.

    **Raises:**

    `LayerConfigError` naming the known presets.
    """
    if name not in PRESETS:
        raise LayerConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]


@dataclasses.dataclass(frozen=True)
class GPTTraining:
    """The reference GPT's training under a layout (see `gpt_training`).

    **Fields:**

    - `make_model`: `key -> GPT`, the model under the layout, its floating arrays in the
      parameter dtype.
    - `loss_fn`: `(model, batch, key) -> (loss, metrics)`, the GPT's loss in the local
      view as the step computes it (its precision policy applied; `key` `None`: no
      dropout, as in evaluation).
    - `init_state`: `key -> TrainState`, the initial state born sharded on the mesh
      (mesh-invariant; the optimizer state split under ZeRO).
    - `step`: the `TrainStep` (`state, batch -> state, metrics`).
    """

    make_model: Callable[[PRNGKeyArray], GPT]
    loss_fn: Callable[[GPT, Any, Any], Any]
    init_state: Callable[[PRNGKeyArray], TrainState]
    step: TrainStep


def gpt_training(
    config: GPTConfig,
    layout: Parallelism,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    *,
    grad_accum: int = 1,
    clip_norm: float | None = None,
    precision: Precision | None = None,
    param_dtype: Any = jnp.float32,
    lora: LoRA | None = None,
    trainable: Trainable | Callable[[str, Any], bool] | None = None,
) -> GPTTraining:
    """Wire the reference GPT to `make_train_step` under a resolved layout.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the resolved layout (`Layout.resolve`, a `Parallelism`): the model's
      axes, the batch's spec and the optimizer state's split.
    - `mesh`: the mesh of that layout (`layout.mesh(devices)`).
    - `optimizer`: the optax optimizer.
    - `grad_accum`, `clip_norm`: `make_train_step`'s accumulation micro-steps and
      global-norm clipping threshold (`None`: no clipping).
    - `precision`: the step's precision policy (`None`: no cast; `precision_policy`
      makes one from dtypes).
    - `param_dtype`: the dtype the parameters (and so the optimizer's moments) are stored
      in.
    - `lora`: LoRA adapters on the blocks' projections (`None`: none): the model is
      made with them (`B` zero: it computes what its base does) and, unless `trainable`
      says otherwise, only they are trained (`adapters_trainable()`).
    - `trainable`: the step's trainable filter (see `make_train_step`; `None`: every
      floating array, or the adapters with `lora`).

    **Returns:**

    A `GPTTraining`.
    """
    par = layout
    if lora is not None and trainable is None:
        trainable = adapters_trainable()

    def make_model(key: PRNGKeyArray) -> GPT:
        return cast_floating(GPT(config, par, key=key, lora=lora), param_dtype)

    def gpt_loss(model: GPT, batch: Any, key: Any, *, index: Any = None) -> Any:
        # The examples' global indices: adapter dropout's masks are the same on every
        # layout and under any `grad_accum` (the step passes them; `None`: no micro-steps).
        return model.loss(batch, key, index=index)

    opt_sharding = ZeRO1(layout.zero, min_weight_size=par.fsdp_min_weight_size) if layout.zero else None
    step = make_train_step(
        gpt_loss, optimizer, mesh=mesh, batch_spec=layout.batch_spec, grad_accum=grad_accum,
        clip_norm=clip_norm, opt_sharding=opt_sharding, precision=precision, trainable=trainable,
    )  # fmt: skip

    def loss_fn(model: GPT, batch: Any, key: Any) -> Any:
        return gpt_loss(step.precision.compute(model), batch, key)

    def init_state(key: PRNGKeyArray) -> TrainState:
        return step.init_state(make_model, key)

    return GPTTraining(make_model, loss_fn, init_state, step)


def check_gpt_layout(
    config: GPTConfig, layout: Layout | Parallelism, num_devices: int, batch_size: int, seq_len: int
) -> None:
    """Check, before anything is traced, that a GPT step fits the layout and devices.

    The layout must use exactly `num_devices`; the batch must split over the data axes
    and the pipeline's micro-batches; the model must divide by the tensor, expert and
    pipeline axes (the model's own checks, run on its shapes).

    **Raises:**

    `MeshError` or `LayerConfigError`, with the numbers involved.
    """
    layout = resolve_layout(layout, num_devices)
    if layout.num_devices != num_devices:
        raise MeshError(
            f"layout {layout.spec!r} uses {layout.num_devices} devices but {num_devices} were "
            f"asked for; the product of the axis sizes must equal the number of devices."
        )
    if batch_size < 1 or seq_len < 1:
        raise LayerConfigError("the batch size and sequence length must be at least 1.")
    data = layout.data_parallel_size
    if batch_size % data:
        raise LayerConfigError(
            f"the batch of {batch_size} sequences does not split over the {data} ways the "
            f"layout {layout.spec!r} splits the batch; use a multiple of {data}."
        )
    micro = layout.num_microbatches
    if (batch_size // data) % micro:
        raise LayerConfigError(
            f"the per-device batch of {batch_size // data} sequences does not divide into "
            f"{micro} pipeline micro-batches."
        )
    par = layout
    check_context_split(par, seq_len)
    mesh = jax.sharding.AbstractMesh(par.sizes, par.axes)
    with jax.sharding.use_abstract_mesh(mesh):
        eqx.filter_eval_shape(lambda: GPT(config, par, key=jax.random.key(0)))


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    """A lowered GPT train step and what it was built from (see `abstract_train_step`).

    **Fields:**

    - `lowered`: the `jax.stages.Lowered` program (`state, batch -> state, metrics`,
      the state donated).
    - `state`: the `TrainState` of `ShapeDtypeStruct`s it was lowered for.
    - `mesh`: the mesh.
    - `config`, `layout`, `batch_size`, `seq_len`: what was asked for (the layout
      resolved).
    - `lower_seconds`: the time tracing and lowering took.
    - `compute_dtype`, `param_dtype`: the dtype the loss computes in (the precision
      policy's) and the parameters'.
    """

    lowered: Any
    state: TrainState
    mesh: Mesh
    config: GPTConfig
    layout: Parallelism
    batch_size: int
    seq_len: int
    lower_seconds: float
    compute_dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


def abstract_train_step(
    config: GPTConfig,
    layout: Layout | Parallelism,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: optax.GradientTransformation,
    clip_norm: float | None = None,
    devices: list | None = None,
    precision: Precision | None = None,
    param_dtype: Any = jnp.float32,
) -> AbstractStep:
    """Lower the real GPT train step for `layout` without creating any array.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the `Layout` (or one already resolved); its size must equal the number
      of `devices`.
    - `batch_size`, `seq_len`: the global batch in sequences, and their length.
    - `optimizer`: the optax optimizer (its state's shapes and specs, and its update,
      are part of the step).
    - `clip_norm`: the global-norm clipping threshold of `make_train_step` (`None`:
      no clipping).
    - `devices`: the devices of the mesh (default: all of JAX's devices).
    - `precision`: the step's precision policy (see `gpt_training`).
    - `param_dtype`: the dtype the parameters (and so the optimizer's moments) are stored
      in.

    **Returns:**

    An `AbstractStep`; `.lowered.compile()` compiles it.

    **Raises:**

    `MeshError` / `LayerConfigError` (see `check_gpt_layout`) before tracing.
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_layout(layout, len(devices))
    check_gpt_layout(config, resolved, len(devices), batch_size, seq_len)
    start = time.perf_counter()
    mesh = resolved.mesh(devices)
    training = gpt_training(
        config, resolved, mesh, optimizer, clip_norm=clip_norm, precision=precision,
        param_dtype=param_dtype,
    )  # fmt: skip
    state = abstract_state(lambda: training.init_state(jax.random.key(0)), mesh)
    sharding = NamedSharding(mesh, resolved.batch_spec)
    batch: Any
    if resolved.context:  # inputs, labels and positions [B, S], split over cp too
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
        batch = {"inputs": tokens, "labels": tokens, "positions": tokens}
    else:
        batch = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=sharding)
    lowered = lower_from_shapes(training.step, state, batch)
    compute = training.step.precision.compute_dtype
    return AbstractStep(
        lowered, state, mesh, config, resolved, batch_size, seq_len, time.perf_counter() - start,
        compute_dtype=jnp.dtype(param_dtype if compute is None else compute), param_dtype=jnp.dtype(param_dtype),
    )  # fmt: skip
