"""One layout description for every parallelism: `"dp=2,fsdp=2,tp=2"` plus options.

The layout builds the mesh (with `make_mesh`, the same parser as the Python API) and
decides how a model uses it (a `Parallelism`): the batch is split over the data axes
(`dp`, `fsdp`, `ep`), parameters over `fsdp` (FSDP) and `tp` (tensor parallel), experts
over `ep`, layers over `pp` (pipeline); sequence parallelism runs over `tp`. The model
code does not change between layouts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from .._errors import MeshError
from ._fsdp import DEFAULT_MIN_WEIGHT_SIZE
from ._mesh import make_mesh, parse_layout

AXES = ("dp", "fsdp", "cp", "tp", "ep", "pp")
"""The axis names a layout may use: data, fully-sharded data, context, tensor, expert, pipeline."""

CP_IMPLS = ("ring", "alltoall")
"""The context-parallel attention implementations (`Layout.cp_impl`)."""

DATA_AXES = ("dp", "fsdp", "ep")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Which mesh axes a model uses, and how: decided by the layout, not the model.

    **Fields:**

    - `axes`: every axis of the mesh, in order; `sizes`: their sizes.
    - `data_axes`: the axes the batch is split over (data, FSDP and expert axes).
    - `tensor`: the tensor-parallel axis, or `None`.
    - `fsdp`: the axis parameters are fully sharded over, or `None`.
    - `expert`: the expert axis, or `None`.
    - `pipeline`: the stage axis, or `None`; with `num_stages`, `num_microbatches`,
      `pipeline_repeats` (local stages per device) and `pipeline_schedule` (`None`:
      GPipe for one local stage, circular for more; or a name from
      `equishard.core.SCHEDULES`).
    - `sequence_parallel`: split activations over the sequence on the tensor axis.
    - `fsdp_min_weight_size`: smaller arrays stay replicated under FSDP.
    - `context`: the context-parallel axis the sequence is split over (zigzag order),
      or `None`; `context_impl`: its attention, `"ring"` or `"alltoall"`. The sequence
      splits over `context` first and, with `sequence_parallel`, each part over the
      tensor axis (cp outer, tp inner). See the "Long sequences" guide.
    """

    axes: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    data_axes: tuple[str, ...] = ()
    tensor: str | None = None
    fsdp: str | None = None
    expert: str | None = None
    pipeline: str | None = None
    num_stages: int = 1
    num_microbatches: int = 1
    pipeline_repeats: int = 1
    pipeline_schedule: str | None = None
    sequence_parallel: bool = False
    fsdp_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE
    context: str | None = None
    context_impl: str = "ring"

    def size(self, axis: str | None) -> int:
        """The size of `axis` (1 if absent)."""
        return dict(zip(self.axes, self.sizes)).get(axis, 1) if axis else 1



@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: mesh axes and the options that go with them.

    **Fields:**

    - `spec`: the axes, e.g. `"dp=2,fsdp=2,tp=2"` (names from `AXES`; one size may be
      -1 to fill the devices).
    - `sequence_parallel`: split activations over the sequence on `tp` between
      sub-layers (Megatron sequence parallelism).
    - `num_microbatches`: micro-batches per step with a `pp` axis (default: the number
      of stages).
    - `pipeline_repeats`: stages per device with `pp` (1: GPipe; more: circular).
    - `pipeline_schedule`: the pipeline schedule with `pp`: `"gpipe"`, `"circular"`,
      `"1f1b"`, `"interleaved-1f1b"` or `"zb-h1"` (`None`: GPipe, or circular with
      `pipeline_repeats > 1`).
    - `fsdp_min_weight_size`: arrays smaller than this stay replicated under `fsdp`.
    - `cp_impl`: the attention over a `cp` axis: `"ring"` (ring attention) or
      `"alltoall"` (Ulysses; needs the heads per tensor shard divisible by cp).
    - `zero`: optimizer-state sharding over `dp` (ZeRO-1): the parameters stay
      replicated over `dp`, the optimizer state's arrays are split over it (arrays below
      `fsdp_min_weight_size` stay replicated), the gradients are reduce-scattered and
      the updated parameters all-gathered once per step. See the training guide.
    """

    spec: str
    sequence_parallel: bool = False
    num_microbatches: int | None = None
    pipeline_repeats: int = 1
    pipeline_schedule: str | None = None
    fsdp_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE
    cp_impl: str = "ring"
    zero: bool = False

    def axes(self, num_devices: int | None = None) -> dict[str, int]:
        """The axes and their sizes, validated (see `parse_layout`)."""
        axes = parse_layout(self.spec, num_devices)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise MeshError(
                f"layout {self.spec!r}: unknown axis {unknown[0]!r}; a layout uses the axes "
                f"{', '.join(AXES)} (data, fully-sharded data, context, tensor, expert, "
                f"pipeline)."
            )
        if self.cp_impl not in CP_IMPLS:
            raise MeshError(
                f"layout {self.spec!r}: cp_impl (--cp-impl) {self.cp_impl!r} is not one of "
                f"{', '.join(CP_IMPLS)}."
            )
        if self.sequence_parallel and "tp" not in axes:
            raise MeshError(f"layout {self.spec!r}: sequence parallelism needs a 'tp' axis.")
        if self.zero and axes.get("dp", 1) < 2:
            raise MeshError(
                f"layout {self.spec!r}: zero (--zero) splits the optimizer state over the "
                f"'dp' axis, which this layout lacks (or has of size 1); under 'fsdp' the "
                f"optimizer state is already split like the parameters."
            )
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise MeshError(
                f"layout {self.spec!r}: num_microbatches (--microbatches) must be at least 1, "
                f"got {self.num_microbatches}."
            )
        if self.pipeline_repeats < 1:
            raise MeshError(
                f"layout {self.spec!r}: pipeline_repeats (--pipeline-repeats) must be at least "
                f"1, got {self.pipeline_repeats}."
            )
        return axes

    def mesh(self, devices: list | None = None) -> Mesh:
        """The device mesh (the first devices of `devices`, default all)."""
        devices = list(jax.devices() if devices is None else devices)
        axes = self.axes(len(devices))
        return make_mesh(axes, devices=devices[: math.prod(axes.values())])

    def parallelism(self, num_devices: int | None = None) -> Parallelism:
        """How a model uses the mesh of this layout."""
        axes = self.axes(num_devices)
        pp = axes.get("pp")
        return Parallelism(
            axes=tuple(axes),
            sizes=tuple(axes.values()),
            data_axes=tuple(a for a in axes if a in DATA_AXES),
            tensor="tp" if "tp" in axes else None,
            fsdp="fsdp" if "fsdp" in axes else None,
            expert="ep" if "ep" in axes else None,
            pipeline="pp" if pp else None,
            num_stages=pp or 1,
            num_microbatches=(self.num_microbatches or pp or 1) if pp else 1,
            pipeline_repeats=self.pipeline_repeats,
            pipeline_schedule=self.pipeline_schedule,
            sequence_parallel=self.sequence_parallel,
            fsdp_min_weight_size=self.fsdp_min_weight_size,
            context="cp" if "cp" in axes else None,
            context_impl=self.cp_impl,
        )

    def zero_axes(self, num_devices: int | None = None) -> str | None:
        """The axis the optimizer state is split over under `zero` (`"dp"`), or `None`:
        the `zero=` of `init_train_state` and `make_train_step` (the model does not
        change with it)."""
        self.axes(num_devices)  # validated
        return "dp" if self.zero else None

    def batch_spec(self, num_devices: int | None = None) -> P:
        """The spec of a global batch `[B, ...]`: split over the data axes.

        With a `cp` axis the batch's arrays are `[B, S]` (inputs, labels, positions)
        and the sequence dimension is split over `cp` too: `P(data, "cp")`.
        """
        par = self.parallelism(num_devices)
        data = par.data_axes or None
        if par.context:
            return P(data, par.context)
        return P(data) if data else P()

    def data_parallel_size(self, num_devices: int | None = None) -> int:
        """How many ways the batch is split."""
        axes = self.axes(num_devices)
        return math.prod(axes[a] for a in axes if a in DATA_AXES)


def layout_from_options(options: Any) -> Layout:
    """The `Layout` that the train, inspect and plan commands' options name: an object
    with the attributes `layout`, `sequence_parallel`, `microbatches`,
    `pipeline_repeats`, `pipeline_schedule`, `cp_impl` and `zero` (parsed flags, or the
    application's run configuration)."""
    return Layout(
        options.layout,
        sequence_parallel=options.sequence_parallel,
        num_microbatches=options.microbatches,
        pipeline_repeats=options.pipeline_repeats,
        pipeline_schedule=options.pipeline_schedule,
        cp_impl=options.cp_impl,
        zero=options.zero,
    )
