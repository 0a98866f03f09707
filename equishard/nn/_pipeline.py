"""`PipelineModule`: a stack of layers split into pipeline stages over a stage axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import bound_axis_size, cast_varying, varying_axes
from .._errors import LayerConfigError
from .._names import CIRCULAR, GPIPE, differentiated_scan
from ..core import (
    PipelineSchedule,
    execute_circular_pipeline,
    execute_pipeline,
    execute_schedule,
    from_last_stage,
    pipeline_layer_order,
    pipeline_schedule,
)
from ..core._internal import check_stage_output, split_microbatches
from ..sharding import add_leading_axis, drop_leading_axis, plain_arrays
from ._fsdp import FSDP
from ._initializers import check_positive


class PipelineModule(eqx.Module):
    """`num_layers` layers run as a pipeline over the stage axis `model_axis_name`.

    `module_fn(key)` builds one layer (a block `block(x, *args, **kwargs) -> x'` with
    `x'` of the shape and dtype of `x`; it may hold `Sharded` boxes, e.g. tensor-parallel
    or FSDP layers, or plain arrays). The layers are built with keys
    `jax.random.split(key, num_layers)` (layer `l` equals `module_fn(keys[l])`: the
    unsharded model is these blocks applied in order) and stacked along a new leading
    axis with spec `P("pp", ...)`: each device of the stage axis holds its own layers.

    - GPipe (`repeats=1`): device `d` runs layers `[d L/S, (d + 1) L/S)` as one stage;
      the stack is the model's layers in order, so the global parameters do not depend
      on the number of stages.
    - Circular (`repeats=R > 1`): the model's `S R` stages of `L/(S R)` layers each are
      dealt round the devices; device `d` holds stages `d, d + S, ...`. The stack is in
      device-major order (`equishard.core.pipeline_layer_order`); `unstack` gives the
      layers in model order.

    `schedule` picks the order of the work (`equishard.core.pipeline_schedule`):
    `"gpipe"` and `"circular"` run as one differentiated scan (call the module, compute
    the loss from its output); `"1f1b"`, `"interleaved-1f1b"` and `"zb-h1"` run the
    backward themselves, micro-batch by micro-batch, so the loss is computed inside the
    pipeline: call `loss`, which takes the head (and optionally the embedding) as
    functions. `loss` works for every schedule, so the same code runs all five.

    With an explicit schedule, `FSDP` units among the layers are gathered once per step
    (`FSDP.gathered`), before the schedule runs, not by every micro-batch's call: each
    micro-batch's forward and backward run on the gathered layers, their gradients are
    summed over the micro-batches and reduce-scattered once, after the schedule. That
    saves `2 M - 1` all-gathers and `M - 1` reduce-scatters of every split array per
    step, and costs memory: this device's whole stage parameters (and their gradient
    sum) live for the step. See the pipeline guide (docs/guides/pipeline.md).

    Called in the local view, inside `equishard.filter_shard_map` over a mesh with the
    stage axis (the stack's `P("pp", ...)` specs place each device's layers). The output
    is the last stage's, zeros on the other stages: compute the loss from it and make
    it global with `equishard.core.from_last_stage(loss, model_axis_name)`.

    ```python
    pipe = es.sharded_init(
        lambda k: es.nn.PipelineModule(Block, "pp", 8, num_layers=16, num_stages=4, key=k),
        key, mesh=mesh,
    )

    @es.filter_shard_map(mesh=mesh, in_specs=(None, P("dp")), out_specs=P())
    def loss_fn(pipe, x):
        y = pipe(x)  # f32[B/dp, T, D] on the last stage, zeros elsewhere
        loss = jax.lax.pmean(jnp.mean(y**2), "dp")
        return es.core.from_last_stage(loss, "pp")
    ```

    **Arguments:**

    - `module_fn`: `module_fn(key) -> block`, builds one layer.
    - `model_axis_name`: the stage axis ("pp").
    - `num_microbatches`: micro-batches `M` per call; must divide the local batch, and be
      a multiple of `num_stages` when `repeats > 1`.
    - `num_layers`: `L`, divisible by `num_stages * repeats`.
    - `num_stages`: `S`, the size of the stage axis on the mesh it will run on.
    - `repeats`: local stages per device `R` (1: GPipe; more: circular schedule).
    - `schedule`: `"gpipe"`, `"circular"`, `"1f1b"`, `"interleaved-1f1b"` or `"zb-h1"`;
      `None` (default): `"gpipe"` for `R = 1`, `"circular"` for more.
    - `key`: PRNG key (keyword-only).

    **Raises:**

    `LayerConfigError` for `L` not divisible by `S R`, `M` not a multiple of `S`
    with `R > 1`, an unknown schedule or one that does not take `R`.
    """

    layers: PyTree
    model_axis_name: str = eqx.field(static=True)
    num_microbatches: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    num_stages: int = eqx.field(static=True)
    repeats: int = eqx.field(static=True)
    schedule: str = eqx.field(static=True)
    was_plain: tuple[bool, ...] = eqx.field(static=True, repr=False)

    def __init__(
        self,
        module_fn: Callable[[PRNGKeyArray], Any],
        model_axis_name: str,
        num_microbatches: int,
        *,
        num_layers: int,
        num_stages: int,
        repeats: int = 1,
        schedule: str | None = None,
        key: PRNGKeyArray,
    ):
        for what, value in (("num_stages", num_stages), ("repeats", repeats), ("num_microbatches", num_microbatches)):
            check_positive("PipelineModule", what, value)
        # Both validate: L against S R, and M against S when R > 1.
        order = np.asarray(pipeline_layer_order(num_layers, num_stages, repeats))
        if schedule is None:
            schedule = GPIPE if repeats == 1 else CIRCULAR
        pipeline_schedule(schedule, num_stages, num_microbatches, repeats=repeats)
        self.schedule = schedule
        self.model_axis_name = model_axis_name
        self.num_microbatches = num_microbatches
        self.num_layers = num_layers
        self.num_stages = num_stages
        self.repeats = repeats

        keys = jax.random.split(key, num_layers)
        stacked = eqx.filter_vmap(module_fn)(keys)  # every array gains a leading [L]
        if not np.array_equal(order, np.arange(num_layers)):
            stacked = jax.tree.map(lambda a: a[order] if eqx.is_array(a) else a, stacked)
        # Every array gets the stage axis in front of its spec: boxes keep their own
        # entries after it (and their class), plain arrays are boxed P("pp").
        self.was_plain = plain_arrays(stacked)
        self.layers = add_leading_axis(stacked, model_axis_name, box_arrays=True)

    @property
    def layers_per_stage(self) -> int:
        """Layers in one stage, `L / (S R)`."""
        return self.num_layers // (self.num_stages * self.repeats)

    def _layer(self, index: int) -> Any:
        """The layer at stored position `index` of the stack (global view)."""
        picked = jax.tree.map(lambda a: a[index] if eqx.is_array(a) else a, self.layers)
        return drop_leading_axis(picked, unbox=self.was_plain)

    def unstack(self) -> list[Any]:
        """The layers in model order, each as `module_fn` built it (global view).

        **Returns:**

        A list of `num_layers` blocks; block `l` equals `module_fn(jax.random.split(key,
        num_layers)[l])`, so running them in order is the unsharded model.
        """
        order = pipeline_layer_order(self.num_layers, self.num_stages, self.repeats)
        position = {layer: p for p, layer in enumerate(order)}
        return [self._layer(position[layer]) for layer in range(self.num_layers)]

    def __unbox__(self) -> eqx.nn.Sequential:
        """The layers in model order as an `eqx.nn.Sequential` (a one-device model), for
        `equishard.unbox`: `unbox(gather(pipe))(x)` is the unsharded model. Extra call
        arguments of the pipeline are not carried: call `unstack()`'s layers for those."""
        return eqx.nn.Sequential(self.unstack())

    def _check_axis(self) -> None:
        size = bound_axis_size(self.model_axis_name)
        if size is None:
            raise LayerConfigError(
                f"PipelineModule: the stage axis {self.model_axis_name!r} is not bound; "
                f"call the module inside `equishard.filter_shard_map` over a mesh with "
                f"that axis."
            )
        if size != self.num_stages:
            raise LayerConfigError(
                f"PipelineModule was built with num_stages={self.num_stages}, but the "
                f"stage axis {self.model_axis_name!r} has size {size}."
            )

    def _local_layers(self) -> tuple[PyTree, PyTree]:
        """This device's stacked layers `[R L', ...]`, split into (arrays, the rest)."""
        per = self.layers_per_stage
        local = self.repeats * per
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        heads = {a.shape[0] for a in jax.tree.leaves(dynamic)}
        if heads and heads != {local}:
            raise LayerConfigError(
                f"PipelineModule: expected this device's {local} layers "
                f"({self.repeats} stage(s) of {per}) but the stack has leading sizes "
                f"{sorted(heads)}; pass the module into `filter_shard_map` with its "
                f"carried specs (P({self.model_axis_name!r}, ...))."
            )
        return dynamic, static

    def _run_layers(self, stack: PyTree, static: PyTree, h: Array, *args: Any, **kwargs: Any) -> Array:
        """Run a stack of layers `[L', ...]` (arrays) in order on `h`."""

        def layer_step(h: Array, layer_dyn: PyTree) -> tuple[Array, None]:
            block = drop_leading_axis(eqx.combine(layer_dyn, static), unbox=self.was_plain)
            out = block(h, *args, **kwargs)
            check_stage_output(out, h, f"PipelineModule: the layer {type(block).__name__}")
            return out, None

        h, _ = jax.lax.scan(layer_step, h, stack)  # f32[B/M, ...] per stage
        return h

    @property
    def explicit(self) -> bool:
        """Whether the schedule runs its own backward (1F1B, interleaved 1F1B, ZB-H1)."""
        return not differentiated_scan(self.schedule)

    def table(self) -> PipelineSchedule:
        """The schedule's table (`equishard.core.pipeline_schedule`)."""
        return pipeline_schedule(
            self.schedule, self.num_stages, self.num_microbatches, repeats=self.repeats
        )

    def loss(
        self,
        inputs: PyTree,
        targets: PyTree,
        *,
        last: Callable[[PyTree, Array, PyTree], Array],
        last_params: PyTree = None,
        first: Callable[[PyTree, PyTree], Array] | None = None,
        first_params: PyTree = None,
        layer_args: tuple[Any, ...] = (),
    ) -> Array:
        """The mean loss of the pipeline's micro-batches, on every stage (local view).

        Micro-batch `m` enters as `first(first_params, inputs[m])` (or `inputs[m]`),
        runs through the layers and ends in `last(last_params, y, targets[m])`, its
        scalar loss; the result is the mean over micro-batches (equal to the loss of the
        whole local batch when `last` is a mean over equal micro-batches). With an
        explicit schedule (`1f1b`, `interleaved-1f1b`, `zb-h1`) `first` and `last` run
        per micro-batch inside the pipeline (`equishard.core.execute_schedule`); with
        `gpipe`/`circular` around it. Differentiable in the module, `first_params`,
        `last_params` and (without `first`) `inputs`. Make it global over data axes
        with `jax.lax.pmean` as usual; it is already the same on every stage.

        **Arguments:**

        - `inputs`: the local batch, a pytree of arrays `[B, ...]`.
        - `targets`: a pytree of arrays `[B, ...]` passed to `last`.
        - `last`: `last(last_params, y, targets_m) -> f32[]`, the head and loss.
        - `last_params`: its parameters (a pytree of arrays, or boxes).
        - `first`: `first(first_params, inputs_m) -> h`, e.g. the embedding; or `None`.
        - `first_params`: its parameters.
        - `layer_args`: extra arguments passed to every layer call unchanged, as
          `__call__`'s `*args` (not differentiated; the same for every micro-batch).

        **Returns:**

        `f32[]`, the same on every stage.
        """
        self._check_axis()
        m = self.num_microbatches
        if not self.explicit:
            h = inputs if first is None else first(first_params, inputs)
            y = self(h, *layer_args)  # f32[B, ...] on the last stage, zeros elsewhere
            what = "PipelineModule.loss"
            losses = jax.vmap(lambda y, t: last(last_params, y, t))(
                split_microbatches(y, m, what=what), split_microbatches(targets, m, what=what)
            )
            return from_last_stage(jnp.mean(losses), self.model_axis_name)
        dynamic, static = self._local_layers()
        # The layers vary like the batch and over the stages before any gather, so that
        # the gradients' sums over the data axes run on the split blocks, after the
        # reduce-scatters.
        batch_axes = (varying_axes(a) for a in jax.tree.leaves((inputs, targets)))
        dynamic = cast_varying(dynamic, frozenset({self.model_axis_name}).union(*batch_axes))
        # FSDP units are gathered here, once per step, not by each micro-batch's call:
        # the stages then run on this device's whole (over fsdp) layers, the schedule
        # sums their gradients over the micro-batches and the gathers' transposes
        # reduce-scatter the sums once, after the schedule.
        dynamic, static = eqx.partition(gather_fsdp_units(eqx.combine(dynamic, static)), eqx.is_array)
        per = self.layers_per_stage
        # f32[R L', ...] -> f32[R, L', ...]: local stage v is params[v].
        chunks = jax.tree.map(lambda a: a.reshape(self.repeats, per, *a.shape[1:]), dynamic)

        def stage(chunk: PyTree, h: Array) -> Array:
            return self._run_layers(chunk, static, h, *layer_args)

        stage.__name__ = "PipelineModule"
        return execute_schedule(
            stage, chunks, inputs, targets, last=last, last_params=last_params,
            first=first, first_params=first_params, schedule=self.table(),
            model_axis_name=self.model_axis_name,
        )  # fmt: skip

    def __call__(self, x: Array, *args: Any, **kwargs: Any) -> Array:
        """Run a GPipe or circular pipeline on this device's batch (local view, inside `shard_map`).

        **Arguments:**

        - `x`: `f32[B, ...]`, the local batch (read by stage 0); `B` divisible by
          `num_microbatches`.
        - `*args`, `**kwargs`: passed to every layer call unchanged.

        **Returns:**

        `f32[B, ...]`: the last stage's outputs on the last device of the stage axis,
        zeros on the others.

        **Raises:**

        `LayerConfigError` if the schedule is explicit (use `loss`), the stage axis is
        unbound or of another size than `num_stages`, the local stack is not this
        device's share (the module was not passed through `shard_map` with its specs),
        or the batch does not split.
        """
        if self.explicit:
            raise LayerConfigError(
                f"PipelineModule: the {self.schedule!r} schedule runs each micro-batch's "
                f"backward inside the pipeline, so it has no output to return; call "
                f"`pipe.loss(inputs, targets, last=head_and_loss, ...)` instead."
            )
        self._check_axis()
        per = self.layers_per_stage
        dynamic, static = self._local_layers()
        # Vary the layers like the batch once, before the schedule's loop: a parameter
        # replicated over a data axis then has its gradient summed over that axis by
        # one all-reduce after the backward loop, instead of one per pipeline step.
        dynamic = cast_varying(dynamic, varying_axes(x))

        def run_stage(rep: Array | int, h: Array) -> Array:
            # This device's local stage `rep`: f32[R L', ...] -> f32[L', ...] layers.
            if isinstance(rep, int):
                mine = jax.tree.map(lambda a: a[rep * per : (rep + 1) * per], dynamic)
            else:
                mine = jax.tree.map(
                    lambda a: jax.lax.dynamic_slice_in_dim(a, rep * per, per), dynamic
                )
            return self._run_layers(mine, static, h, *args, **kwargs)

        def gpipe_stage(h: Array) -> Array:
            return run_stage(0, h)

        gpipe_stage.__name__ = run_stage.__name__ = "PipelineModule"
        if self.repeats == 1:
            return execute_pipeline(
                gpipe_stage,
                x,
                num_microbatches=self.num_microbatches,
                model_axis_name=self.model_axis_name,
            )
        return execute_circular_pipeline(
            run_stage,
            x,
            num_microbatches=self.num_microbatches,
            repeats=self.repeats,
            model_axis_name=self.model_axis_name,
        )


def gather_fsdp_units(tree: PyTree) -> PyTree:
    """`tree` with every `FSDP` unit replaced by its wrapped module, parameters gathered.

    Each unit's split arrays are all-gathered once (`FSDP.gathered`), so the units'
    calls that follow gather nothing; their gradients are reduce-scattered once, by
    the gathers' transposes.
    """
    is_unit = lambda node: isinstance(node, FSDP)  # noqa: E731
    return jax.tree.map(lambda node: node.gathered() if is_unit(node) else node, tree, is_leaf=is_unit)
