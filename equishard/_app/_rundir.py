"""A run directory belongs to one run: its marker file, its lock, `--overwrite`.

`equishard train` writes only into an empty directory, or into one that holds an
equishard run (the marker file `.equishard-run`), and the latter only with `--resume`
(continue it) or `--overwrite` (move its files, checkpoints included, into
`previous-<UTC time>/` beside them: nothing is deleted). While the run lives the
directory holds the lock file `.equishard-lock` with the process id and host of the run
(under `equishard launch`, process 0's); a second run on the directory is refused
naming them, and a lock whose process is gone from this host is reported as stale and
taken over. The lock is an exclusively created file: on a network file system that
does not honour exclusive creation it is best effort.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError

MARKER = ".equishard-run"
LOCK = ".equishard-lock"
PREVIOUS = "previous-"


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed into place: a failed
    write (a full disk) leaves `path` as it was.

    **Raises:**

    `CheckpointError` naming the file and the reason.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write {path} ({err.strerror or type(err).__name__}); it was left as it was."
        ) from None


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _holder(lock: pathlib.Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The lock of a run directory, held until `release()` (see the module's text)."""

    def __init__(self, directory: pathlib.Path, print_fn: Callable[[str], None]):
        self.path = directory / LOCK
        self._me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _utc()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale(print_fn)
                continue
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(self._me))
            return
        raise CheckpointError(f"cannot lock {directory}: {self.path} keeps reappearing.")

    def _take_over_if_stale(self, print_fn: Callable[[str], None]) -> None:
        holder = _holder(self.path)
        if holder is None:
            raise CheckpointError(
                f"{self.path.parent} is locked ({self.path} exists but names no process); if no "
                f"run uses the directory, remove {self.path} and start again."
            )
        pid, host = holder.get("pid"), holder.get("host")
        if host != self._me["host"] or not isinstance(pid, int) or _alive(pid):
            raise CheckpointError(
                f"{self.path.parent} is in use by another run (pid {pid} on host {host}, "
                f"started {holder.get('started')}); wait for it to end or choose another --run-dir."
            )
        print_fn(
            f"note: taking over the stale lock of {self.path.parent} (pid {pid} on this host, "
            f"{host}, is gone)."
        )
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock file if it is still this run's."""
        if _holder(self.path) == self._me:
            self.path.unlink(missing_ok=True)


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
    """A directory's entries that belong to its run (not the marker, lock, or earlier
    runs moved aside)."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if p.name not in (MARKER, LOCK) and not p.name.startswith(PREVIOUS)
    )


def move_aside(directory: pathlib.Path, entries: list[pathlib.Path]) -> pathlib.Path:
    """Move `entries` of `directory` into a new `previous-<UTC time>/` in it."""
    stamp, n = _utc(), 0
    target = directory / f"{PREVIOUS}{stamp}"
    while target.exists():
        n += 1
        target = directory / f"{PREVIOUS}{stamp}-{n}"
    target.mkdir()
    for entry in entries:
        os.replace(entry, target / entry.name)
    return target


def claim(
    run_dir: pathlib.Path,
    checkpoint_dir: pathlib.Path,
    *,
    resume: bool,
    overwrite: bool,
    print_fn: Callable[[str], None],
) -> RunLock:
    """Lock `run_dir` for this run and check that the run may write there.

    **Arguments:**

    - `run_dir`: the run directory (it exists).
    - `checkpoint_dir`: the run's checkpoints (inside `run_dir` or elsewhere).
    - `resume`: the run continues the directory's run.
    - `overwrite`: the directory's run is moved into `previous-<UTC time>/`.
    - `print_fn`: where notes go (a stale lock taken over, files moved).

    **Returns:**

    The lock (release it when the run ends).

    **Raises:**

    `CheckpointError` if the directory is locked by a live run, holds files that are not
    an equishard run's, or holds a run and neither `resume` nor `overwrite` is given.
    """
    if resume and overwrite:
        raise CheckpointError("--overwrite and --resume exclude each other: continue the run, or move it aside.")
    lock = RunLock(run_dir, print_fn)
    try:
        _check_and_mark(run_dir, checkpoint_dir, resume=resume, overwrite=overwrite, print_fn=print_fn)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_and_mark(
    run_dir: pathlib.Path, checkpoint_dir: pathlib.Path, *, resume: bool, overwrite: bool, print_fn: Callable[[str], None]
) -> None:
    files = _files(run_dir)
    marked = (run_dir / MARKER).exists()
    if files and not marked and not (resume and checkpoint_dir.is_dir()):
        names = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
        raise CheckpointError(
            f"--run-dir {run_dir} is not empty ({names}) and holds no equishard run (no "
            f"{MARKER} file): equishard writes only into an empty directory or its own run's; "
            f"choose another --run-dir. Nothing was written."
        )
    if files and marked and not (resume or overwrite):
        raise CheckpointError(
            f"--run-dir {run_dir} holds an earlier equishard run ({len(files)} file(s)); pass "
            f"--resume to continue it, or --overwrite to move its files into "
            f"{run_dir}/{PREVIOUS}<UTC time>/ and start anew. Nothing was written."
        )
    if overwrite:
        outside = [] if checkpoint_dir.is_relative_to(run_dir) else _files(checkpoint_dir)
        for directory, entries in ((run_dir, files), (checkpoint_dir, outside)):
            if entries:
                print_fn(f"--overwrite: moved {len(entries)} file(s) of the earlier run into {move_aside(directory, entries)}")
    if not marked:
        write_atomically(run_dir / MARKER, json.dumps({"equishard_run": True, "created": _utc()}) + "\n")
