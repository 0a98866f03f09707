"""Reliability, round 3 (issue 53): a run touches only the directories it owns and only
the files it wrote there; signals at any moment of `equishard train`; the train step's
contract checked by name."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import equishard as es
from equishard._app._rundir import LOCK, MARKER, RunLock, claim


def _snapshot(directory):
    """Every file under `directory` with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _plant(directory):
    """A user's own files (with names equishard might have ignored or matched)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "thesis.tex").write_text("\\section{mine}\n")
    (directory / "previous-notes.txt").write_text("not an earlier run\n")
    (directory / "photos").mkdir(exist_ok=True)
    (directory / "photos" / "a.jpg").write_bytes(bytes(range(256)))
    mine = ("thesis.tex", "previous-notes.txt", "photos")
    return {k: v for k, v in _snapshot(directory).items() if k.parts[0] in mine}


def _gone_pid():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


# ---------------------------------------------------------------------------------------
# 1. The lock: atomic takeover, a full disk named
# ---------------------------------------------------------------------------------------


def test_a_stale_lock_is_taken_over_by_exactly_one_of_two_runs(tmp_path, monkeypatch):
    """Two runs start together on a directory whose lock names a dead process: in each
    of 200 trials (each run first in half of them) exactly one takes it over. The check
    that the holder is gone yields to the other run (a sleep), as a busy machine would."""
    from equishard._app import _rundir

    alive = _rundir._alive

    def slow_alive(pid):
        time.sleep(0.001)
        return alive(pid)

    monkeypatch.setattr(_rundir, "_alive", slow_alive)
    stale = json.dumps({"pid": _gone_pid(), "host": os.uname().nodename})
    for trial in range(200):
        (tmp_path / LOCK).write_text(stale)
        barrier, won, refused = threading.Barrier(2), [], []

        def start(delay):
            barrier.wait()
            for _ in range(delay):  # the other run's head start, in both orders
                pass
            try:
                won.append(RunLock(tmp_path, lambda line: None))
            except es.CheckpointError as err:
                refused.append(str(err))

        threads = [threading.Thread(target=start, args=(d,)) for d in ((0, 500) if trial % 2 else (500, 0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 1, (trial, refused)
        assert "is in use by another run" in refused[0]
        won[0].release()
        assert not (tmp_path / LOCK).exists()


def test_a_full_disk_at_the_lock_file_is_named(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(es.CheckpointError, match=r"cannot write the lock file .*\.equishard-lock \(No space left on device\)"):
        RunLock(tmp_path, print)
    monkeypatch.undo()
    monkeypatch.setattr(os, "open", full)
    with pytest.raises(es.CheckpointError, match=r"cannot create the lock file .*\(No space left on device\)"):
        RunLock(tmp_path, print)
    monkeypatch.undo()
    RunLock(tmp_path, print).release()  # nothing left behind that blocks the next run
    assert list(tmp_path.iterdir()) == [tmp_path / LOCK] or not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------
# 2. Both directories are the run's, or empty; --overwrite moves only what it recorded
# ---------------------------------------------------------------------------------------


def _claim(run, checkpoints, **kwargs):
    return claim(run, checkpoints, print_fn=lambda line: None, **{"resume": False, "overwrite": False, **kwargs})


def test_an_outside_checkpoint_directory_must_be_empty_or_marked(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "mine"
    run.mkdir()
    before = _plant(outside)
    for kwargs in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(es.CheckpointError) as info:
            _claim(run, outside, **kwargs)
        assert f"--checkpoint-dir {outside} holds files that equishard did not write (photos, previous-notes.txt, thesis.tex)" in str(info.value)
    assert _snapshot(outside) == before and list(run.iterdir()) == []


@pytest.mark.parametrize("nested", ["same", "run inside checkpoints"])
def test_nested_directories_are_refused_by_name(tmp_path, nested):
    checkpoints = tmp_path / "c"
    run = checkpoints if nested == "same" else checkpoints / "run"
    run.mkdir(parents=True)
    with pytest.raises(es.CheckpointError) as info:
        _claim(run, checkpoints)
    message = str(info.value)
    assert ("is the run directory itself" if nested == "same" else f"--run-dir {run} is inside --checkpoint-dir {checkpoints}") in message
    assert not any(checkpoints.rglob("*.equishard-*"))


def _fake_run(run, checkpoints):
    """What a run leaves: marked directories, its files, two steps."""
    held = _claim(run, checkpoints)
    held.mark()
    held.release()
    (run / "config.toml").write_text("steps = 2\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in ("1", "2"):
        (checkpoints / step).mkdir(parents=True)
        (checkpoints / step / "x").write_text(step)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_overwrite_moves_only_the_files_equishard_recorded(tmp_path, where):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints" if where == "inside" else tmp_path / "ckpt"
    run.mkdir()
    _fake_run(run, checkpoints)
    mine = {d: _plant(d) for d in (run, checkpoints)}  # the user's files, after the run began
    with pytest.raises(es.CheckpointError, match="holds an earlier equishard run"):
        _claim(run, checkpoints)
    notes = []
    held = claim(run, checkpoints, resume=False, overwrite=True, print_fn=notes.append)
    held.mark()
    held.release()
    assert any("moved 2 file(s)" in n for n in notes) and any(str(checkpoints) in n for n in notes)
    for directory, files in mine.items():
        after = _snapshot(directory)
        assert {k: after[k] for k in files} == files  # every user file where it was, unchanged
    assert not (run / "config.toml").exists() and not (checkpoints / "1").exists()
    moved = [p for p in run.iterdir() if p.name.startswith("previous-2")]
    assert len(moved) == 1 and (moved[0] / "config.toml").read_text() == "steps = 2\n"
    record = json.loads((run / MARKER).read_text())
    assert moved[0].name in record["previous"] and "previous-notes.txt" not in record["previous"]
    # A second --overwrite moves nothing of the user's and no earlier previous-*.
    held = claim(run, checkpoints, resume=False, overwrite=True, print_fn=notes.append)
    held.release()
    assert sum(p.name.startswith("previous-2") for p in run.iterdir()) == 1


def test_a_user_file_named_previous_does_not_make_a_directory_empty(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "previous-notes.txt").write_text("mine")
    with pytest.raises(es.CheckpointError, match=r"is not empty \(previous-notes.txt\)"):
        _claim(run, run / "checkpoints")


TRAIN = [
    "train", "--model", "tiny", "--layout", "dp=2,fsdp=2,tp=2", "--batch-size", "8",
    "--seq-len", "32", "--sample-bytes", "0", "--no-progress", "--no-plot",
]  # fmt: skip


def test_a_refused_resume_writes_nothing(tmp_path, capsys):
    """A job script's first launch with --resume on a fresh directory, and --resume on a
    user's folder with a `checkpoints/` of its own: refused, and nothing written (no
    marker, no `checkpoints/`), so the plain run that follows is accepted."""
    from equishard._cli import main

    fresh = tmp_path / "fresh"
    assert main([*TRAIN, "--run-dir", str(fresh), "--resume"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert not fresh.exists()
    fresh.mkdir()
    _claim(fresh, fresh / "checkpoints").release()  # the plain run that follows may have it
    folder = tmp_path / "folder"
    before = _plant(folder / "checkpoints")
    assert main([*TRAIN, "--run-dir", str(folder), "--resume"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert not (folder / MARKER).exists() and _snapshot(folder / "checkpoints") == before
    with pytest.raises(es.CheckpointError, match="holds no equishard run"):
        _claim(folder, folder / "checkpoints", overwrite=True)  # never taken for a run's
