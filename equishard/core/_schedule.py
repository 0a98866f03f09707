"""Pipeline schedules as data: which stage does what, at which step.

A schedule is a static table of `K` steps by `S` stage devices. Entry `[t, d]` says
what device `d` does at step `t`: the forward (`F`), the backward (`B`) or the deferred
weight-gradient half of the backward (`W`, zero-bubble schedules only) of micro-batch
`m` in its local (virtual) stage `v`, or nothing (idle). Local stage `v` of device `d`
is global stage `v S + d`.

The table is built by running each device's *order* of work (the schedule proper:
GPipe does all forwards then all backwards, 1F1B alternates, ...) in lock-step: at
every step each device does its next piece of work as soon as what it needs was done
at an earlier step (an activation or cotangent moves to its neighbour in one step).
The explicit executor (`execute_schedule`) follows the table step by step; GPipe and
circular run as one differentiated `jax.lax.scan` whose timing the table reproduces.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from .._errors import LayerConfigError
from .._names import (
    GPIPE,
    ONE_F_ONE_B,
    SCHEDULES as SCHEDULES,
    ZB_H1,
    differentiated_scan,
)

ScheduleName = Literal["gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1"]

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
"""Op codes of a schedule table: idle, forward, backward (the input gradient, and the
weight gradient too unless the schedule splits it off), weight gradient."""

OP_LETTERS = {IDLE: ".", FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A static pipeline schedule: what every stage device does at every step.

    Built by `pipeline_schedule`; see the pipeline guide (docs/guides/pipeline.md).

    **Fields:**

    - `name`: one of `"gpipe"`, `"circular"`, `"1f1b"`, `"interleaved-1f1b"`, `"zb-h1"`.
    - `num_stages`: devices along the stage axis, `S`.
    - `num_microbatches`: `M`.
    - `repeats`: local (virtual) stages per device, `R`; device `d`'s local stage `v`
      is global stage `v S + d`.
    - `op`: `int8[K, S]` numpy array: 0 idle, 1 forward, 2 backward, 3 weight gradient.
    - `microbatch`: `int32[K, S]` numpy array, the micro-batch, `-1` when idle.
    - `virtual`: `int32[K, S]` numpy array, the local stage, `-1` when idle.
    """

    name: str
    num_stages: int
    num_microbatches: int
    repeats: int
    op: np.ndarray
    microbatch: np.ndarray
    virtual: np.ndarray

    @property
    def num_steps(self) -> int:
        """The table's length `K` in steps."""
        return int(self.op.shape[0])

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into input-gradient (`B`) and weight-gradient (`W`) work."""
        return self.name == ZB_H1

    @property
    def differentiated_scan(self) -> bool:
        """Whether the schedule runs as one differentiated scan (GPipe, circular)."""
        return differentiated_scan(self.name)

    def rows(self) -> list[str]:
        """The table as text, one line per step: `F3` is micro-batch 3's forward.

        Interleaved schedules add the local stage: `F3.1` is micro-batch 3's forward
        through local stage 1.
        """
        width = 2 + len(str(self.num_microbatches - 1)) + (2 if self.repeats > 1 else 0)
        lines = []
        for t in range(self.num_steps):
            cells = []
            for d in range(self.num_stages):
                op = int(self.op[t, d])
                text = OP_LETTERS[op]
                if op != IDLE:
                    text += str(int(self.microbatch[t, d]))
                    if self.repeats > 1:
                        text += f".{int(self.virtual[t, d])}"
                cells.append(text.rjust(width))
            lines.append(" ".join(cells))
        return lines


def _check_args(name: str, num_stages: int, num_microbatches: int, repeats: int) -> None:
    if name not in SCHEDULES:
        raise LayerConfigError(
            f"pipeline: unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}."
        )
    for what, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("repeats", repeats),
    ):
        if value < 1:
            raise LayerConfigError(f"pipeline: {what} must be at least 1, got {value}.")
    if name in (GPIPE, ONE_F_ONE_B, ZB_H1) and repeats != 1:
        raise LayerConfigError(
            f"pipeline: the {name!r} schedule runs one stage per device (repeats=1), got "
            f"repeats={repeats}; use 'circular' or 'interleaved-1f1b' for more."
        )
    if repeats > 1 and num_microbatches % num_stages:
        raise LayerConfigError(
            f"{name} pipeline: num_microbatches={num_microbatches} must be a multiple "
            f"of the number of stages {num_stages} (micro-batches go round the ring in "
            f"groups of {num_stages}); with repeats={repeats}."
        )


Work = tuple[int, int, int]  # (op, micro-batch, local stage)


def _circular_pieces(s: int, m: int, r: int) -> list[tuple[int, int]]:
    """(micro-batch, local stage) of each device's forwards in order: groups of `S`."""
    pieces = []
    for k in range(r * m):
        within = k % (s * r)
        pieces.append(((k // (s * r)) * s + within % s, within // s))
    return pieces


def _interleaved_backward(s: int, m: int, r: int) -> list[tuple[int, int]]:
    """Backward pieces of interleaved 1F1B: groups of `S`, local stages last to first."""
    pieces = []
    for k in range(r * m):
        within = k % (s * r)
        pieces.append(((k // (s * r)) * s + within % s, r - 1 - within // s))
    return pieces


def _one_f_one_b(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[Work]:
    """`warmup` forwards, then one forward and one backward in turn, then the rest."""
    warmup = min(warmup, len(forwards))
    order: list[Work] = [(FORWARD, mb, v) for mb, v in forwards[:warmup]]
    for i, (mb, v) in enumerate(forwards[warmup:]):
        order.append((FORWARD, mb, v))
        order.append((BACKWARD, *backwards[i]))
    order += [(BACKWARD, mb, v) for mb, v in backwards[len(forwards) - warmup :]]
    return order


def _orders(name: str, s: int, m: int, r: int) -> list[list[Work]]:
    """Each device's work in the order it does it (zb-h1 is built greedily instead)."""
    orders = []
    for d in range(s):
        if differentiated_scan(name):
            # Autodiff of the scan: every forward, then the backwards in reverse.
            fwd = _circular_pieces(s, m, r) if r > 1 else [(mb, 0) for mb in range(m)]
            order = [(FORWARD, mb, v) for mb, v in fwd]
            order += [(BACKWARD, mb, v) for mb, v in reversed(fwd)]
        elif name == ONE_F_ONE_B:
            mbs = [(mb, 0) for mb in range(m)]
            order = _one_f_one_b(mbs, mbs, s - d - 1)
        else:  # interleaved-1f1b (Megatron's warm-up count)
            warmup = (s - d - 1) * 2 + (r - 1) * s
            order = _one_f_one_b(_circular_pieces(s, m, r), _interleaved_backward(s, m, r), warmup)
        orders.append(order)
    return orders


class _Progress:
    """When each (op, micro-batch, global stage) finished, for dependency checks."""

    def __init__(self, s: int, r: int, split: bool):
        self.s, self.last = s, s * r - 1
        self.split = split
        self.done: dict[tuple[int, int, int], int] = {}

    def ready(self, work: Work, d: int, t: int) -> bool:
        op, mb, v = work
        g = v * self.s + d

        def before(key: tuple[int, int, int]) -> bool:
            return self.done.get(key, t) < t

        if op == FORWARD:
            return g == 0 or before((FORWARD, mb, g - 1))
        if op == BACKWARD:
            return before((FORWARD, mb, g)) and (g == self.last or before((BACKWARD, mb, g + 1)))
        return before((BACKWARD, mb, g))

    def finish(self, work: Work, d: int, t: int) -> None:
        op, mb, v = work
        self.done[op, mb, v * self.s + d] = t


def _lockstep(orders: list[list[Work]], s: int, r: int, split: bool) -> list[list[Work | None]]:
    """Run fixed per-device orders in lock-step; the steps as rows of work (None: idle)."""
    progress = _Progress(s, r, split)
    nxt = [0] * s
    steps: list[list[Work | None]] = []
    while any(nxt[d] < len(orders[d]) for d in range(s)):
        t = len(steps)
        row: list[Work | None] = []
        for d in range(s):
            work = orders[d][nxt[d]] if nxt[d] < len(orders[d]) else None
            if work is not None and progress.ready(work, d, t):
                nxt[d] += 1
                row.append(work)
            else:
                row.append(None)
        for d, work in enumerate(row):
            if work is not None:
                progress.finish(work, d, t)
        steps.append(row)
        if t > 4 * sum(len(o) for o in orders):  # pragma: no cover - a bug, not a user error
            raise AssertionError("pipeline schedule: the orders deadlock")
    return steps


def _zero_bubble_h1(s: int, m: int) -> list[list[Work | None]]:
    """ZB-H1 (Qi et al. 2023) in lock-step with `F`, `B`, `W` one step each.

    Each device prefers the backward (input gradient) that unblocks the previous stage,
    then a forward while it holds fewer than `S` micro-batches whose weight gradient is
    not done (1F1B's peak, on its first device), then deferred weight-gradient work,
    which so fills what would be bubble.
    """
    progress = _Progress(s, 1, True)
    next_f, next_b = [0] * s, [0] * s
    pending_w: list[list[int]] = [[] for _ in range(s)]
    held = [0] * s  # micro-batches forwarded whose weight gradient is not done
    steps: list[list[Work | None]] = []
    while any(next_f[d] < m or next_b[d] < m or pending_w[d] for d in range(s)):
        t = len(steps)
        row: list[Work | None] = []
        for d in range(s):
            choice: Work | None = None
            if next_b[d] < m and progress.ready((BACKWARD, next_b[d], 0), d, t):
                choice = (BACKWARD, next_b[d], 0)
                next_b[d] += 1
                pending_w[d].append(choice[1])
            elif next_f[d] < m and held[d] < s and progress.ready((FORWARD, next_f[d], 0), d, t):
                choice = (FORWARD, next_f[d], 0)
                next_f[d] += 1
                held[d] += 1
            elif pending_w[d]:
                choice = (WEIGHT, pending_w[d].pop(0), 0)
                held[d] -= 1
            row.append(choice)
        for d, work in enumerate(row):
            if work is not None:
                progress.finish(work, d, t)
        steps.append(row)
    return steps


def pipeline_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    repeats: int = 1,
) -> PipelineSchedule:
    """The static table of a pipeline schedule.

    - `"gpipe"`: every forward, then every backward (in reverse, as autodiff of the
      forward scan runs them); each device holds all `M` micro-batches.
    - `"circular"`: GPipe with `R` local stages per device, micro-batches in groups of
      `S` going round the ring `R` times.
    - `"1f1b"`: device `d` runs `S - d - 1` warm-up forwards, then alternates one
      forward and one backward; it holds at most `S - d` micro-batches.
    - `"interleaved-1f1b"`: 1F1B over `R` local stages per device (Megatron's order);
      a smaller bubble for a few more micro-batches held.
    - `"zb-h1"`: 1F1B with each backward split into its input-gradient half (`B`, on
      the critical path) and its weight-gradient half (`W`, deferred to fill the
      bubble); no device holds more micro-batches than 1F1B's first device (`S`).

    See the pipeline guide (docs/guides/pipeline.md) for the tables side by side.

    **Arguments:**

    - `name`: the schedule, one of the five above.
    - `num_stages`: devices along the stage axis, `S`.
    - `num_microbatches`: `M`; a multiple of `S` when `repeats > 1`.
    - `repeats`: local (virtual) stages per device, `R`; only `"circular"` and
      `"interleaved-1f1b"` take more than 1.

    **Returns:**

    A `PipelineSchedule`.

    **Raises:**

    `LayerConfigError` for an unknown name, a count below 1, `repeats > 1` on a
    schedule without local stages, or `M` not a multiple of `S` when `R > 1`.
    """
    _check_args(name, num_stages, num_microbatches, repeats)
    s, m, r = num_stages, num_microbatches, repeats
    if name == ZB_H1:
        steps = _zero_bubble_h1(s, m)
    else:
        steps = _lockstep(_orders(name, s, m, r), s, r, split=False)
    k = len(steps)
    op = np.zeros((k, s), np.int8)
    microbatch = np.full((k, s), -1, np.int32)
    virtual = np.full((k, s), -1, np.int32)
    for t, row in enumerate(steps):
        for d, work in enumerate(row):
            if work is not None:
                op[t, d], microbatch[t, d], virtual[t, d] = work
    return PipelineSchedule(name, s, m, r, op, microbatch, virtual)


# ----------------------------------------------------------------------------------------
# What a schedule costs.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """What a pipeline schedule costs, read off its table (see `schedule_report`).

    **Fields:**

    - `name`, `num_stages`, `num_microbatches`, `repeats`: the schedule's.
    - `num_steps`: `K`, the table's steps.
    - `bubble_fraction`: the idle share of each device's time when each device runs
      its work in the table's order as soon as its inputs are there, a forward taking
      one unit, a full backward two, a split backward's `B` and `W` one each.
    - `idle_fraction`: the share of idle (step, device) slots of the lock-step table.
    - `peak_in_flight`: per device, the most micro-batches (times local stages) whose
      forward has run and whose backward (weight gradient, if split) has not: what
      a device holds for the backward pass.
    """

    name: str
    num_stages: int
    num_microbatches: int
    repeats: int
    num_steps: int
    bubble_fraction: float
    idle_fraction: float
    peak_in_flight: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"{self.name}: S={self.num_stages} M={self.num_microbatches} R={self.repeats} "
            f"steps={self.num_steps} bubble={self.bubble_fraction:.3f} "
            f"peak in flight={list(self.peak_in_flight)}"
        )


def _dataflow_makespan(schedule: PipelineSchedule) -> tuple[float, float]:
    """(makespan, busy time per device) when each device runs its order asynchronously."""
    s, r = schedule.num_stages, schedule.repeats
    last = s * r - 1
    split = schedule.split_backward
    cost = {FORWARD: 1.0, BACKWARD: 1.0 if split else 2.0, WEIGHT: 1.0}
    orders = [
        [
            (int(schedule.op[t, d]), int(schedule.microbatch[t, d]), int(schedule.virtual[t, d]))
            for t in range(schedule.num_steps)
            if schedule.op[t, d] != IDLE
        ]
        for d in range(s)
    ]
    finish: dict[tuple[int, int, int], float] = {}
    free = [0.0] * s
    nxt = [0] * s
    busy = sum(cost[w[0]] for w in orders[0])
    while any(nxt[d] < len(orders[d]) for d in range(s)):
        moved = False
        for d in range(s):
            while nxt[d] < len(orders[d]):
                op, mb, v = orders[d][nxt[d]]
                g = v * s + d
                if op == FORWARD:
                    deps = [] if g == 0 else [(FORWARD, mb, g - 1)]
                elif op == BACKWARD:
                    deps = [(FORWARD, mb, g)] + ([] if g == last else [(BACKWARD, mb, g + 1)])
                else:
                    deps = [(BACKWARD, mb, g)]
                if any(dep not in finish for dep in deps):
                    break
                start = max([free[d]] + [finish[dep] for dep in deps])
                free[d] = finish[op, mb, g] = start + cost[op]
                nxt[d] += 1
                moved = True
        if not moved:  # pragma: no cover - a bug, not a user error
            raise AssertionError("pipeline schedule: the orders deadlock")
    return max(free), busy


def _peak_in_flight(schedule: PipelineSchedule) -> tuple[int, ...]:
    releasing = WEIGHT if schedule.split_backward else BACKWARD
    peaks = []
    for d in range(schedule.num_stages):
        held = peak = 0
        for op in schedule.op[:, d]:
            held += int(op == FORWARD) - int(op == releasing)
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def schedule_report(schedule: PipelineSchedule) -> ScheduleReport:
    """Bubble fraction and peak in-flight micro-batches of a schedule, from its table.

    In SPMD every device computes at every step (a bubble step of GPipe computes on
    stale data; an explicit schedule's idle step skips its work), so the bubble is read
    off the table rather than measured: `bubble_fraction` lets each device run its work
    in the table's order as soon as its inputs are there (the textbook figure:
    `(S - 1) / (M + S - 1)` for GPipe and 1F1B), `idle_fraction` counts the lock-step
    table's idle slots.

    **Arguments:**

    - `schedule`: from `pipeline_schedule`.

    **Returns:**

    A `ScheduleReport` (its `str` is a one-line summary).
    """
    makespan, busy = _dataflow_makespan(schedule)
    return ScheduleReport(
        name=schedule.name,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        repeats=schedule.repeats,
        num_steps=schedule.num_steps,
        bubble_fraction=1.0 - busy / makespan,
        idle_fraction=float(np.mean(schedule.op == IDLE)),
        peak_in_flight=_peak_in_flight(schedule),
    )
