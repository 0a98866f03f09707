"""One layout description for every parallelism: `"dp=2,fsdp=2,tp=2"` plus options.

A `Layout` is what was asked for (the command line's `--layout` and its options, or the
Python API's arguments), in the user's own axis names: each mesh axis plays a role (data,
fsdp, context, tensor, expert, pipeline), the conventional names `dp`, `fsdp`, `cp`, `tp`,
`ep`, `pp` by default and any others through `roles` (as Haliax maps logical axes to the
mesh's once). It may say `-1` for "fill the devices", so it knows its sizes only for a
number of devices: `Layout.resolve(n)` parses it and returns the one resolved object, a
`Parallelism` — the axes and their sizes, which axis plays which role (the batch is split
over the data axes `dp`, `fsdp`, `ep`, parameters over `fsdp` (FSDP) and `tp` (tensor
parallel), experts over `ep`, layers over `pp` (pipeline); sequence parallelism runs over
`tp`), the batch's spec, the optimizer state's split and the mesh. Every consumer — the
command line, the application, the report, the train step, the GPT — reads that one value;
the model code does not change between layouts. A `Parallelism` checks itself when it is
made (as torchtitan's `ParallelDims` does), so one built by hand is held to the same rules
as one resolved from a `Layout`.
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


def _zero_error(spec: str) -> MeshError:
    return MeshError(
        f"layout {spec!r}: zero (--zero) splits the optimizer state over the data axis "
        f"('dp'), which this layout lacks (or has of size 1); under fsdp the optimizer state "
        f"is already split like the parameters."
    )


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """A layout resolved for a number of devices (`Layout.resolve`): the mesh's axes, the
    role each plays and the options that go with them. The one value the command line, the
    application, the report, the train step and the model read; a model is built with it
    (`GPT(config, layout.resolve(), key=key)`). `Parallelism()` is one device.

    **Fields:**

    - `axes`: every axis of the mesh, in order; `sizes`: their sizes.
    - `data_axes`: the axes the batch is split over (data, FSDP and expert axes).
    - `tensor`: the tensor-parallel axis, or `None`.
    - `fsdp`: the axis parameters are fully sharded over, or `None`.
    - `expert`: the expert axis, or `None`.
    - `pipeline`: the stage axis, or `None`; with `num_microbatches` (1 without it),
      `pipeline_repeats` (local stages per device) and `pipeline_schedule` (`None`:
      GPipe for one local stage, circular for more; or a name from
      `equishard.core.SCHEDULES`).
    - `sequence_parallel`: split activations over the sequence on the tensor axis.
    - `fsdp_min_weight_size`: smaller arrays stay replicated under FSDP.
    - `context`: the context-parallel axis the sequence is split over (zigzag order),
      or `None`; `context_impl`: its attention, `"ring"` or `"alltoall"`. The sequence
      splits over `context` first and, with `sequence_parallel`, each part over the
      tensor axis (cp outer, tp inner). See the "Long sequences" guide.
    - `zero`: the axis the optimizer state is split over (the data axis under
      `Layout.zero`), or `None`: `ZeRO1(zero)` for `make_train_step`. The model does not
      change with it, so it takes no part in equality (nor in a model's pytree structure).

    **Raises:**

    `MeshError` when the fields disagree: sizes not one per axis, a role's axis not among
    `axes` or two roles on one axis, sequence parallelism without a tensor axis, an
    unknown `context_impl`, micro-batches or pipeline repeats below 1, a `zero` axis that
    is not the data axis or is of size 1.
    """

    axes: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    data_axes: tuple[str, ...] = ()
    tensor: str | None = None
    fsdp: str | None = None
    expert: str | None = None
    pipeline: str | None = None
    num_microbatches: int = 1
    pipeline_repeats: int = 1
    pipeline_schedule: str | None = None
    sequence_parallel: bool = False
    fsdp_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE
    context: str | None = None
    context_impl: str = RING
    # Not compared or hashed: the model does not change with it, so a model built with and
    # without it has one pytree structure (a model holds its Parallelism as a static field).
    zero: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Tuples however given (hashable: a model holds this as a static field).
        for name in ("axes", "sizes", "data_axes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self._check_roles()
        self._check_options()

    def _check_roles(self) -> None:
        """Each role's axis is one of `axes`, and no axis plays two roles."""
        where = f"layout {self.spec!r}"
        if len(self.sizes) != len(self.axes) or len(set(self.axes)) != len(self.axes):
            raise MeshError(
                f"Parallelism: axes {self.axes} and sizes {self.sizes} must name each axis "
                f"once, with one size each."
            )
        if any(n < 1 for n in self.sizes):
            raise MeshError(f"{where}: axis sizes must be at least 1, got {self.sizes}.")
        roles = {
            "tensor": self.tensor, "fsdp": self.fsdp, "expert": self.expert,
            "pipeline": self.pipeline, "context": self.context,
        }  # fmt: skip
        named = [(role, axis) for role, axis in roles.items() if axis is not None]
        zero = [("zero", self.zero)] if self.zero else []
        for role, axis in [*named, *(("data", a) for a in self.data_axes), *zero]:
            if axis not in self.axes:
                raise MeshError(f"{where}: the {role} axis {axis!r} is not an axis of the mesh.")
        seen: dict[str, str] = {}
        for role, axis in named:
            if axis in seen:
                raise MeshError(
                    f"{where}: the axis {axis!r} plays the roles {seen[axis]!r} and {role!r}; "
                    f"one role per axis."
                )
            seen[axis] = role
        for role, axis in named:  # the batch splits over fsdp and expert axes, not the others
            if (axis in self.data_axes) != (role in DATA_ROLES):
                must = "must" if role in DATA_ROLES else "must not"
                raise MeshError(f"{where}: the {role} axis {axis!r} {must} be a data axis.")
        plain = [a for a in self.data_axes if a not in (self.fsdp, self.expert)]
        if len(plain) > 1:
            raise MeshError(
                f"{where}: the axes {plain[0]!r} and {plain[1]!r} both play the role 'data'; "
                f"one axis per role."
            )

    def _check_options(self) -> None:
        """The options against the axes (see the class's **Raises:**)."""
        where = f"layout {self.spec!r}"
        if self.context_impl not in CONTEXT_IMPLS:
            raise MeshError(
                f"{where}: cp_impl (--cp-impl) {self.context_impl!r} is not one of "
                f"{', '.join(CONTEXT_IMPLS)}."
            )
        if self.sequence_parallel and self.tensor is None:
            raise MeshError(f"{where}: sequence parallelism needs a tensor axis ('tp').")
        if self.zero is not None and (self.zero != self.data or self.size(self.zero) < 2):
            raise _zero_error(self.spec)
        if self.num_microbatches < 1:
            raise MeshError(
                f"{where}: num_microbatches (--microbatches) must be at least 1, got "
                f"{self.num_microbatches}."
            )
        if self.pipeline_repeats < 1:
            raise MeshError(
                f"{where}: pipeline_repeats (--pipeline-repeats) must be at least 1, got "
                f"{self.pipeline_repeats}."
            )

    def size(self, axis: str | None) -> int:
        """The size of `axis` (1 if absent)."""
        return self.shape.get(axis, 1) if axis else 1

    @property
    def shape(self) -> dict[str, int]:
        """The axes and their sizes, in order (as `jax.sharding.Mesh.shape`)."""
        return dict(zip(self.axes, self.sizes))

    @property
    def spec(self) -> str:
        """The axes as a layout string, `"dp=2,fsdp=2,tp=2"` (sizes resolved)."""
        return ",".join(f"{a}={n}" for a, n in zip(self.axes, self.sizes))

    @property
    def num_devices(self) -> int:
        """The devices the mesh uses: the product of the axis sizes."""
        return math.prod(self.sizes)

    @property
    def num_stages(self) -> int:
        """The pipeline's stages: the size of the pipeline axis (1 without one)."""
        return self.size(self.pipeline)

    @property
    def data(self) -> str | None:
        """The axis that plays the data role (a data axis neither FSDP nor expert), or
        `None`."""
        return next((a for a in self.data_axes if a not in (self.fsdp, self.expert)), None)

    @property
    def data_parallel_size(self) -> int:
        """How many ways the batch is split: the product of the data axes' sizes."""
        return math.prod(self.size(a) for a in self.data_axes)

    @property
    def batch_spec(self) -> P:
        """The spec of a global batch `[B, ...]`, split over the data axes; with a context
        axis the batch's arrays are `[B, S]` (inputs, labels, positions) and the sequence is
        split over it too: `P(data, "cp")`."""
        data = self.data_axes or None
        return P(data, self.context) if self.context else P(data) if data else P()

    def mesh(self, devices: list | None = None) -> Mesh:
        """The device mesh on the first `num_devices` of `devices` (default: all of
        JAX's devices)."""
        devices = list(jax.devices() if devices is None else devices)
        return make_mesh(self.shape, devices=devices[: self.num_devices])

    def conventional(self) -> Parallelism:
        """This parallelism with its axes renamed to the conventional names of their roles
        (`replica=2,model=4` with roles data and tensor: `dp=2,tp=4`), for readers that
        speak the conventional names (the GPT's analytical minimum and memory estimate);
        itself when it already uses them."""
        by_role = {"fsdp": self.fsdp, "context": self.context, "tensor": self.tensor}
        by_role |= {"expert": self.expert, "pipeline": self.pipeline, "data": self.data}
        names = {axis: name for name, role in zip(AXES, ROLES) if (axis := by_role[role]) is not None}
        if all(names.get(a, a) == a for a in self.axes):
            return self

        def rename(axis: str | None) -> str | None:
            return None if axis is None else names.get(axis, axis)

        return dataclasses.replace(
            self, axes=tuple(names.get(a, a) for a in self.axes),
            data_axes=tuple(names.get(a, a) for a in self.data_axes), tensor=rename(self.tensor),
            fsdp=rename(self.fsdp), expert=rename(self.expert), pipeline=rename(self.pipeline),
            context=rename(self.context), zero=rename(self.zero),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout as the user writes it: mesh axes and the options that go with them.

    **Fields:**

    - `spec`: the axes, e.g. `"dp=2,fsdp=2,tp=2"` (names from `AXES`, or others given a
      role by `roles`; one size may be -1 to fill the devices).
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

    `resolve(n)` gives the `Parallelism` for `n` devices: what everything else reads
    (resolve once and keep it); `mesh(devices)` is `resolve(len(devices)).mesh(devices)`.
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

    def role_of(self) -> dict[str, str]:
        """Each axis name's role, from `roles` over the defaults (unchecked)."""
        given = dict(self.roles)
        return {**DEFAULT_ROLES, **given}

    def resolve(self, num_devices: int | None = None) -> Parallelism:
        """Parse the layout for `num_devices` devices (default: all of JAX's) and map its
        axes to their roles.

        **Returns:**

        The `Parallelism` (which checks the options against the axes as it is made).

        **Raises:**

        `MeshError` naming the layout and the option at fault: a malformed or unknown
        axis (see `parse_layout`), an axis without a role or two axes in one role, an
        unknown `cp_impl`, sequence parallelism without `tp`, `zero` without a `dp` axis
        of size 2 or more, micro-batches or pipeline repeats below 1.
        """
        axes = parse_layout(self.spec, num_devices)
        named = self._named(axes)  # role -> the axis playing it
        if self.zero and "data" not in named:
            raise _zero_error(self.spec)
        pipeline = named.get("pipeline")
        pp = axes[pipeline] if pipeline else None
        micro = self.num_microbatches if self.num_microbatches is not None else pp or 1
        role_of_axis = {axis: role for role, axis in named.items()}  # every axis has one (checked)
        return Parallelism(
            axes=tuple(axes),
            sizes=tuple(axes.values()),
            data_axes=tuple(a for a in axes if role_of_axis[a] in DATA_ROLES),
            tensor=named.get("tensor"),
            fsdp=named.get("fsdp"),
            expert=named.get("expert"),
            pipeline=pipeline,
            # 1 without pp; a count below 1 is refused (by Parallelism) with or without pp
            num_microbatches=micro if pp or micro < 1 else 1,
            pipeline_repeats=self.pipeline_repeats,
            pipeline_schedule=self.pipeline_schedule,
            sequence_parallel=self.sequence_parallel,
            fsdp_min_weight_size=self.fsdp_min_weight_size,
            context=named.get("context"),
            context_impl=self.cp_impl,
            zero=named.get("data") if self.zero else None,
        )

    def _named(self, axes: dict[str, int]) -> dict[str, str]:
        """Each role's axis (see `resolve`): every axis has a known role, one per role."""
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
        return named

    def mesh(self, devices: list | None = None) -> Mesh:
        """The device mesh (the first devices of `devices`, default all):
        `resolve(len(devices)).mesh(devices)`."""
        devices = list(jax.devices() if devices is None else devices)
        return self.resolve(len(devices)).mesh(devices)


def resolve_layout(layout: Layout | Parallelism, num_devices: int | None = None) -> Parallelism:
    """`layout` resolved for `num_devices`, or as it is if it already is.

    **Arguments:**

    - `layout`: a `Layout` or a `Parallelism`.
    - `num_devices`: the devices it fills. Default: the layout's own size (the product
      of its axis sizes: the analytical reports need no devices), or all of JAX's
      devices when an axis is `-1`.

    **Returns:**

    The `Parallelism`.
    """
    if isinstance(layout, Parallelism):
        return layout
    fills = any(part.partition("=")[2].strip() == "-1" for part in layout.spec.split(","))
    if num_devices is None and not fills:
        num_devices = math.prod(parse_layout(layout.spec, sys.maxsize).values())
    return layout.resolve(num_devices)
