"""`metrics.jsonl`: the step log on disk, append-only.

A run only ever appends to the file, one JSON row per line, each flushed as it is
written: a run killed at any moment leaves every earlier row as it was (at worst a last
row cut short). A resumed run first appends a marker row, `{"step": N, "resumed": true,
...}`, N the checkpoint step it resumed from; rows that an interrupted run wrote after
that checkpoint stay in the file but are superseded. Every reader (`--resume`, the loss
plot, TensorBoard's purge marker) resolves the file with `read_metrics`: the rows in
force, the last one for each step and kind (a train row, a validation row), none past
a later marker's step, in step order.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import IO, Any

from .._errors import CheckpointError

METRICS_FILE = "metrics.jsonl"
"""The step log's name in the run directory."""


def _kind(row: dict[str, Any]) -> str:
    if row.get("resumed"):
        return "resumed"
    return "val" if "val_loss" in row else "train"


def _parse(path: pathlib.Path, data: bytes) -> list[dict[str, Any]]:
    """The file's rows; a line that is not a JSON object is refused, except a last line
    cut short (a killed write), and a line cut short just before a resume marker."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{path} is not a metrics log: byte {err.start} is not UTF-8 text; move it "
            f"aside (nothing was changed) to resume without the earlier rows."
        ) from None
    lines = text.split("\n")
    rows: list[dict[str, Any] | None] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if row is not None and not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise CheckpointError(
                f"{path} line {number} is not a metrics row (a JSON object with a step): "
                f"{line[:60]!r}; move the file aside (nothing was changed) to resume."
            )
        if row is None:
            cut = number == len(lines) or all(not rest.strip() for rest in lines[number:])
            following = next((rest for rest in lines[number:] if rest.strip()), "")
            if not (cut or '"resumed": true' in following):
                raise CheckpointError(
                    f"{path} line {number} is not JSON: {line[:60]!r}; move the file aside "
                    f"(nothing was changed) to resume without the earlier rows."
                )
        rows.append(row)
    return [row for row in rows if row is not None]


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` in force, in step order (see the module's text).

    **Arguments:**

    - `path`: the file (missing: no rows).

    **Returns:**

    A list of row dicts: for each step its train row, then its validation row, each
    the last one written; resume markers left out.

    **Raises:**

    `CheckpointError` naming the file and line if it is not UTF-8 or a line is not a row.
    """
    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CheckpointError(f"cannot read {path} ({err.strerror}).") from None
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    for row in _parse(path, data):
        if row.get("resumed"):
            latest = {key: r for key, r in latest.items() if key[0] <= row["step"]}
            continue
        latest[(row["step"], _kind(row))] = row
    order = {"train": 0, "val": 1}
    return [latest[key] for key in sorted(latest, key=lambda k: (k[0], order[k[1]]))]


def _ends_with_newline(path: pathlib.Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class MetricsLog:
    """The run's `metrics.jsonl`, opened for appending (process 0 writes; others pass
    `None` and write nothing).

    **Arguments:**

    - `path`: the file, or `None` for a log that writes nowhere.
    - `resumed_from`: the step a resumed run continues from: a marker row is appended
      first (after a line break, should the last row have been cut short).
    """

    def __init__(self, path: pathlib.Path | None, resumed_from: int | None = None):
        self._out: IO[str] | None = None
        if path is None:
            return
        self._out = path.open("a", encoding="utf-8")
        if self._out.tell() and not _ends_with_newline(path):
            self._out.write("\n")
        if resumed_from is not None:
            self.write({"step": resumed_from, "resumed": True, "time": time.time()})

    def write(self, row: dict[str, Any]) -> None:
        """Append one row and flush it."""
        if self._out is not None:
            self._out.write(json.dumps(row) + "\n")
            self._out.flush()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
