"""The names equishard's options take, in one place: every comparison, every error message
and the command line's `choices` read them from here.

A leaf module (it imports nothing), so that every floor can name an implementation or a
schedule without importing the floor that implements it: the layout (`sharding`) checks a
context-parallel implementation that `core` implements and `nn` calls. The public floors
re-export what users need (`equishard.core.SCHEDULES`, `equishard.sharding.CONTEXT_IMPLS`).
"""

from __future__ import annotations

RING = "ring"
ALLTOALL = "alltoall"
CONTEXT_IMPLS: tuple[str, ...] = (RING, ALLTOALL)
"""The attention implementations over a context-parallel axis: ring attention and
all-to-all (Ulysses)."""

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
SEQUENCE_ORDERS: tuple[str, ...] = (CONTIGUOUS, ZIGZAG)
"""How a sequence split over a context axis is laid out: device `i` holds the `i`-th
slice, or the `i`-th and the `(2n - 1 - i)`-th of `2n` chunks (balanced causal work)."""

GPIPE = "gpipe"
CIRCULAR = "circular"
ONE_F_ONE_B = "1f1b"
INTERLEAVED_1F1B = "interleaved-1f1b"
ZB_H1 = "zb-h1"
SCHEDULES: tuple[str, ...] = (GPIPE, CIRCULAR, ONE_F_ONE_B, INTERLEAVED_1F1B, ZB_H1)
"""The pipeline schedules `equishard.core.pipeline_schedule` knows."""

SCANNED_SCHEDULES: tuple[str, ...] = (GPIPE, CIRCULAR)
"""The schedules that run as one differentiated `jax.lax.scan`; the others are explicit
(`equishard.core.execute_schedule` follows their table step by step)."""


def differentiated_scan(schedule: str | None) -> bool:
    """Whether a pipeline `schedule` runs as one differentiated scan (GPipe, circular;
    `None`, the default, is one of them) rather than explicitly, step by step."""
    return schedule is None or schedule in SCANNED_SCHEDULES
