"""One layout description for every parallelism: `"dp=2,fsdp=2,tp=2"` plus options.

A `Layout` is what was asked for (the command line's `--layout` and its options, or the
Python API's arguments), in the user's own axis names: each mesh axis plays a role (data,
fsdp, context, tensor, expert, pipeline), the conventional names `dp`, `fsdp`, `cp`, `tp`,
`ep`, `pp` by default and any others through `roles` (as Haliax maps logical axes to the
mesh's once). `Layout.resolve` parses and validates it once, for a number of
devices, into a `ResolvedLayout`: the axes and their sizes, how a model uses them (a
`Parallelism`: the batch is split over the data axes `dp`, `fsdp`, `ep`, parameters over
`fsdp` (FSDP) and `tp` (tensor parallel), experts over `ep`, layers over `pp`
(pipeline); sequence parallelism runs over `tp`), the batch's spec and the optimizer
state's split. Every consumer — the command line, the application, the report, the
GPT — reads that one object; the model code does not change between layouts.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
from jax.sharding import Mesh, PartitionSpec as P

from .._errors import MeshError
from .._names import CONTEXT_IMPLS, RING
from ._fsdp import DEFAULT_MIN_WEIGHT_SIZE
from ._mesh import make_mesh, parse_layout

AXES = ("dp", "fsdp", "cp", "tp", "ep", "pp")
"""The conventional axis names: data, fully-sharded data, context, tensor, expert, pipeline."""

ROLES = ("data", "fsdp", "context", "tensor", "expert", "pipeline")
"""What a mesh axis can do in a layout (`Layout.roles` maps axis names to these)."""

DEFAULT_ROLES: dict[str, str] = dict(zip(AXES, ROLES))
"""The role of each conventional axis name (`dp` data, `fsdp` fsdp, `cp` context, ...)."""

DATA_ROLES = ("data", "fsdp", "expert")
"""The roles whose axes the batch is split over: data, fully-sharded data, expert."""


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
    context_impl: str = RING

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
    - `zero`: optimizer-state sharding over the data axis (ZeRO-1): the parameters stay
      replicated over it, the optimizer state's arrays are split over it (arrays below
      `fsdp_min_weight_size` stay replicated), the gradients are reduce-scattered and
      the updated parameters all-gathered once per step. See the training guide.
    - `roles`: the role of each mesh axis whose name is not a conventional one, e.g.
      `{"replica": "data", "shard": "fsdp", "model": "tensor"}` for the spec
      `"replica=2,shard=2,model=2"` (roles from `ROLES`; the conventional names `AXES`
      keep their own roles unless named here). Each role is played by one axis at most.

    `resolve` parses and validates the layout once; the other methods are shorthands
    for one field of it (each resolves anew: a program that reads several resolves once
    and keeps the `ResolvedLayout`).
    """

    spec: str
    sequence_parallel: bool = False
    num_microbatches: int | None = None
    pipeline_repeats: int = 1
    pipeline_schedule: str | None = None
    fsdp_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE
    cp_impl: str = RING
    zero: bool = False
    roles: tuple[tuple[str, str], ...] | dict[str, str] = ()

    def __post_init__(self) -> None:
        # Hashable and order-free, however it was given.
        object.__setattr__(self, "roles", tuple(sorted(dict(self.roles).items())))

    def conventional(self) -> "Layout":
        """This layout with its axes renamed to the conventional names of their roles
        (`replica=2,model=4` with roles data and tensor: `dp=2,tp=4`), for readers that
        speak the conventional names (the GPT's analytical minimum)."""
        names = {role: axis for axis, role in DEFAULT_ROLES.items()}
        roles = self.role_of()
        parts = []
        for part in self.spec.split(","):
            axis, sep, size = part.partition("=")
            role = roles.get(axis.strip())
            parts.append(f"{names[role]}={size}" if sep and role in names else part)
        return dataclasses.replace(self, spec=",".join(parts), roles=())

    def role_of(self) -> dict[str, str]:
        """Each axis name's role, from `roles` over the defaults (unchecked)."""
        given = dict(self.roles)
        return {**DEFAULT_ROLES, **given}

    def resolve(self, num_devices: int | None = None) -> ResolvedLayout:
        """Parse and validate the layout for `num_devices` devices (default: all of
        JAX's): the one place a layout is checked.

        **Returns:**

        The `ResolvedLayout`.

        **Raises:**

        `MeshError` naming the layout and the option at fault: a malformed or unknown
        axis (see `parse_layout`), an unknown `cp_impl`, sequence parallelism without
        `tp`, `zero` without a `dp` axis of size 2 or more, micro-batches or pipeline
        repeats below 1.
        """
        axes = parse_layout(self.spec, num_devices)
        named = self._check(axes)  # role -> the axis playing it
        pipeline = named.get("pipeline")
        pp = axes[pipeline] if pipeline else None
        role_of_axis = {axis: role for role, axis in named.items()}  # every axis has one (checked)
        data_axes = tuple(a for a in axes if role_of_axis[a] in DATA_ROLES)
        parallelism = Parallelism(
            axes=tuple(axes),
            sizes=tuple(axes.values()),
            data_axes=data_axes,
            tensor=named.get("tensor"),
            fsdp=named.get("fsdp"),
            expert=named.get("expert"),
            pipeline=pipeline,
            num_stages=pp or 1,
            num_microbatches=(self.num_microbatches or pp or 1) if pp else 1,
            pipeline_repeats=self.pipeline_repeats,
            pipeline_schedule=self.pipeline_schedule,
            sequence_parallel=self.sequence_parallel,
            fsdp_min_weight_size=self.fsdp_min_weight_size,
            context=named.get("context"),
            context_impl=self.cp_impl,
        )
        data = data_axes or None
        return ResolvedLayout(
            layout=self,
            parallelism=parallelism,
            zero=named.get("data") if self.zero else None,
            batch_spec=P(data, parallelism.context) if parallelism.context else P(data) if data else P(),
            data_parallel_size=math.prod(axes[a] for a in data_axes),
        )

    def _check(self, axes: dict[str, int]) -> dict[str, str]:
        """The options against the parsed axes (see `resolve`); each role's axis."""
        roles = self.role_of()
        bad = [(a, r) for a, r in dict(self.roles).items() if r not in ROLES]
        if bad:
            raise MeshError(
                f"layout {self.spec!r}: roles gives the axis {bad[0][0]!r} the role "
                f"{bad[0][1]!r}; the roles are {', '.join(ROLES)}."
            )
        unknown = [a for a in axes if a not in roles]
        if unknown:
            raise MeshError(
                f"layout {self.spec!r}: the axis {unknown[0]!r} has no role; a layout uses "
                f"the axes {', '.join(AXES)} (data, fully-sharded data, context, tensor, "
                f"expert, pipeline), or others given a role by Layout(roles={{{unknown[0]!r}: "
                f"'data'}}) (roles: {', '.join(ROLES)})."
            )
        named: dict[str, str] = {}
        for axis in axes:
            if roles[axis] in named:
                raise MeshError(
                    f"layout {self.spec!r}: the axes {named[roles[axis]]!r} and {axis!r} both "
                    f"play the role {roles[axis]!r}; one axis per role."
                )
            named[roles[axis]] = axis
        self._check_options(axes, named)
        return named

    def _check_options(self, axes: dict[str, int], named: dict[str, str]) -> None:
        """The options against the axes that play their roles (see `resolve`)."""
        if self.cp_impl not in CONTEXT_IMPLS:
            raise MeshError(
                f"layout {self.spec!r}: cp_impl (--cp-impl) {self.cp_impl!r} is not one of "
                f"{', '.join(CONTEXT_IMPLS)}."
            )
        if self.sequence_parallel and "tensor" not in named:
            raise MeshError(f"layout {self.spec!r}: sequence parallelism needs a tensor axis ('tp').")
        if self.zero and axes.get(named.get("data", ""), 1) < 2:
            raise MeshError(
                f"layout {self.spec!r}: zero (--zero) splits the optimizer state over the "
                f"data axis ('dp'), which this layout lacks (or has of size 1); under fsdp the "
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

    def axes(self, num_devices: int | None = None) -> dict[str, int]:
        """The axes and their sizes, validated: `resolve(num_devices).axes`."""
        return self.resolve(num_devices).axes

    def mesh(self, devices: list | None = None) -> Mesh:
        """The device mesh (the first devices of `devices`, default all):
        `resolve(len(devices)).mesh(devices)`."""
        devices = list(jax.devices() if devices is None else devices)
        return self.resolve(len(devices)).mesh(devices)

    def parallelism(self, num_devices: int | None = None) -> Parallelism:
        """How a model uses the mesh of this layout: `resolve(num_devices).parallelism`."""
        return self.resolve(num_devices).parallelism

    def zero_axes(self, num_devices: int | None = None) -> str | None:
        """The axis the optimizer state is split over under `zero` (`"dp"`), or `None`:
        `resolve(num_devices).zero`, the `zero=` of `init_train_state` and
        `make_train_step` (the model does not change with it)."""
        return self.resolve(num_devices).zero

    def batch_spec(self, num_devices: int | None = None) -> P:
        """The spec of a global batch `[B, ...]`: `resolve(num_devices).batch_spec`."""
        return self.resolve(num_devices).batch_spec

    def data_parallel_size(self, num_devices: int | None = None) -> int:
        """How many ways the batch is split: `resolve(num_devices).data_parallel_size`."""
        return self.resolve(num_devices).data_parallel_size


@dataclasses.dataclass(frozen=True)
class ResolvedLayout:
    """A `Layout` parsed and validated for a number of devices (`Layout.resolve`): what
    the command line, the application, the report and the model read.

    **Fields:**

    - `layout`: the `Layout` it was resolved from (its `spec` names it in messages).
    - `parallelism`: how a model uses the mesh (the `Parallelism` a model is built with).
    - `zero`: the axis the optimizer state is split over (`"dp"` under `Layout.zero`),
      or `None`: the `zero=` of `init_train_state` and `make_train_step`.
    - `batch_spec`: the spec of a global batch `[B, ...]`, split over the data axes;
      with a `cp` axis the batch's arrays are `[B, S]` (inputs, labels, positions) and
      the sequence is split over `cp` too: `P(data, "cp")`.
    - `data_parallel_size`: how many ways the batch is split.
    """

    layout: Layout
    parallelism: Parallelism
    zero: str | None
    batch_spec: P
    data_parallel_size: int

    @property
    def spec(self) -> str:
        """The layout as it was written (`Layout.spec`)."""
        return self.layout.spec

    @property
    def axes(self) -> dict[str, int]:
        """The axes and their sizes, in order."""
        return dict(zip(self.parallelism.axes, self.parallelism.sizes))

    @property
    def num_devices(self) -> int:
        """The devices the mesh uses: the product of the axis sizes."""
        return math.prod(self.parallelism.sizes)

    @property
    def num_microbatches(self) -> int:
        """The pipeline's micro-batches per step (1 without `pp`)."""
        par = self.parallelism
        return par.num_microbatches if par.pipeline else 1

    def mesh(self, devices: list | None = None) -> Mesh:
        """The device mesh on the first `num_devices` of `devices` (default: all of
        JAX's devices)."""
        devices = list(jax.devices() if devices is None else devices)
        return make_mesh(self.axes, devices=devices[: self.num_devices])


def resolve_layout(layout: Layout | ResolvedLayout, num_devices: int | None = None) -> ResolvedLayout:
    """`layout` resolved for `num_devices`, or as it is if it already is.

    **Arguments:**

    - `layout`: a `Layout` or a `ResolvedLayout`.
    - `num_devices`: the devices it fills. Default: the layout's own size (the product
      of its axis sizes: the analytical reports need no devices), or all of JAX's
      devices when an axis is `-1`.

    **Returns:**

    The `ResolvedLayout`.
    """
    if isinstance(layout, ResolvedLayout):
        return layout
    fills = any(part.partition("=")[2].strip() == "-1" for part in layout.spec.split(","))
    if num_devices is None and not fills:
        num_devices = math.prod(parse_layout(layout.spec, sys.maxsize).values())
    return layout.resolve(num_devices)
