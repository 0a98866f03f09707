"""Pipeline parallelism: micro-batched schedules over a stage axis, valid inside `shard_map`.

Each device of the stage axis (`model_axis_name`, "pp" by convention) runs one stage;
activations move on to the next device with `ring_shift` (one collective-permute per
step but the last, whose output stays on the last stage). A stage is any callable from
an activation to an activation of the same shape and dtype: core has no modules.

Two schedules, both a single `jax.lax.scan` (and the last step after it) whose length
does not depend on how the stage is written, so compile time is independent of the
number of micro-batches:

- **GPipe** (`execute_pipeline`): `M` micro-batches flow through `S` stages in
  `M + S - 1` steps; the bubble fraction is `(S - 1) / (M + S - 1)`.
- **Circular / interleaved** (`execute_circular_pipeline`): each device holds `R`
  non-adjacent stages (device `d` holds global stages `d, d + S, ..., d + (R - 1) S`)
  and every micro-batch goes round the ring `R` times. Micro-batches enter in groups of
  `S`, so the activation leaving the last device is consumed by the first device on
  the very next step (no buffering); `M` must be a multiple of `S`. `R M + S - 1` steps;
  bubble fraction `(S - 1) / (R M + S - 1)`.

In SPMD no device is ever idle: in a bubble step a device computes on stale data whose
result is never used. The bubble is therefore not measured but read off the schedule
(`pipeline_schedule`, `schedule_report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._axes import bound_axis_size, cast_varying, varying_axes
from .._errors import LayerConfigError
from .._names import CIRCULAR, GPIPE
from ._collectives import ring_shift
from ._microbatch import split_microbatches
from ._schedule import FORWARD, pipeline_schedule

# ----------------------------------------------------------------------------------------
# GPipe and circular: the forward half of their tables, run as one differentiated scan.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ForwardTable:
    """Which micro-batch (and local stage) each device's forward works on at each step."""

    num_stages: int
    num_microbatches: int
    repeats: int
    microbatch: np.ndarray  # int32[K, S], -1 in a bubble
    repeat: np.ndarray  # int32[K, S], -1 in a bubble

    @property
    def num_steps(self) -> int:
        return int(self.microbatch.shape[0])


def _forward_table(name: str, num_stages: int, num_microbatches: int, repeats: int) -> _ForwardTable:
    """The forward steps of a GPipe or circular `pipeline_schedule`: `R M + S - 1` of them."""
    table = pipeline_schedule(name, num_stages, num_microbatches, repeats=repeats)
    forward = table.op == FORWARD
    steps = int(np.max(np.nonzero(forward.any(axis=1))[0])) + 1
    microbatch = np.where(forward, table.microbatch, -1)[:steps]
    repeat = np.where(forward, table.virtual, -1)[:steps]
    return _ForwardTable(num_stages, num_microbatches, repeats, microbatch, repeat)


def _layers_per_stage(num_layers: int, num_stages: int, repeats: int) -> int:
    if num_layers < 1 or num_layers % (num_stages * repeats):
        raise LayerConfigError(
            f"pipeline: num_layers={num_layers} is not divisible by num_stages * repeats "
            f"= {num_stages} * {repeats} = {num_stages * repeats}; every stage must hold "
            f"the same number of layers."
        )
    return num_layers // (num_stages * repeats)


def pipeline_layer_order(num_layers: int, num_stages: int, repeats: int = 1) -> tuple[int, ...]:
    """Which model layer each position of a device-major layer stack holds.

    A pipeline stores its `L` layers stacked along one axis split over the `S` stage
    devices: device `d` holds positions `[d R L', (d + 1) R L')`, `L' = L / (S R)`,
    that is its `R` local stages of `L'` layers each, local stage `r` being global stage
    `r S + d`. Position `d R L' + r L' + j` therefore holds model layer
    `(r S + d) L' + j`. With `repeats=1` this is the identity: a GPipe stack is the
    model's layers in order, whatever `S`.

    **Arguments:**

    - `num_layers`: `L`, divisible by `num_stages * repeats`.
    - `num_stages`: `S`.
    - `repeats`: `R`.

    **Returns:**

    A tuple of `L` model-layer indices, one per stored position.

    **Raises:**

    `LayerConfigError` if `L` is not divisible by `S R`.
    """
    per = _layers_per_stage(num_layers, num_stages, repeats)
    return tuple(
        (r * num_stages + d) * per + j
        for d in range(num_stages)
        for r in range(repeats)
        for j in range(per)
    )


# ----------------------------------------------------------------------------------------
# Execution.
# ----------------------------------------------------------------------------------------


def check_stage_output(out: Any, x: Array, what: str) -> None:
    """Raise a `LayerConfigError` naming `what` unless `out` has the shape and dtype of `x`."""
    if not hasattr(out, "shape") or tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        got = (
            f"{out.dtype}{list(out.shape)}" if hasattr(out, "shape") else type(out).__name__
        )
        raise LayerConfigError(
            f"{what} returned {got} for an input "
            f"{x.dtype}{list(x.shape)}; a pipeline stage must return an activation of "
            f"the same shape and dtype as its input (it is sent on to the next stage)."
        )


def _stage_name(module: Callable) -> str:
    return getattr(module, "__name__", type(module).__name__)


def execute_pipeline_step(
    module: Callable[..., Array],
    state: Array,
    input: Array,
    *args: Any,
    model_axis_name: str,
    **kwargs: Any,
) -> tuple[Array, Array]:
    """One micro-batch step of a pipeline, run by every stage at once.

    Stage 0 feeds `input` to its stage, every other stage the `state` it received from
    the previous stage; the output moves on to the next stage by a ring shift along
    `model_axis_name` (one collective-permute).

    **Arguments:**

    - `module`: the stage, any callable `module(x, *args, **kwargs) -> y` with `y` of
      the shape and dtype of `x`.
    - `state`: `f32[b, ...]`, the activation received from the previous stage.
    - `input`: `f32[b, ...]`, the micro-batch entering the pipeline (used by stage 0).
    - `*args`, `**kwargs`: passed to `module` unchanged.
    - `model_axis_name`: the stage axis of the enclosing `shard_map`.

    **Returns:**

    `(new_state, output)`: the output of the previous stage as received by this one,
    and — as in xLSTM-JAX — the stage's output on the last stage, zeros on every other
    stage.

    **Raises:**

    `LayerConfigError` if the stage changes the activation's shape or dtype.
    """
    num_stages = _num_stages(model_axis_name)
    stage = jax.lax.axis_index(model_axis_name)
    x = jnp.where(stage == 0, input, state)  # f32[b, ...] per stage
    out = module(x, *args, **kwargs)
    check_stage_output(out, x, f"pipeline: the stage {_stage_name(module)}")
    output = jnp.where(stage == num_stages - 1, out, jnp.zeros_like(out))  # last stage only
    new_state = ring_shift(out, model_axis_name, offset=1)  # stage i -> stage i + 1
    return new_state, output


def _num_stages(model_axis_name: str) -> int:
    size = bound_axis_size(model_axis_name)
    if size is None:
        raise LayerConfigError(
            f"pipeline: the stage axis {model_axis_name!r} is not bound; run the pipeline "
            f"inside `equishard.filter_shard_map` (or `jax.shard_map`) over a mesh with "
            f"that axis."
        )
    return size


def _run_schedule(
    call: Callable[[Array, Array], Array],
    x: Array,
    schedule: _ForwardTable,
    model_axis_name: str,
    what: str,
) -> Array:
    """Run `call(repeat, x_mb)` over `schedule`; the last stage's outputs, zeros elsewhere."""
    s, m, r = schedule.num_stages, schedule.num_microbatches, schedule.repeats
    hint = f"the stage axis has size {s}; the batch per device must be divisible by {{name}}."
    inputs = split_microbatches(x, m, what=what, hint=hint)  # f32[M, b, ...], b = B/M
    mb_shape = inputs.shape[1:]

    # The carries vary over what the stage output varies over: find it by tracing once.
    axes = varying_axes(x) | {model_axis_name}
    probe = lambda: call(jnp.int32(0), cast_varying(jnp.zeros(mb_shape, x.dtype), axes))  # noqa: E731
    out_aval = jax.eval_shape(probe)
    check_stage_output(out_aval, inputs[0], f"pipeline: the stage {what}")
    axes = axes | varying_axes(out_aval)
    # Varying over the stage axis once, outside the loop: if `x` carries a gradient
    # (an embedding replicated over the stages), its cotangent is summed over the
    # stage axis by one all-reduce after the backward loop, not one per step.
    inputs = cast_varying(inputs, frozenset({model_axis_name}))
    state0 = cast_varying(jnp.zeros(mb_shape, x.dtype), axes)  # f32[b, ...]
    outputs0 = cast_varying(jnp.zeros(inputs.shape, x.dtype), axes)  # f32[M, b, ...]

    stage = jax.lax.axis_index(model_axis_name)
    tables = (jnp.asarray(schedule.microbatch), jnp.asarray(schedule.repeat))  # i32[K, S]

    def work(state: Array, outputs: Array, mb_row: Array, rep_row: Array) -> tuple[Array, Array]:
        """One step's stage call (`mb_row`, `rep_row`: i32[S], what each device does)."""
        rep = jnp.maximum(rep_row[stage], 0)
        # Stage 0 takes a fresh micro-batch on its first repeat, else what came round.
        fresh = jax.lax.dynamic_index_in_dim(inputs, jnp.maximum(mb_row[0], 0), keepdims=False)
        x = jnp.where((stage == 0) & (rep == 0), fresh, state)  # f32[b, ...]
        out = call(rep, x)
        check_stage_output(out, x, f"pipeline: the stage {what}")
        # The last stage on its last repeat finishes micro-batch mb_row[S - 1].
        done = (stage == s - 1) & (rep_row[stage] == r - 1)
        slot = jnp.maximum(mb_row[s - 1], 0)
        kept = jax.lax.dynamic_index_in_dim(outputs, slot, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(
            outputs, jnp.where(done, out, kept), slot, 0
        )
        return out, outputs

    def step(carry: tuple[Array, Array], row: tuple[Array, Array]) -> tuple[tuple[Array, Array], None]:
        state, outputs = carry
        out, outputs = work(state, outputs, *row)
        state = ring_shift(out, model_axis_name, offset=1)  # stage i -> stage i + 1
        return (cast_varying(state, axes), outputs), None

    # All steps but the last send their output on; the last step's output is only the
    # last stage's result, so it is run outside the loop and sends nothing: K - 1
    # transfers, forward and backward, instead of K.
    head = jax.tree.map(lambda t: t[:-1], tables)
    (state, outputs), _ = jax.lax.scan(step, (state0, outputs0), head)
    _, outputs = work(state, outputs, tables[0][-1], tables[1][-1])
    return outputs.reshape(x.shape)  # f32[B, ...] on the last stage, zeros elsewhere


def execute_pipeline(
    module: Callable[..., Array],
    x: Array,
    *args: Any,
    num_microbatches: int,
    model_axis_name: str,
    **kwargs: Any,
) -> Array:
    """Run a GPipe pipeline of stages on a batch (inside `shard_map`).

    The batch is split into `num_microbatches` micro-batches that flow through the
    `S` stages of `model_axis_name` in `num_microbatches + S - 1` steps of one
    `jax.lax.scan`. Differentiate through it as through any function: the transposed
    ring shifts carry the cotangents back.

    **Arguments:**

    - `module`: this device's stage, any callable `module(x, *args, **kwargs) -> y`
      with `y` of the shape and dtype of `x`.
    - `x`: `f32[B, ...]`, the local batch. Only stage 0 reads it (it may be replicated
      over the stage axis or not).
    - `*args`, `**kwargs`: passed to every stage call unchanged (not split into
      micro-batches).
    - `num_microbatches`: `M`, which must divide `B`.
    - `model_axis_name`: the stage axis of the enclosing `shard_map`.

    **Returns:**

    `f32[B, ...]`: the last stage's outputs; zeros on every other stage. To turn a
    loss computed from it into one that every stage agrees on (and that gives correct
    gradients), use `from_last_stage(loss, model_axis_name)`.

    **Raises:**

    `LayerConfigError` if `B` is not divisible by `M` or the stage changes the
    activation's shape or dtype.
    """
    num_stages = _num_stages(model_axis_name)
    schedule = _forward_table(GPIPE, num_stages, num_microbatches, 1)

    def call(rep: Array, h: Array) -> Array:
        del rep
        return module(h, *args, **kwargs)

    return _run_schedule(call, x, schedule, model_axis_name, f"execute_pipeline({_stage_name(module)})")


def execute_circular_pipeline(
    module: Callable[..., Array],
    x: Array,
    *args: Any,
    num_microbatches: int,
    repeats: int,
    model_axis_name: str,
    **kwargs: Any,
) -> Array:
    """Run a circular (interleaved) pipeline on a batch (inside `shard_map`).

    Device `d` of the `S` devices of `model_axis_name` holds `repeats` stages: global
    stages `d, d + S, ..., d + (repeats - 1) S`. Micro-batches go round the ring
    `repeats` times, in groups of `S`, in `repeats * num_microbatches + S - 1` steps of
    one `jax.lax.scan`; the bubble shrinks to `(S - 1) / (repeats M + S - 1)`.

    **Arguments:**

    - `module`: this device's stages, a callable `module(repeat, x, *args, **kwargs)
      -> y` that runs local stage `repeat` (an `int32` scalar, traced; global stage
      `repeat * S + d`) with `y` of the shape and dtype of `x`.
    - `x`: `f32[B, ...]`, the local batch (read by device 0).
    - `*args`, `**kwargs`: passed to every stage call unchanged.
    - `num_microbatches`: `M`, a multiple of `S` that divides `B`.
    - `repeats`: local stages per device, `R`.
    - `model_axis_name`: the stage axis of the enclosing `shard_map`.

    **Returns:**

    `f32[B, ...]`: the outputs of the last global stage on device `S - 1`; zeros on
    every other device.

    **Raises:**

    `LayerConfigError` if `M` is not a multiple of `S`, `B` is not divisible by `M`,
    or the stage changes the activation's shape or dtype.
    """
    num_stages = _num_stages(model_axis_name)
    schedule = _forward_table(CIRCULAR, num_stages, num_microbatches, repeats)

    def call(rep: Array, h: Array) -> Array:
        return module(rep, h, *args, **kwargs)

    return _run_schedule(
        call, x, schedule, model_axis_name, f"execute_circular_pipeline({_stage_name(module)})"
    )


def from_last_stage(x: Array, model_axis_name: str) -> Array:
    """The last stage's value of `x` on every stage (invariant over the stage axis).

    `psum` over the stage axis of `x` masked to the last stage. Apply it to a scalar
    loss computed from a pipeline's output: the other stages' (meaningless) values
    drop out, the result is the global loss that equishard's gradient convention
    differentiates, and the cotangent reaches only the last stage. One all-reduce of
    `x`'s size, so apply it to the loss, not to activations.

    **Arguments:**

    - `x`: any array, e.g. `f32[]` loss.
    - `model_axis_name`: the stage axis of the enclosing `shard_map`.

    **Returns:**

    The last stage's `x`, the same on every stage.
    """
    num_stages = _num_stages(model_axis_name)
    last = jax.lax.axis_index(model_axis_name) == num_stages - 1
    return jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), model_axis_name)
