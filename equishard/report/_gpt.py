"""The reference GPT's real train step, compiled from shapes alone, and its report.

`abstract_train_step` builds what `equishard train` runs — the reference GPT under a
layout, the optimizer it is given, global-norm clipping, `make_train_step` — for a mesh
of any size, with the parameters and optimizer state only as
`jax.ShapeDtypeStruct`s carrying their shardings, and lowers it. Nothing is allocated or
run, so a 2048-device mesh of a 70B-parameter model compiles on a laptop's simulated
CPU devices. `gpt_report` compiles it and reads the report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from .._errors import LayerConfigError, MeshError
from ..core import pipeline_schedule, schedule_weights
from ..models import GPT, PRESETS, GPTConfig, cast_floating, check_context_split
from ..sharding import Layout, param_table
from ..train import TrainState, init_train_state, make_train_step
from ._abstract import abstract_state, lower_from_shapes
from ._memory import gpt_memory
from ._minimum import gpt_minimum, state_bytes
from ._report import StepReport, report

__all__ = [
    "AbstractStep",
    "abstract_train_step",
    "check_gpt_layout",
    "gpt_report",
    "preset",
]

def preset(name: str) -> GPTConfig:
    """The `GPTConfig` of a preset name from `equishard.models.PRESETS`.

    **Raises:**

    `LayerConfigError` naming the known presets.
    """
    if name not in PRESETS:
        raise LayerConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]


def _num_microbatches(layout: Layout, num_devices: int) -> int:
    par = layout.parallelism(num_devices)
    return par.num_microbatches if par.pipeline else 1


def check_gpt_layout(
    config: GPTConfig, layout: Layout, num_devices: int, batch_size: int, seq_len: int
) -> None:
    """Check, before anything is traced, that a GPT step fits the layout and devices.

    The layout must use exactly `num_devices`; the batch must split over the data axes
    and the pipeline's micro-batches; the model must divide by the tensor, expert and
    pipeline axes (the model's own checks, run on its shapes).

    **Raises:**

    `MeshError` or `LayerConfigError`, with the numbers involved.
    """
    axes = layout.axes(num_devices)
    used = math.prod(axes.values())
    if used != num_devices:
        raise MeshError(
            f"layout {layout.spec!r} uses {used} devices but {num_devices} were asked for; "
            f"the product of the axis sizes must equal the number of devices."
        )
    if batch_size < 1 or seq_len < 1:
        raise LayerConfigError("the batch size and sequence length must be at least 1.")
    data = layout.data_parallel_size(num_devices)
    if batch_size % data:
        raise LayerConfigError(
            f"the batch of {batch_size} sequences does not split over the {data} ways the "
            f"layout {layout.spec!r} splits the batch; use a multiple of {data}."
        )
    micro = _num_microbatches(layout, num_devices)
    if (batch_size // data) % micro:
        raise LayerConfigError(
            f"the per-device batch of {batch_size // data} sequences does not divide into "
            f"{micro} pipeline micro-batches."
        )
    par = layout.parallelism(num_devices)
    check_context_split(par, seq_len)
    mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
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
    - `config`, `layout`, `batch_size`, `seq_len`: what was asked for.
    - `lower_seconds`: the time tracing and lowering took.
    """

    lowered: Any
    state: TrainState
    mesh: Mesh
    config: GPTConfig
    layout: Layout
    batch_size: int
    seq_len: int
    lower_seconds: float


def abstract_train_step(
    config: GPTConfig,
    layout: Layout,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: optax.GradientTransformation,
    clip_norm: float | None = None,
    devices: list | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> AbstractStep:
    """Lower the real GPT train step for `layout` without creating any array.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the `Layout`; its size must equal the number of `devices`.
    - `batch_size`, `seq_len`: the global batch in sequences, and their length.
    - `optimizer`: the optax optimizer (its state's shapes and specs, and its update,
      are part of the step).
    - `clip_norm`: the global-norm clipping threshold of `make_train_step` (`None`:
      no clipping).
    - `devices`: the devices of the mesh (default: all of JAX's devices).
    - `dtype`: the compute dtype: the loss casts the parameters to it, as
      `equishard train --dtype` does.
    - `param_dtype`: the dtype the parameters (and so the optimizer's moments) are stored
      in.

    **Returns:**

    An `AbstractStep`; `.lowered.compile()` compiles it.

    **Raises:**

    `MeshError` / `LayerConfigError` (see `check_gpt_layout`) before tracing.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_gpt_layout(config, layout, len(devices), batch_size, seq_len)
    start = time.perf_counter()
    mesh = layout.mesh(devices)
    par = layout.parallelism(len(devices))
    state = abstract_state(
        lambda: init_train_state(
            lambda k: cast_floating(GPT(config, par, key=k), param_dtype), optimizer,
            jax.random.key(0), mesh=mesh, zero=layout.zero_axes(len(devices)),
            zero_min_weight_size=par.fsdp_min_weight_size,
        ),
        mesh,
    )
    step = make_train_step(
        lambda model, batch, key: cast_floating(model, dtype).loss(batch, key),
        optimizer,
        mesh=mesh,
        batch_spec=layout.batch_spec(len(devices)),
        clip_norm=clip_norm,
        zero=layout.zero_axes(len(devices)),
        zero_min_weight_size=par.fsdp_min_weight_size,
    )
    sharding = NamedSharding(mesh, layout.batch_spec(len(devices)))
    batch: Any
    if par.context:  # inputs, labels and positions [B, S], split over cp too
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
        batch = {"inputs": tokens, "labels": tokens, "positions": tokens}
    else:
        batch = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=sharding)
    lowered = lower_from_shapes(step, state, batch)
    return AbstractStep(
        lowered, state, mesh, config, layout, batch_size, seq_len, time.perf_counter() - start
    )


def gpt_report(
    config: GPTConfig,
    layout: Layout,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: optax.GradientTransformation,
    clip_norm: float | None = None,
    devices: list | None = None,
    name: str | None = None,
    optimizer_name: str | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> tuple[StepReport, dict[str, float]]:
    """Compile the reference GPT's train step for `layout` and report on it.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the `Layout`.
    - `batch_size`, `seq_len`: the global batch in sequences, and their length.
    - `optimizer`, `clip_norm`: the optimizer and clipping norm of the step (see
      `abstract_train_step`).
    - `devices`: the devices of the mesh (default: all of JAX's devices).
    - `name`, `optimizer_name`: the model's and the optimizer's names for the
      description line.
    - `dtype`, `param_dtype`: the compute and parameter dtypes (see
      `abstract_train_step`).

    **Returns:**

    `(report, facts)`: the `StepReport` (collectives, memory, parameter table, the
    analytical minimum), and a dict with `lower_seconds`, `compile_seconds`,
    `state_bytes` (parameters and optimizer state per device by their specs: the
    analytical figure to set beside the compiler's argument bytes) and `parameters`.
    """
    step = abstract_train_step(
        config, layout, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer,
        clip_norm=clip_norm, devices=devices, dtype=dtype, param_dtype=param_dtype,
    )  # fmt: skip
    start = time.perf_counter()
    compiled = step.lowered.compile()
    compile_seconds = time.perf_counter() - start
    rows = param_table(step.state.model, step.mesh)
    minimum = gpt_minimum(
        config, layout, batch_size=batch_size, seq_len=seq_len,
        num_devices=step.mesh.devices.size, rows=rows,
    )  # fmt: skip
    parameters = sum(math.prod(r.shape) for r in rows)
    description = (
        f"{name or 'GPT'}: {parameters / 1e6:,.1f} M parameters"
        + (f" ({parameters / 1e9:.2f} B)" if parameters >= 1e9 else "")
        + f" (d_model {config.d_model}, "
        f"{config.n_layers} layers, {config.n_heads} heads"
        + (f" ({config.n_kv_heads} key/value)" if config.n_kv_heads not in (None, config.n_heads) else "")
        + f", d_ff {config.d_ff}, vocabulary "
        f"{config.vocab_size}); layout {layout.spec} on {step.mesh.devices.size} "
        f"{step.mesh.devices.flat[0].platform.upper()} devices; batch {batch_size} x "
        f"{seq_len} tokens; {jnp.dtype(dtype).name} compute, {jnp.dtype(param_dtype).name} "
        f"parameters"
    ) + (f"; {optimizer_name}" if optimizer_name else "")
    par = layout.parallelism(step.mesh.devices.size)
    weights = None
    if par.pipeline and par.pipeline_schedule not in (None, "gpipe", "circular"):
        # An explicit schedule's branches run as its table says (the last stage's device).
        table = pipeline_schedule(
            par.pipeline_schedule, par.num_stages, par.num_microbatches, repeats=par.pipeline_repeats
        )
        weights = schedule_weights(table)
        description += f"; {par.pipeline_schedule} schedule, collectives of the last stage's device"
    batch_bytes = batch_size // layout.data_parallel_size(step.mesh.devices.size) * (seq_len + 1) * 4
    estimate = gpt_memory(
        config, layout, batch_size=batch_size, seq_len=seq_len, params=rows,
        optimizer_state=param_table(step.state.opt_state, step.mesh),
        num_devices=step.mesh.devices.size, other_arguments=batch_bytes + 3 * 4 + 8,
    )  # fmt: skip
    r = report(
        compiled, mesh=step.mesh, params=rows, minimum=minimum, description=description,
        weights=weights, estimate=estimate,
    )  # fmt: skip
    facts = {
        "lower_seconds": step.lower_seconds,
        "compile_seconds": compile_seconds,
        "state_bytes": float(state_bytes(param_table((step.state.model, step.state.opt_state), step.mesh))),
        "parameters": float(parameters),
    }
    return r, facts
