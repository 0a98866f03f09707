"""A run directory belongs to one run: its marker files, its lock, `--overwrite`.

A run writes into two directories: the run directory and its checkpoint directory
(`<run-dir>/checkpoints`, or `--checkpoint-dir` elsewhere). Each must be empty, or
marked as equishard's by the marker file `.equishard-run`, whose record names what
equishard writes there (the run directory's files, the checkpoint directory's steps)
and the `previous-*` directories `--overwrite` made. A marked directory with a run in
it is written to only with `--resume` (continue it) or `--overwrite` (move the recorded
files, and only those, into `previous-<UTC time>/` beside them: nothing is deleted; a
user's own files stay where they are). A run directory inside its checkpoint directory,
or the same directory for both, is refused. The markers are written only once every
check of the run has passed (a refused `--resume` writes nothing).

While the run lives the run directory holds the lock file `.equishard-lock`, locked
with `fcntl.flock` and naming the process id and host of the run (under `equishard
launch`, process 0's); a second run on the directory is refused naming them, and a lock
file that no living process holds is reported as stale and taken over (atomically: the
OS lock decides which of two starting runs takes it). On a network file system that
does not honour `flock` across hosts, the named host and process are the guard.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import pathlib
import socket
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError
from ._config import CONFIG_FILE
from ._metrics import METRICS_FILE
from ._profile import PROFILE_DIR
from ._tensorboard import TENSORBOARD_DIR

MARKER = ".equishard-run"
LOCK = ".equishard-lock"
PREVIOUS = "previous-"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, "loss.png", "model.eqx", TENSORBOARD_DIR, PROFILE_DIR)
"""What `equishard train` writes into a run directory (`_run.py`: the plot, the model),
besides its checkpoint directory when that is inside."""


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


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


class RunLock:
    """The lock of a run directory, held until `release()` (see the module's text).

    **Raises:**

    `CheckpointError` if another run holds it (naming its process and host), or if the
    lock file cannot be created or written (a full disk, a read-only directory).
    """

    def __init__(self, directory: pathlib.Path, print_fn: Callable[[str], None]):
        self.path = directory / LOCK
        self._me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _utc()}
        self._fd: int | None = None
        for _ in range(3):
            fd = self._open_locked()
            if fd is None:  # the file was replaced between opening and locking it
                continue
            try:
                self._take_over_if_stale(fd, print_fn)
                self._write(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        raise CheckpointError(f"cannot lock {directory}: {self.path} keeps being replaced.")

    def _open_locked(self) -> int | None:
        """The lock file, opened (created if need be) and `flock`-ed by this run; `None`
        if the path no longer names the file locked."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as err:
            raise CheckpointError(
                f"cannot create the lock file {self.path} ({_reason(err)}); nothing was written."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(_holder(self.path)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def _in_use(self, holder: dict[str, Any] | None) -> CheckpointError:
        holder = holder or {}
        return CheckpointError(
            f"{self.path.parent} is in use by another run (pid {holder.get('pid')} on host "
            f"{holder.get('host')}, started {holder.get('started')}); wait for it to end or "
            f"choose another --run-dir."
        )

    def _take_over_if_stale(self, fd: int, print_fn: Callable[[str], None]) -> None:
        """This run holds the OS lock: a holder named in the file is gone, unless it is
        alive on this host or on another host (a lock file not locked with `flock`)."""
        text = os.pread(fd, 4096, 0)
        if not text:
            return
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        if not isinstance(holder, dict):
            print_fn(f"note: taking over the lock of {self.path.parent} (no run holds {self.path}).")
            return
        pid, host = holder.get("pid"), holder.get("host")
        if host != self._me["host"] or not isinstance(pid, int) or _alive(pid):
            raise self._in_use(holder)
        print_fn(
            f"note: taking over the stale lock of {self.path.parent} (pid {pid} on this host, "
            f"{host}, is gone)."
        )

    def _write(self, fd: int) -> None:
        data = json.dumps(self._me).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the lock file {self.path} ({_reason(err)}); nothing else was written."
            ) from None

    def release(self) -> None:
        """Remove the lock file if it is still this run's, then drop the OS lock."""
        if self._fd is None:
            return
        if _holder(self.path) == self._me:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _read_marker(directory: pathlib.Path) -> dict[str, Any] | None:
    """The record of a marked directory (`{}` for an early marker without one), or `None`."""
    path = directory / MARKER
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _is_checkpoint_entry(name: str) -> bool:
    """What a `Checkpointer` writes: step directories and their temporary forms."""
    return name.isdigit() or ".orbax-checkpoint-tmp" in name


@dataclasses.dataclass
class _Listing:
    """A directory's entries: equishard's (recorded) and everything else."""

    ours: list[pathlib.Path]
    others: list[pathlib.Path]
    record: dict[str, Any] | None

    def names(self, which: str) -> str:
        entries = getattr(self, which)
        return ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")


def _list(directory: pathlib.Path, owned: Callable[[str, dict[str, Any]], bool]) -> _Listing:
    record = _read_marker(directory)
    skip = {MARKER, LOCK, *((record or {}).get("previous") or [])}
    entries = sorted(p for p in directory.iterdir() if p.name not in skip) if directory.is_dir() else []
    ours = [p for p in entries if owned(p.name, record or {})]
    return _Listing(ours, [p for p in entries if p not in ours], record)


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


@dataclasses.dataclass
class Claim:
    """A run's hold on its directories: the lock, and the markers to write once every
    check of the run has passed (`mark`)."""

    lock: RunLock
    run_dir: pathlib.Path
    checkpoint_dir: pathlib.Path
    files: tuple[str, ...]
    previous: dict[pathlib.Path, list[str]]

    def mark(self) -> None:
        """Write the markers (or add the `previous-*` directories to their records)."""
        _write_marker(self.run_dir, {"equishard_run": True, "files": list(self.files)}, self.previous)
        if not self.checkpoint_dir.is_relative_to(self.run_dir):
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            record = {"equishard_checkpoints": True, "run_dir": str(self.run_dir)}
            _write_marker(self.checkpoint_dir, record, self.previous)

    def release(self) -> None:
        """Release the lock."""
        self.lock.release()


def _write_marker(directory: pathlib.Path, record: dict[str, Any], previous: dict[pathlib.Path, list[str]]) -> None:
    old = _read_marker(directory)
    new = {**record, "created": (old or {}).get("created", _utc())}
    new["previous"] = [*((old or {}).get("previous") or []), *previous.get(directory, [])]
    if old != new:
        write_atomically(directory / MARKER, json.dumps(new) + "\n")


def _refuse_overlap(run_dir: pathlib.Path, checkpoint_dir: pathlib.Path) -> None:
    run, checkpoints = run_dir.resolve(), checkpoint_dir.resolve()
    if run == checkpoints:
        raise CheckpointError(
            f"--checkpoint-dir {checkpoint_dir} is the run directory itself: give the "
            f"checkpoints a directory of their own (the default is {run_dir}/checkpoints). "
            f"Nothing was written."
        )
    if run.is_relative_to(checkpoints):
        raise CheckpointError(
            f"--run-dir {run_dir} is inside --checkpoint-dir {checkpoint_dir}: one run's "
            f"directories may not nest that way (--overwrite would move the run directory "
            f"with the checkpoints); choose a run directory outside it. Nothing was written."
        )


def claim(
    run_dir: pathlib.Path,
    checkpoint_dir: pathlib.Path,
    *,
    resume: bool,
    overwrite: bool,
    print_fn: Callable[[str], None],
) -> Claim:
    """Lock `run_dir` for this run and check that the run may write into it and into
    `checkpoint_dir` (see the module's text). Nothing is written but the lock file and,
    with `overwrite`, the earlier run's files moved aside; the markers are written by
    `Claim.mark()`, once the run's own checks have passed.

    **Arguments:**

    - `run_dir`: the run directory (it exists).
    - `checkpoint_dir`: the run's checkpoints (inside `run_dir` or elsewhere).
    - `resume`: the run continues the directories' run.
    - `overwrite`: the directories' run is moved into `previous-<UTC time>/`.
    - `print_fn`: where notes go (a stale lock taken over, files moved).

    **Returns:**

    The claim (`mark()` it before writing, `release()` it when the run ends).

    **Raises:**

    `CheckpointError` if the directories overlap, the run directory is locked by a live
    run, either directory holds files that are not an equishard run's and no marker, or
    holds a run and neither `resume` nor `overwrite` is given.
    """
    if resume and overwrite:
        raise CheckpointError("--overwrite and --resume exclude each other: continue the run, or move it aside.")
    _refuse_overlap(run_dir, checkpoint_dir)
    lock = RunLock(run_dir, print_fn)
    try:
        inside = checkpoint_dir.is_relative_to(run_dir)
        files = (*RUN_FILES, *((checkpoint_dir.relative_to(run_dir).parts[0],) if inside else ()))
        run = _list(run_dir, lambda name, record: name in record.get("files", files))
        _check_run_dir(run_dir, run, checkpoint_dir, resume=resume, overwrite=overwrite)
        checkpoints = _list(checkpoint_dir, lambda name, record: _is_checkpoint_entry(name))
        if not inside and checkpoints.others and checkpoints.record is None:
            raise CheckpointError(
                f"--checkpoint-dir {checkpoint_dir} holds files that equishard did not write "
                f"({checkpoints.names('others')}) and no {MARKER} file: a run writes only into an "
                f"empty directory or its own; choose another --checkpoint-dir. Nothing was written."
            )
        previous: dict[pathlib.Path, list[str]] = {}
        if overwrite:
            # A checkpoint directory inside the run directory moves whole, unless it holds
            # files of the user's: then its steps move into its own previous-*, as outside.
            if inside and checkpoints.others:
                run.ours = [p for p in run.ours if not checkpoint_dir.is_relative_to(p)]
            elif inside:
                checkpoints.ours = []
            for directory, listing in ((run_dir, run), (checkpoint_dir, checkpoints)):
                if listing.ours:
                    moved = move_aside(directory, listing.ours)
                    previous[directory] = [moved.name]
                    print_fn(f"--overwrite: moved {len(listing.ours)} file(s) of the earlier run into {moved}")
    except BaseException:
        lock.release()
        raise
    return Claim(lock, run_dir, checkpoint_dir, files, previous)


def _check_run_dir(run_dir: pathlib.Path, run: _Listing, checkpoint_dir: pathlib.Path, *, resume: bool, overwrite: bool) -> None:
    entries = run.ours + run.others
    if run.record is None and entries and not (resume and checkpoint_dir.is_dir()):
        names = ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise CheckpointError(
            f"--run-dir {run_dir} is not empty ({names}) and holds no equishard run (no "
            f"{MARKER} file): equishard writes only into an empty directory or its own run's; "
            f"choose another --run-dir. Nothing was written."
        )
    if run.record is not None and run.ours and not (resume or overwrite):
        raise CheckpointError(
            f"--run-dir {run_dir} holds an earlier equishard run ({len(run.ours)} file(s)); pass "
            f"--resume to continue it, or --overwrite to move its files into "
            f"{run_dir}/{PREVIOUS}<UTC time>/ and start anew. Nothing was written."
        )
