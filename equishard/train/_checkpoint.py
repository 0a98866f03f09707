"""Checkpoints with orbax-checkpoint, restored onto any layout.

**What a checkpoint holds.** One flat dictionary `{path: array}` of the saved pytree's
arrays, saved by orbax's `StandardSave` under the item `arrays`, and a JSON item `meta`
(see `equishard.train._format`): a template that does not fit is diagnosed, naming the
first differing path, before orbax reads any array.

**Layout.** `Checkpointer.restore` places each array where the template says (the
template's shardings, or its specs on a given mesh): a checkpoint saved under
`fsdp=8` restores under `dp=2,tp=4` with no conversion step, since orbax reads each
device's block of the global array directly.

**The trained part.** With a trainable filter (`save(..., trainable=step.trainable)`) a
step holds the trainable arrays, their optimizer state and the state's counters and key,
and the metadata's `base` records the frozen arrays' stored paths and fingerprint
(`equishard.train.base_fingerprint`); `restore(..., base=model)` takes them from the
model given and refuses one whose fingerprint differs. The stored arrays are checksummed
and verified as in a full checkpoint.

**Safety.** A step is written into a temporary directory
(`<step>.orbax-checkpoint-tmp-*`) and renamed into place only when complete, so a
process killed mid-write leaves no step that looks good; such leftovers are ignored and
removed when the directory is next opened. Nothing is ever written over an existing
step: saving a step that exists raises `CheckpointError` (or, with `exist_ok=True`,
leaves it untouched). Saves are asynchronous; close the `Checkpointer` before the
program ends, or the step still being written is discarded (never half-kept).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jaxtyping import PyTree
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from .._errors import CheckpointError
from .._text import first_line
from ..sharding import is_sharded
from ._base import base_entries, fingerprint, frozen_keys
from ._format import (
    FORMAT,
    FORMAT_VERSION,
    Entry,
    array_record,
    check_fits,
    checksums,
    flatten,
    rebuild,
    storable,
    target,
)

_ARRAYS = "arrays"
_META = "meta"
_TMP_MARKER = ".orbax-checkpoint-tmp"
_DELETED = "-deleted"
_COMMITTED = "_CHECKPOINT_METADATA"  # orbax writes it into a step before renaming it in place


def committed_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps saved completely in a checkpoint directory, read from its listing alone
    (no orbax manager: usable while one is interrupted).

    **Arguments:**

    - `directory`: the checkpoint directory.

    **Returns:**

    The steps, oldest first (none if the directory does not exist).
    """
    path = pathlib.Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / _COMMITTED).is_file())


# ---------------------------------------------------------------------------------------
# Directories, faults and the background writer
# ---------------------------------------------------------------------------------------

FAULT_ENV = "EQUISHARD_CHECKPOINT_FAULT"
"""Environment variable naming a point of a save at which the process kills itself.

Its value is `<point>` or `<point>:<step>`, the point one of `FAULT_POINTS`. Fault tests
set it in a child process to interrupt a save at a deterministic moment."""

FAULT_POINTS = ("before-write", "arrays-written", "committed", "pruning")


def _fault_point(point: str, step: int) -> None:
    """SIGKILL this process here if `EQUISHARD_CHECKPOINT_FAULT` names this point (and step)."""
    wanted = os.environ.get(FAULT_ENV)
    if wanted and wanted in (point, f"{point}:{step}"):
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def probe_writable(directory: str | os.PathLike[str], what: str) -> pathlib.Path:
    """Create `directory` if needed and check that files can be created and removed in it.

    **Arguments:**

    - `directory`: the directory.
    - `what`: how errors name it ("checkpoint directory", "run directory").

    **Returns:**

    The directory, absolute.

    **Raises:**

    `CheckpointError` naming the directory if it is a file, cannot be created, or is
    not writable (a file is created in it and removed).
    """
    path = pathlib.Path(directory).absolute()
    _refuse_file(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".equishard-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise _unusable(path, what, err) from None
    return path


def _unusable(path: pathlib.Path, what: str, err: OSError) -> CheckpointError:
    reason = err.strerror or type(err).__name__
    return CheckpointError(
        f"the {what} {path} is not usable: {reason} ({err.filename or path}); choose a "
        f"directory this process can create and write to."
    )


def _refuse_file(path: pathlib.Path, what: str) -> None:
    """Raise if `path` is a file, or cannot even be looked at."""
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as err:
        raise _unusable(path, what, err) from None
    if is_file:
        raise CheckpointError(f"the {what} {path} is a file, not a directory; choose another path.")


class _Recorded:
    """A commit future whose failure is kept for the checkpointer to report."""

    def __init__(self, inner: Any, errors: list[BaseException]):
        self._inner = inner
        self._errors = errors

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._inner.result(timeout=timeout)
        except BaseException as err:
            self._errors.append(err)
            raise


class _ArraysHandler(ocp.StandardCheckpointHandler):
    """orbax's array handler, keeping background write errors and marking a fault point."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[BaseException] = []
        self.step = -1

    async def async_save(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
        futures = await super().async_save(directory, *args, **kwargs)
        return [_Recorded(f, self.errors) for f in futures or []]

    def finalize(self, directory: Any) -> None:
        _fault_point("arrays-written", self.step)
        super().finalize(directory)


@ocp.args.register_with_handler(_ArraysHandler, for_save=True)
class _ArraysSave(ocp.args.StandardSave):
    """`StandardSave` for `_ArraysHandler`."""


@ocp.args.register_with_handler(_ArraysHandler, for_restore=True)
class _ArraysRestore(ocp.args.StandardRestore):
    """`StandardRestore` for `_ArraysHandler`."""


# ---------------------------------------------------------------------------------------
# The checkpointer
# ---------------------------------------------------------------------------------------


def _close_manager(manager: ocp.CheckpointManager) -> None:
    manager.wait_until_finished()
    manager.close()


_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _warn_unfinished() -> None:
    """Say so when a program ends before its last asynchronous save was finalised.

    orbax writes in background threads that need new threads from thread pools, which
    the interpreter refuses to start once it is shutting down (Python 3.12 refuses even
    in `threading`'s exit hooks), so the write cannot be finished here: it stays a
    temporary directory, which is ignored. `Checkpointer.close()` prevents this.
    """
    for checkpointer in list(_OPEN):
        step = checkpointer._pending
        if step is not None and not (checkpointer.directory / str(step)).is_dir():
            print(
                f"equishard: the checkpoint of step {step} in {checkpointer.directory} was "
                f"still being written when the program ended and is discarded; call "
                f"Checkpointer.close() (or use `with Checkpointer(...)`) before exiting.",
                file=sys.stderr,
            )


class Checkpointer:
    """Save and restore training states in a directory of numbered steps (orbax).

    ```python
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=3, metadata=config)
    ckpt.check_writable()                      # before compiling: fail fast
    ckpt.save(int(state.step), state)          # returns once arrays are on the host
    ckpt.poll()                                # each step: a failed background write raises
    ...
    like = eqx.filter_eval_shape(make_state)   # or a real state
    state = ckpt.restore(like, mesh=mesh)       # the latest step, on this mesh, verified
    ckpt.close()
    ```

    Saves are asynchronous: `save` returns once the arrays are copied off the devices
    (so the state may then be donated to the next step) and the files are written in
    the background. `poll()` raises if that write failed (a full disk) and returns at
    once otherwise; `wait()` blocks until it is done; `close()` (or leaving a `with`
    block) waits and releases the manager. **Close it before the program ends**: a
    write still running at exit cannot be finished (orbax's threads are stopped) and
    the step is discarded, never half-written (equishard prints a warning).

    **Integrity.** Each step records a 64-bit checksum of every global array, computed
    on the devices that hold it (a sum that does not depend on how the array is split,
    so it verifies under any layout and process count); `restore` recomputes it and
    raises `CheckpointError` on a mismatch, naming the array and the newest earlier
    step that is intact. Old steps are removed (`max_to_keep`) only once a newer step is
    completely written, and by renaming them away first, so an interrupted removal
    leaves no damaged step behind.

    In a multi-process run every process creates the `Checkpointer` on the same
    directory (a file system all of them see) and calls `save` and `restore` together.

    **Arguments:**

    - `directory`: the checkpoint directory; created at the first save (or by
      `check_writable`).
    - `max_to_keep`: keep only the newest this many steps (`None`: keep all).
    - `metadata`: a JSON-serialisable mapping stored with every step (e.g. the model
      configuration), returned by `read_metadata()["user"]` and quoted in errors.
    - `async_save`: write in the background (default); `False` makes `save` return
      only once the step is complete.
    - `path_map`: maps each array's pytree path (`model.units.module.mlp.w`) to the key
      it is stored and looked up under, on save and on restore. Give one when the same
      model has different pytree paths under different layouts (e.g. an `FSDP` wrapper
      adds `.module`): `lambda p: p.replace(".module.", ".")`. Shapes must still agree.
    - `checksums`: record checksums at save and verify them at restore (default). It
      costs one read of every array on its devices per save and per restore.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        metadata: Mapping[str, Any] | None = None,
        async_save: bool = True,
        path_map: Callable[[str], str] | None = None,
        checksums: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be at least 1 or None, got {max_to_keep}.")
        self._directory = pathlib.Path(directory).absolute()
        _refuse_file(self._directory, "checkpoint directory")
        self._user_metadata = dict(metadata or {})
        try:
            json.dumps(self._user_metadata)
        except TypeError as err:
            raise CheckpointError(
                f"the checkpoint metadata for {self._directory} must be JSON-serialisable "
                f"({err})."
            ) from None
        self._path_map = path_map
        self._max_to_keep = max_to_keep
        self._checksums = checksums
        self._refuse_strays()
        self._interrupted = self._interrupted_writes()
        self._remove_leftovers()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # removed here, once a newer step is known to be complete
            create=False,
            # Removed here, synchronously: orbax's own clean-up runs in a thread that it
            # joins only at the next save, and fails at exit if there is none.
            cleanup_tmp_directories=False,
            enable_async_checkpointing=async_save,
            # The step's directories are made in `save`, not by a thread of their own: if
            # the program ends mid-save, orbax's writer threads waited on that thread's
            # signal, which never came under Python 3.12 (no new threads at shutdown),
            # until orbax's timeout, holding the exit for minutes.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self._arrays_handler = _ArraysHandler()
        self._manager = ocp.CheckpointManager(
            self._directory,
            options=options,
            item_handlers={_ARRAYS: self._arrays_handler, _META: ocp.JsonCheckpointHandler()},
        )
        self._pending: int | None = None
        # Closing on garbage collection; not at exit, where orbax can no longer write.
        self._finalizer = weakref.finalize(self, _close_manager, self._manager)
        self._finalizer.atexit = False
        _OPEN.add(self)

    @property
    def directory(self) -> pathlib.Path:
        """The checkpoint directory (absolute)."""
        return self._directory

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self._directory)!r}, steps={self.all_steps()})"

    def check_writable(self) -> None:
        """Create the directory if needed and check that it is writable.

        Call it before compiling a long run, so that a directory that is a file or
        read-only is found before the first save rather than after it.

        **Raises:**

        `CheckpointError` naming the directory and the reason.
        """
        probe_writable(self._directory, "checkpoint directory")

    # -- listing -------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps in the directory, oldest first.

        **Returns:**

        The steps found when the directory was opened plus those saved since (a step
        whose asynchronous write is still running is included; `wait()` first to
        count only finished ones).
        """
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step, or `None` if there is none (see `all_steps`).

        **Returns:**

        An `int` or `None`.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _refuse_strays(self) -> None:
        """Refuse a file or directory named like a step that is not a saved step: orbax
        would count it as one, and remove it among the oldest (`max_to_keep`)."""
        if not self._directory.is_dir():
            return
        saved = committed_steps(self._directory)
        strays = sorted(p.name for p in self._directory.iterdir() if p.name.isdigit() and int(p.name) not in saved)
        if strays:
            raise CheckpointError(
                f"{self._directory} holds {', '.join(strays)}, named like checkpoint steps but not "
                f"saved ones (no {_COMMITTED} in them); equishard never removes what it did not "
                f"write: move them out of the directory, then start again."
            )

    def _interrupted_writes(self) -> list[str]:
        if not self._directory.is_dir():
            return []
        return sorted(
            p.name
            for p in self._directory.iterdir()
            if _TMP_MARKER in p.name and not p.name.endswith(_DELETED)
        )

    def _remove_leftovers(self) -> None:
        """Delete the temporary directories of interrupted writes and removals (process 0)."""
        if jax.process_index() != 0 or not self._directory.is_dir():
            return
        for path in self._directory.iterdir():
            if _TMP_MARKER in path.name:
                shutil.rmtree(path, ignore_errors=True)

    def _where(self, step: int) -> str:
        return f"the checkpoint at step {step} in {self._directory}"

    # -- saving --------------------------------------------------------------------------

    def save(
        self, step: int, state: PyTree, *, exist_ok: bool = False, trainable: Any = None,
        base_source: str | None = None,
    ) -> bool:
        """Save `state` as checkpoint `step`, asynchronously.

        **Arguments:**

        - `step`: the step number (a non-negative integer), also the directory name.
        - `state`: any pytree of (possibly sharded) arrays, `Sharded` boxes and other
          leaves; only its arrays are stored (see the module documentation).
        - `exist_ok`: what to do if this step already exists. `False` (default): raise
          `CheckpointError`. `True`: leave the existing checkpoint untouched and return
          `False` (for "save at the end" after a periodic save of the same step).
          An existing step is never written over.
        - `trainable`: save the trained part only (`None`: every array). The train step's
          trainable filter (`step.trainable`, or what `make_train_step(trainable=)`
          takes): `state` is a `TrainState` whose `model`'s frozen arrays are left out,
          with a fingerprint of them (`base_fingerprint`) recorded in the metadata
          (`read_metadata()["base"]`); `restore(..., base=model)` takes them from the
          model it is given and refuses one of another fingerprint.
        - `base_source`: a description of the base recorded beside its fingerprint (e.g.
          the Hugging Face folder it was loaded from), quoted in errors.

        **Returns:**

        `True` if a save was started, `False` if the step existed and `exist_ok` was set.

        **Raises:**

        `CheckpointError` if the step exists (and not `exist_ok`), an array cannot be
        saved (a tracer, or an array already donated), or the previous save failed in
        the background.
        """
        step = int(step)
        if step < 0:
            raise CheckpointError(f"checkpoint steps are non-negative, got {step}.")
        self._settle(block=True)
        if step in self.all_steps():
            if exist_ok:
                return False
            raise CheckpointError(
                f"{self._where(step)} already exists, and equishard never writes over a "
                f"checkpoint; save under another step, or move that step away first."
            )
        _, _, entries = flatten(state, self._path_map)
        base = None
        if trainable is not None:
            entries, base = self._trained_part(state, entries, trainable, base_source)
        if not entries:
            raise CheckpointError(
                f"nothing to save at step {step} in {self._directory}: the state holds no arrays."
            )
        arrays = {e.path: storable(e) for e in entries}
        records = [array_record(e) for e in entries]
        if self._checksums:
            sums = checksums(arrays)
            for record in records:
                record["checksum"] = sums[record["path"]]
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "versions": _versions(),
            "user": self._user_metadata,
            "arrays": records,
            **({} if base is None else {"base": base}),
        }
        args = ocp.args.Composite(
            **{_ARRAYS: _ArraysSave(arrays), _META: ocp.args.JsonSave(meta)}
        )
        self._directory.mkdir(parents=True, exist_ok=True)
        _fault_point("before-write", step)
        self._arrays_handler.step = step
        self._arrays_handler.errors.clear()
        try:
            self._manager.save(step, args=args, force=True)
        except StepAlreadyExistsError:
            raise CheckpointError(
                f"{self._where(step)} already exists, and equishard never writes over a "
                f"checkpoint; save under another step, or move that step away first."
            ) from None
        except Exception as err:  # noqa: BLE001 - the write failed before going to the background
            self._manager.reload()
            raise CheckpointError(
                f"writing {self._where(step)} failed ({first_line(err)}); the step was not "
                f"finalised and is ignored. The steps before it are untouched: "
                f"{self.all_steps()}."
            ) from None
        self._pending = step
        self._settle(block=False)
        return True

    def _trained_part(
        self, state: PyTree, entries: list[Entry], trainable: Any, source: str | None
    ) -> tuple[list[Entry], dict[str, Any]]:
        """The entries of `state`'s trained part and the record of its frozen base."""
        model = getattr(state, "model", None)
        if model is None:
            raise CheckpointError(
                f"save(trainable=...) in {self._directory}: the state has no `model` to take "
                f"the frozen arrays from; give the TrainState."
            )
        keys = frozen_keys(model, trainable, self._path_map)
        frozen = [e for e in entries if e.path in keys]
        record = {
            "fingerprint": fingerprint(frozen),
            "source": source,
            "frozen": sorted(keys),
        }
        return [e for e in entries if e.path not in keys], record

    def _settle(self, *, block: bool) -> None:
        """Account for the last save once it has finished: raise if it failed, else prune.

        With `block=False` this returns at once while the write is still running.
        """
        step = self._pending
        if step is None or (not block and self._manager.is_saving_in_progress()):
            return
        self._pending = None
        error: BaseException | None = None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as err:  # noqa: BLE001 - any failure of the background write
            error = err
        errors = self._arrays_handler.errors
        error = errors[0] if errors else error
        if error is not None or not (self._directory / str(step)).is_dir():
            self._manager.reload()
            cause = f" ({first_line(error)})" if error is not None else ""
            raise CheckpointError(
                f"writing {self._where(step)} failed in the background{cause}; the step was "
                f"not finalised and is ignored. The steps before it are untouched: "
                f"{self.all_steps()}."
            )
        _fault_point("committed", step)
        self._prune()

    def _prune(self) -> None:
        """Remove the oldest steps beyond `max_to_keep`: renamed away first, then deleted."""
        if self._max_to_keep is None:
            return
        doomed = self.all_steps()[: -self._max_to_keep]
        if not doomed:
            return
        if jax.process_index() == 0:
            for step in doomed:
                gone = self._directory / f"{step}{_TMP_MARKER}{_DELETED}"
                os.replace(self._directory / str(step), gone)
                _fault_point("pruning", step)
                shutil.rmtree(gone, ignore_errors=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"equishard checkpoint prune {doomed[-1]}")
        self._manager.reload()

    def poll(self) -> None:
        """Raise if the last background save failed; return at once while it runs.

        Call it once per training step: a write that failed (a full disk) is then
        reported at the next step, not two saves later.

        **Raises:**

        `CheckpointError` naming the step and the cause; the earlier steps are intact.
        """
        self._settle(block=False)

    def wait(self) -> None:
        """Block until every save started so far is completely written.

        **Raises:**

        `CheckpointError` if a background write failed.
        """
        self._settle(block=True)
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - any failure of the background write
            raise CheckpointError(
                f"writing a checkpoint in {self._directory} failed ({first_line(err)}); "
                f"the incomplete step was not finalised and will be ignored."
            ) from None

    def close(self, *, quiet: bool = False) -> None:
        """Wait for pending saves and release the manager. Safe to call twice.

        **Arguments:**

        - `quiet`: raise nothing (for closing while another error is being reported,
          which a failure of the same write must not replace).

        **Raises:**

        `CheckpointError` if the last save failed or orbax fails to release the manager
        (never orbax's own error); the manager is released regardless.
        """
        if not self._finalizer.alive:
            return
        error: CheckpointError | None = None
        try:
            self.wait()
        except CheckpointError as err:
            error = err
        finally:
            _OPEN.discard(self)
            try:
                self._finalizer()
            except Exception as err:  # noqa: BLE001 - orbax's close of a failed write
                error = error or CheckpointError(
                    f"closing the checkpoints in {self._directory} failed ({first_line(err)}); "
                    f"the steps there: {committed_steps(self._directory)}."
                )
        if error is not None and not quiet:
            raise error

    # -- restoring -----------------------------------------------------------------------

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None and steps:
            return steps[-1]
        if step is not None and int(step) in steps:
            return int(step)
        if not self._directory.exists():
            raise CheckpointError(
                f"cannot restore: the checkpoint directory {self._directory} does not exist."
            )
        if not steps:
            raise CheckpointError(self._no_checkpoint_message())
        raise CheckpointError(
            f"cannot restore step {step}: {self._directory} holds no such checkpoint; "
            f"its steps are {steps}."
        )

    def _no_checkpoint_message(self) -> str:
        message = f"cannot restore: there is no checkpoint in {self._directory}"
        if self._interrupted:
            shown = ", ".join(self._interrupted[:3])
            message += (
                f"; {len(self._interrupted)} interrupted write(s) were found and ignored "
                f"({shown})"
            )
        elif (self._directory / "_CHECKPOINT_METADATA").exists():
            message += "; it looks like one step's directory: pass its parent directory"
        else:
            names = sorted(p.name for p in self._directory.iterdir())[:5]
            if names:
                message += f"; it contains {', '.join(names)}"
        return message + "."

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of a step.

        **Arguments:**

        - `step`: the step (default: the latest).

        **Returns:**

        A dict with `format`, `format_version`, `step`, `versions` (equishard, jax,
        orbax), `user` (the `metadata` given to the `Checkpointer` that saved it) and
        `arrays` (one `{path, shape, dtype, spec, checksum}` record per stored array;
        no `checksum` where it was saved with `checksums=False`).

        **Raises:**

        `CheckpointError` if the directory or step is missing or the metadata unreadable.
        """
        self.wait()
        step = self._resolve_step(step)
        try:
            args = ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
            out = self._manager.restore(step, args=args)
            meta = out[_META]
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"{self._where(step)} is corrupt or incomplete: its metadata could not be "
                f"read ({first_line(err)}). Restore another step ({self.all_steps()})."
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"{self._where(step)} is not an equishard checkpoint (its metadata has no "
                f"format {FORMAT!r})."
            )
        version = meta.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            saved_by = meta.get("versions", {}).get("equishard", "unknown")
            raise CheckpointError(
                f"{self._where(step)} has checkpoint format version {version} (written by "
                f"equishard {saved_by}), newer than the version {FORMAT_VERSION} this "
                f"equishard reads; restore it with that equishard or a newer one."
            )
        return meta

    def _read(self, meta: Mapping[str, Any], like: PyTree, mesh: Mesh | None) -> tuple[Any, str | None]:
        """Read and verify one step: the restored tree, or why it is damaged."""
        step = int(meta["step"])
        where = self._where(step)
        leaves, treedef, entries = flatten(like, self._path_map)
        # A checkpoint of the trained part: the frozen arrays are `like`'s own (the base).
        frozen = set(meta.get("base", {}).get("frozen", ()))
        for e in (e for e in entries if e.path in frozen):
            leaves[e.index] = _placed(leaves[e.index], e, mesh)
        entries = [e for e in entries if e.path not in frozen]
        saved = check_fits(meta, entries, where)
        targets = {e.path: target(e, mesh, where) for e in entries}
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(**{_ARRAYS: _ArraysRestore(targets)})
            )
            arrays = out[_ARRAYS]
        except Exception as err:  # noqa: BLE001
            return None, f"its arrays could not be read ({first_line(err)})"
        if self._checksums:
            recorded = {p: r["checksum"] for p, r in saved.items() if "checksum" in r}
            found = checksums({p: arrays[p] for p in recorded})
            for e in entries:
                if e.path in recorded and found[e.path] != recorded[e.path]:
                    return None, (
                        f"the array `{e.path}` reads back with checksum {found[e.path]}, "
                        f"but {recorded[e.path]} was recorded when it was saved (its files "
                        f"were changed or damaged on disk)"
                    )
        for e in entries:
            leaves[e.index] = rebuild(leaves[e.index], e, arrays[e.path], saved[e.path])
        return jax.tree_util.tree_unflatten(treedef, leaves), None

    def _intact_before(self, step: int, like: PyTree, mesh: Mesh | None) -> int | None:
        """The newest step before `step` that restores into `like` and verifies."""
        for earlier in reversed([s for s in self.all_steps() if s < step]):
            try:
                restored, damage = self._read(self.read_metadata(earlier), like, mesh)
            except CheckpointError:
                continue
            del restored
            if damage is None:
                return earlier
        return None

    def _with_base(self, meta: Mapping[str, Any], like: PyTree, base: PyTree, source: str | None) -> PyTree:
        """`like` with its model's arrays taken from `base` if the step holds the trained
        part only, the base's fingerprint checked against the recorded one."""
        record = meta.get("base")
        if record is None:
            return like  # every array is stored: the base is not needed
        where = self._where(int(meta["step"]))
        recorded = f"{record['fingerprint']}" + (f" (from {record['source']})" if record.get("source") else "")
        if base is None:
            raise CheckpointError(
                f"{where} holds the trained part of a model only: its {len(record['frozen'])} "
                f"frozen arrays (the base, fingerprint {recorded}) are not stored. Pass the "
                f"base model: restore(like, base=model)."
            )
        keys = set(record["frozen"])
        given = base_entries(base, keys, self._path_map)
        missing = sorted(keys - {e.path for e in given})
        if missing:
            raise CheckpointError(
                f"{where} was saved with the frozen array `{missing[0]}`, which the base given "
                f"lacks ({len(missing)} of {len(keys)} missing): the base is of another model "
                f"or layout naming (give the Checkpointer the path_map it was saved with)."
            )
        found = fingerprint(given)
        if found != record["fingerprint"]:
            mine = found + (f" (from {source})" if source else "")
            raise CheckpointError(
                f"{where} was trained on another base: its frozen arrays had the fingerprint "
                f"{recorded} when it was saved, and the base given has {mine}. Restore it "
                f"onto the base it was trained on."
            )
        return eqx.tree_at(lambda s: s.model, like, base)

    def restore(
        self, like: PyTree, step: int | None = None, *, mesh: Mesh | None = None,
        base: PyTree = None, base_source: str | None = None,
    ) -> PyTree:
        """Restore a step into the structure of `like`, placed where `like` says.

        Every array is checked against the checksum recorded when it was saved (unless
        the `Checkpointer` was made with `checksums=False`, or the step predates them).

        **Arguments:**

        - `like`: a template of the state: a real state or `eqx.filter_eval_shape` of
          the function that builds it. Its arrays give the structure, shapes and dtypes
          to expect (checked against the checkpoint first) and its non-array leaves are
          returned as they are.
        - `step`: the step to restore (default: the latest).
        - `mesh`: if given, each array is placed on this mesh by the spec its box
          carries (`specs_of(like)`; plain arrays are replicated) — how a checkpoint
          saved under one layout is restored under another. If not, each array takes
          the sharding of its template leaf (a real array's, or a `ShapeDtypeStruct`'s
          `sharding`), or, where the template has none, the first local device; a
          boxed leaf whose spec shards it then needs `mesh` (`eqx.filter_eval_shape`
          gives shape-only leaves without shardings).
        - `base`: for a checkpoint of the trained part (`save(..., trainable=...)`), the
          model whose frozen arrays it was trained on (e.g. freshly loaded, under any
          layout), of `like.model`'s structure: its fingerprint must be the recorded one,
          and the restored state holds its frozen arrays (the same buffers, placed on
          `mesh`: a donating train step consumes them). Unused for a full checkpoint.
        - `base_source`: a description of `base` for the error message.

        **Returns:**

        A pytree like `like` holding the restored arrays (keys re-wrapped as typed keys,
        NumPy leaves as NumPy arrays).

        **Raises:**

        `CheckpointError` (one paragraph naming the directory, step and offending path)
        if the directory or step is missing, the checkpoint is corrupt (an array does
        not match its checksum: the message names the newest earlier step that is
        intact), or it does not fit `like`, or it holds the trained part only and no `base`
        or one of another fingerprint is given (naming the recorded and the given
        fingerprints); `SpecError` if a spec does not fit `mesh`.
        """
        meta = self.read_metadata(step)
        step = int(meta["step"])
        like = self._with_base(meta, like, base, base_source)
        with _quiet_closed_loop():
            restored, damage = self._read(meta, like, mesh)
            if damage is None:
                return restored
            intact = self._intact_before(step, like, mesh)
        if intact is None:
            advice = f"No earlier step is intact (steps there: {self.all_steps()})."
        else:
            advice = (
                f"Step {intact} is intact (every array verified): restore it with "
                f"`step={intact}` (on the command line, `--resume-step {intact}`)."
            )
        raise CheckpointError(f"{self._where(step)} is corrupt or incomplete: {damage}. {advice}")


@contextlib.contextmanager
def _quiet_closed_loop() -> Iterator[None]:
    """Keep the reads of a failed restore from printing a traceback each: when one read
    fails, orbax's event loop closes while tensorstore's other reads are in flight, and
    each of their completions reports `RuntimeError: Event loop is closed` through
    `sys.unraisablehook` (about 15 raw tracebacks before the named error). Those, and
    only those, are dropped while a restore runs; its own error is raised as usual."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _placed(leaf: Any, entry: Entry, mesh: Mesh | None) -> Any:
    """A base's array (`leaf`, possibly boxed) placed by its spec on `mesh` (as it is
    without one)."""
    if mesh is None:
        return leaf
    value = jax.device_put(entry.value, target(entry, mesh, "").sharding)
    return leaf.with_value(value) if is_sharded(leaf) else value


def _versions() -> dict[str, str]:
    from .._version import __version__

    return {
        "equishard": __version__,
        "jax": jax.__version__,
        "orbax-checkpoint": getattr(ocp, "__version__", "unknown"),
    }


