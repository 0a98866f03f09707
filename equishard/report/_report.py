"""The communication and memory report of a compiled train step.

`report(program, mesh=...)` reads any compiled (or lowered) program: every collective
with the mesh axes it runs over, its shapes, dtype, count (loop trip counts applied)
and the bytes each device sends under ring algorithms (`read_collectives`);
the per-device argument, output and temporary memory from the compiler's memory
analysis; optionally the per-parameter table and an analytical minimum to compare with.
`gpt_report` does all of it for the reference GPT under a layout, compiling (never
running) the real train step from parameter shapes alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from .._text import fill, human_bytes, text_table
from ..sharding import ParamRow, format_param_rows
from ._axes import collective_axes
from ._hlo import CollectiveOp, compiled_program, format_shapes, read_collectives
from ._memory import MemoryEstimate, format_memory_estimate
from ._minimum import Minimum, format_minimum

__all__ = ["CollectiveRow", "MemoryStats", "StepReport", "format_report", "memory_stats", "report"]


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective of a report: the reader's `CollectiveOp` and its mesh axes.

    **Fields:**

    - `op`: the reader's `CollectiveOp` (kind, group size, shapes, count, bytes).
    - `axes`: the mesh axes it runs over, in mesh order (`None` when its replica groups
      match no set of axes, or no mesh was given).
    """

    op: CollectiveOp
    axes: tuple[str, ...] | None

    @property
    def kind(self) -> str:
        """The collective's kind, e.g. `"all-gather"`."""
        return self.op.kind

    @property
    def dtype(self) -> str:
        """The element type of its (first) operand, e.g. `"f32"`."""
        shapes = self.op.operand_shapes or self.op.result_shapes
        return shapes[0][0] if shapes else ""

    @property
    def count(self) -> int:
        """How many times it runs per step (loop trip counts applied)."""
        return self.op.count

    @property
    def bytes_per_device(self) -> float:
        """Bytes each device sends in one execution."""
        return self.op.bytes_per_device

    @property
    def total_bytes(self) -> float:
        """Bytes each device sends over all its executions in one step."""
        return self.op.total_bytes


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Per-device memory of a compiled program, from `compiled.memory_analysis()`.

    **Fields:**

    - `argument_bytes`, `output_bytes`, `temp_bytes`: arguments, outputs, temporaries.
    - `alias_bytes`: output bytes that reuse (donated) argument buffers.
    - `generated_code_bytes`: the executable.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """`arguments + outputs − aliased + temporaries`: all live at once, an upper bound."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def memory_stats(compiled: Any) -> MemoryStats | None:
    """The per-device memory of a compiled program (`None` if the backend gives none).

    **Arguments:**

    - `compiled`: a `jax.stages.Compiled` (or what `eqx.filter_jit(...).lower(...).compile()`
      returns).

    **Returns:**

    A `MemoryStats`, or `None`.
    """
    inner = getattr(compiled, "compiled", compiled)
    analysis = getattr(inner, "memory_analysis", None)
    stats: Any = analysis() if callable(analysis) else None
    if stats is None:
        return None
    return MemoryStats(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
    )


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Collectives, memory, parameters and the analytical minimum of one compiled step.

    **Fields:**

    - `collectives`: `CollectiveRow`s in program order.
    - `memory`: `MemoryStats` per device, or `None`.
    - `params`: the per-parameter table (`equishard.sharding.ParamRow`s), may be empty.
    - `minimum`: the analytical `Minimum`, or `None`.
    - `mesh_shape`: the mesh's `{axis: size}`.
    - `description`: what was compiled.
    - `estimate`: the analytical per-device memory by category (`gpt_memory`), or `None`.
    """

    collectives: tuple[CollectiveRow, ...]
    memory: MemoryStats | None = None
    params: tuple[ParamRow, ...] = ()
    minimum: Minimum | None = None
    mesh_shape: Mapping[str, int] = dataclasses.field(default_factory=dict)
    description: str = ""
    estimate: MemoryEstimate | None = None

    @property
    def collective_bytes(self) -> float:
        """Bytes each device sends per step, all collectives."""
        return float(sum(c.total_bytes for c in self.collectives))

    @property
    def ratio(self) -> float | None:
        """Measured bytes over the analytical minimum (`None` without a minimum)."""
        if self.minimum is None or not self.minimum.total:
            return None
        return self.collective_bytes / self.minimum.total

    @property
    def ratio_text(self) -> str:
        """`ratio` as printed: three decimals, or why there is none (one device sends nothing)."""
        ratio = self.ratio
        if ratio is not None:
            return f"{ratio:.3f}"
        if self.minimum is not None and not self.collective_bytes:
            return "- (nothing to send)"
        return "- (no minimum)"

    def bytes_by_axes(self) -> dict[tuple[str, ...] | None, float]:
        """Measured bytes summed per set of mesh axes."""
        out: dict[tuple[str, ...] | None, float] = {}
        for c in self.collectives:
            out[c.axes] = out.get(c.axes, 0.0) + c.total_bytes
        return out

    def __str__(self) -> str:
        return format_report(self)


def report(
    program: Any,
    *,
    mesh: Mesh | Mapping[str, int] | None = None,
    params: Sequence[ParamRow] = (),
    minimum: Minimum | None = None,
    description: str = "",
    weights: Mapping[str, float] | None = None,
    estimate: MemoryEstimate | None = None,
) -> StepReport:
    """Read the collectives and memory of a compiled program into a `StepReport`.

    ```python
    compiled = train_step.lower(state, batch).compile()
    print(equishard.report.report(compiled, mesh=mesh, params=param_table(state.model, mesh)))
    ```

    **Arguments:**

    - `program`: a `jax.stages.Compiled` or `Lowered` (compiled here), what
      `eqx.filter_jit(f).lower(...)` returns, or HLO text (then no memory analysis).
    - `mesh`: the mesh (or its `{axis: size}`), to name each collective's axes.
    - `params`: the per-parameter table to include (`equishard.param_table(model, mesh)`).
    - `minimum`: an analytical `Minimum` to compare with (e.g. `gpt_minimum`).
    - `description`: a line saying what was compiled.
    - `weights`: how often conditional branches run (`read_collectives`'s `weights`,
      e.g. `equishard.core.schedule_weights` of an explicit pipeline schedule).
    - `estimate`: an analytical `MemoryEstimate` to print beside the compiler's memory.

    **Returns:**

    A `StepReport`; `str(report)` is the printed report.
    """
    program = program if isinstance(program, str) else compiled_program(program)
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh or {})
    rows = tuple(  # the module is parsed once, by the reader
        CollectiveRow(op, collective_axes(op, shape) if shape else None)
        for op in read_collectives(program, weights=weights)
    )
    memory = None if isinstance(program, str) else memory_stats(program)
    return StepReport(rows, memory, tuple(params), minimum, shape, description, estimate)


# ---------------------------------------------------------------------------- format


def _axes_text(axes: tuple[str, ...] | None) -> str:
    return "?" if axes is None else ",".join(axes) or "-"


def format_collectives(collectives: Sequence[CollectiveRow], width: int | None = None) -> str:
    """The collectives as a table, one row each, with the total per step (`width`: the
    most columns a line takes, as `text_table` fits it)."""
    header = ("kind", "axes", "n", "count", "operands", "bytes/device", "total/step")
    rows = [
        (
            c.kind,
            _axes_text(c.axes),
            str(c.op.group_size),
            str(c.count),
            format_shapes(c.op.operand_shapes, limit=60),
            human_bytes(c.bytes_per_device),
            human_bytes(c.total_bytes),
        )
        for c in collectives
    ]
    total_bytes = sum(c.total_bytes for c in collectives)
    total = ("total", "", "", str(sum(c.count for c in collectives)), "", "", human_bytes(total_bytes))
    return text_table(header, rows, total, width=width)


def format_memory(memory: MemoryStats) -> str:
    """The per-device memory, one line per kind."""
    lines = [
        ("arguments", memory.argument_bytes),
        ("outputs", memory.output_bytes),
        ("  of which aliased to arguments (donated)", memory.alias_bytes),
        ("temporaries", memory.temp_bytes),
        ("peak (arguments + outputs - aliased + temporaries)", memory.peak_bytes),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name.ljust(width)}  {human_bytes(value)}" for name, value in lines)


def format_report(r: StepReport, width: int | None = None) -> str:
    """The whole report as text: collectives, the comparison with the minimum, memory, parameters.

    **Arguments:**

    - `r`: a `StepReport`.
    - `width`: the most columns a line takes (`None`: no limit); wide table columns and
      long lines are wrapped to fit (`equishard inspect` uses 120, `--wide` none).

    **Returns:**

    A multi-line string.
    """
    axes = ", ".join(f"{k}={v}" for k, v in r.mesh_shape.items())
    out = []
    if r.description:
        out.append(fill(r.description, width))
    out += [
        "",
        fill(f"Collectives per step (bytes each device sends, ring algorithms; mesh {axes or '?'}):", width),
        format_collectives(r.collectives, width),
    ]
    by_axes = r.bytes_by_axes()
    if len(by_axes) > 1:
        out.append(fill(
            "by axes: "
            + ", ".join(f"{_axes_text(a)} {human_bytes(b)}" for a, b in sorted(by_axes.items(), key=lambda kv: -kv[1])),
            width,
        ))  # fmt: skip
    if r.minimum is not None:
        out += ["", "Analytical minimum (see equishard.report's documentation for each formula):"]
        out.append(format_minimum(r.minimum, width))
        ideal = r.collective_bytes / r.minimum.ideal_total if r.minimum.ideal_total else math.nan
        out.append(fill(
            f"measured {human_bytes(r.collective_bytes)} / minimum {human_bytes(r.minimum.total)} "
            f"= {r.ratio_text}"
            + (f" (over the bubble-free textbook figure: {ideal:.3f})" if r.minimum.ideal_total != r.minimum.total else ""),
            width,
        ))  # fmt: skip
    if r.memory is not None:
        out += ["", "Memory per device (the compiler's memory analysis):", format_memory(r.memory)]
    if r.estimate is not None:
        compiled = (r.memory.argument_bytes, r.memory.temp_bytes) if r.memory is not None else (None, None)
        out += ["", format_memory_estimate(r.estimate, *compiled, width=width)]
    if r.params:
        out += ["", "Parameters:", format_param_rows(r.params, width)]
    return "\n".join(out)
