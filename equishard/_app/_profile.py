"""`equishard train --profile START:STOP`: a `jax.profiler` trace of some steps."""

from __future__ import annotations

import pathlib
import re
import types
from typing import Any

import jax

from .._errors import LayerConfigError

PROFILE_DIR = "profile"
"""The trace's folder in the run directory (TensorBoard's `--logdir` for its profile
plugin; Perfetto opens the `.trace.json.gz` inside)."""


def profile_steps(text: str | None, steps: int) -> tuple[int, int] | None:
    """`(start, stop)` from `--profile START:STOP` (steps `start` to `stop - 1`), or `None`.

    **Raises:**

    `LayerConfigError` naming `--profile` unless `0 <= START < STOP <= steps`.
    """
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None:
        raise LayerConfigError(
            f"--profile must be START:STOP, two step numbers (e.g. 10:15 traces steps 10 to "
            f"14), got {text!r}."
        )
    start, stop = int(match.group(1)), int(match.group(2))
    if not start < stop <= steps:
        raise LayerConfigError(
            f"--profile {text}: the traced steps must be START < STOP <= --steps ({steps}), "
            f"START counted from 0."
        )
    return start, stop


def profile_resumed_note(text: str | None, steps: int, first: int) -> str | None:
    """The warning for a `--profile` range that ends before the step a resumed run starts
    at (it traces nothing; a resume with the run's own `config.toml` keeps the range it
    traced the first time), or `None`."""
    traced = profile_steps(text, steps)
    if traced is None or traced[1] > first:
        return None
    return (
        f"warning: --profile {text} traces steps {traced[0]} to {traced[1] - 1}, all before "
        f"step {first}, where this resumed run starts: nothing will be traced (give a range "
        f"from step {first} on to trace this run)."
    )


class StepProfiler:
    """Starts a `jax.profiler` trace before step `start`, stops it after step `stop - 1`
    (or when the loop ends first): a context around the training loop.

    **Arguments:**

    - `steps`: `(start, stop)` from `profile_steps`, or `None` (nothing traced).
    - `run_dir`: the run directory; the trace goes to `run_dir/profile/`.
    """

    def __init__(self, steps: tuple[int, int] | None, run_dir: pathlib.Path):
        self.steps, self.path, self.tracing = steps, run_dir / PROFILE_DIR, False

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.profiler.start_trace(str(self.path), create_perfetto_trace=True)
            self.tracing = True

    def after(self, step: int, outputs: Any) -> None:
        """After step `step`, whose `outputs` are waited for before the trace stops."""
        if self.tracing and step + 1 == self.steps[1]:  # type: ignore[index]
            jax.block_until_ready(outputs)
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        self.tracing = False

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: types.TracebackType | None) -> None:
        if self.tracing:
            self._stop()
