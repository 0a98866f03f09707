"""TensorBoard event files of `equishard train`, written with tensorboardX (the `train`
extra), as MaxText and Levanter write theirs.

`<run-dir>/tensorboard/` holds the step log's scalars under `train/` (loss, gradient
norm, learning rate, step time, tokens/s, TFLOP/s per device, MFU, peak memory where
they exist) and the validation loss under `val/loss`, and the run's `config.toml` as
text. A resumed run's writer starts with TensorBoard's purge marker at the step it
resumes from, so the events an interrupted run wrote after its last checkpoint are
dropped rather than shown twice. Only process 0 writes.
"""

from __future__ import annotations

import pathlib
from typing import Any

TENSORBOARD_DIR = "tensorboard"
"""Where the event files go in the run directory."""

_NOT_SCALARS = ("step", "tokens", "time", "skipped")


class TensorBoard:
    """A run's event writer.

    **Arguments:**

    - `run_dir`: the run directory (events go to `run_dir/tensorboard`).
    - `first_step`: the step a resumed run continues from (0 for a new run): events of
      later steps left by an earlier attempt are purged.
    """

    def __init__(self, run_dir: pathlib.Path, first_step: int):
        from tensorboardX import SummaryWriter

        self.directory = run_dir / TENSORBOARD_DIR
        # purge_step: TensorBoard drops the earlier files' events from this step on.
        self._writer = SummaryWriter(
            str(self.directory), purge_step=first_step + 1 if first_step else None
        )

    def text(self, tag: str, text: str) -> None:
        """Record a text (the configuration) at step 0."""
        self._writer.add_text(tag, f"```\n{text}\n```", 0)

    def step(self, row: dict[str, Any]) -> None:
        """Record a `metrics.jsonl` row's numbers as `train/NAME` (`val/loss` for the
        validation loss) at the row's step."""
        step = int(row["step"])
        for name, value in row.items():
            if name in _NOT_SCALARS:
                continue
            tag = "val/loss" if name == "val_loss" else f"train/{name}"
            self._writer.add_scalar(tag, float(value), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run_dir: pathlib.Path, first_step: int) -> tuple[TensorBoard | None, str | None]:
    """The run's writer, or `None` and the reason where tensorboardX is not installed."""
    try:
        return TensorBoard(run_dir, first_step), None
    except ImportError:
        return None, (
            "note: no TensorBoard events: tensorboardX is not installed (it comes with "
            "pip install 'equishard[train]'); --no-tensorboard turns them off."
        )
