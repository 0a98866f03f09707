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


# ---------------------------------------------------------------------------------------
# 2. Signals at any moment of `equishard train`
# ---------------------------------------------------------------------------------------

PHASES = ("compile", "restore", "step", "evaluation", "save", "export", "sample")
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
SHORT = [*TRAIN, "--steps", "3", "--eval-every", "100", "--checkpoint-every", "100"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished run of two steps (checkpoints 1 and 2), to resume from."""
    from equishard._cli import main

    run = tmp_path_factory.mktemp("signals") / "base"
    assert main([*SHORT, "--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run)]) == 0
    return run


def _send_at(phase, sig, monkeypatch):
    """Send `sig` to this process once the run reaches `phase` (a hook, no sleep); at
    "save", a second signal while the stop's own save runs."""
    import signal

    from equishard._app import _run
    from equishard.train import Checkpointer

    number = getattr(signal, sig)

    def send():
        os.kill(os.getpid(), number)

    timed = _run._Phases.timed

    def at_phase(self, name, fn):
        if name == {"compile": "compile", "evaluation": "evaluation", "export": "export", "sample": "sample"}.get(phase):
            return timed(self, name, lambda: (send(), fn())[1])
        return timed(self, name, fn)

    monkeypatch.setattr(_run._Phases, "timed", at_phase)
    if phase == "restore":
        resume = _run._resume
        monkeypatch.setattr(_run, "_resume", lambda *a: (send(), resume(*a))[1])
    if phase == "step":
        row = _run._step_row
        monkeypatch.setattr(_run, "_step_row", lambda step, *a: (step == 0 and send(), row(step, *a))[1])
    if phase == "save":
        save = Checkpointer.save
        monkeypatch.setattr(Checkpointer, "save", lambda self, *a, **k: (send(), save(self, *a, **k))[1])


EXPECTED = {
    "compile": "stopped after step 0 of 3, saved in",
    "restore": "stopped after step 2 of 3, saved in",
    "step": "stopped after step 1 of 3, saved in",
    "evaluation": "stopped after step 1 of 3, saved in",
    "save": "stopped after step 1 of 3, saved in",
    "export": "the sample was skipped; nothing is left to train",
    "sample": "during the sample: the run is complete",
}


# Each signal at each phase: 21 short in-process runs, compiled once (the persistent
# compilation cache), the signal placed by a hook.
CASES = [(phase, sig) for sig in SIGNALS for phase in PHASES]


@pytest.mark.parametrize("phase,sig", CASES)
def test_a_signal_at_any_phase_ends_the_run_cleanly(phase, sig, two_steps, tmp_path, capsys, monkeypatch):
    """Each of SIGTERM, SIGUSR1 and SIGINT at each phase: exit 0, no traceback, one line
    naming the last complete step (saved) and how to continue, the lock released; a
    second signal during the save the stop commits is reported and does not interrupt it."""
    import shutil

    from equishard._cli import main
    from equishard.train import Checkpointer

    run = tmp_path / "run"
    argv = [*SHORT, "--run-dir", str(run)]
    if phase == "restore":
        shutil.copytree(two_steps, run)
        argv.append("--resume")
    argv += {"evaluation": ["--eval-every", "1"], "save": ["--checkpoint-every", "1"]}.get(phase, [])
    argv += {"export": ["--sample-bytes", "2"], "sample": ["--sample-bytes", "2"]}.get(phase, [])
    capsys.readouterr()
    _send_at(phase, sig, monkeypatch)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "error" not in err, err
    lines = [line for line in out.splitlines() if line.startswith(f"equishard train: received {sig}")]
    assert EXPECTED[phase] in lines[-1], out[-2000:]
    if phase == "save":
        assert "while saving step 1: the save completes first" in out
    assert not (run / LOCK).exists()
    monkeypatch.undo()
    with Checkpointer(run / "checkpoints") as ckpt:
        assert ckpt.latest_step() == {"compile": 0, "restore": 2, "step": 1, "evaluation": 1, "save": 1}.get(phase, 3)
    if (phase, sig) == ("compile", "SIGTERM"):  # what the line says to run continues the run
        assert main([*SHORT, "--run-dir", str(run), "--resume"]) == 0
        assert "resumed from step 0 of" in capsys.readouterr().out


def test_a_signal_before_the_run_began_writes_nothing(two_steps, tmp_path, capsys, monkeypatch):
    """Before anything is written: a fresh run exits 2 (nothing was saved) and leaves no
    directory; a resumed one exits 0 naming the checkpoint it would have continued from."""
    import shutil
    import signal

    from equishard._app import _run
    from equishard._cli import main

    check = _run.check_fits_machine
    monkeypatch.setattr(_run, "check_fits_machine", lambda *a: (os.kill(os.getpid(), signal.SIGTERM), check(*a))[1])
    fresh = tmp_path / "fresh"
    assert main([*SHORT, "--run-dir", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "error: received SIGTERM before the run began: nothing was trained, written or saved" in err
    assert not fresh.exists()
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    before = _snapshot(run)
    assert main([*SHORT, "--run-dir", str(run), "--resume"]) == 0
    assert "the last complete checkpoint is step 2 in" in capsys.readouterr().out
    assert _snapshot(run) == before


# ---------------------------------------------------------------------------------------
# 3. The step's contract, checked by name
# ---------------------------------------------------------------------------------------


def _tiny(optimizer=None, **step_kwargs):
    """A one-matrix model on dp=4,tp=2 and its step; the loss reads the batch."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.train import init_train_state

    mesh = es.make_mesh("dp=4,tp=2")
    optimizer = optimizer or optax.sgd(0.1)
    state = init_train_state(lambda k: es.Sharded(jnp.ones((4, 4)), P()), optimizer, jax.random.key(0), mesh=mesh)
    return mesh, state


def _mean_square(model, batch, key):
    import jax
    import jax.numpy as jnp

    return jax.lax.pmean(jnp.mean((batch @ model.value) ** 2), "dp"), {}


@pytest.mark.parametrize("name", ["loss", "grad_norm", "skipped"])
def test_reserved_metric_names_are_refused(name):
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.train import make_train_step

    mesh, state = _tiny()

    def loss_fn(model, batch, key):
        loss, _ = _mean_square(model, batch, key)
        return loss, {name: jnp.float32(123.0)}

    step = make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match=f"metric\\(s\\) '{name}' would replace the step's own"):
        step(state, jnp.ones((8, 4)))


def test_a_state_built_for_another_optimizer_is_named():
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.train import make_train_step

    mesh, state = _tiny(optax.sgd(0.1))
    step = make_train_step(_mean_square, optax.adam(0.1), mesh=mesh, batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match="optimizer state does not fit this step's optimizer"):
        step(state, jnp.ones((8, 4)))


class _Counted(__import__("equinox").Module):
    """A model with a state (a counter), for the loss form."""

    w: object
    index: object

    def __init__(self):
        import equinox as eqx
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        self.w = es.Sharded(jnp.ones((4, 4)), P())
        self.index = eqx.nn.StateIndex(jnp.zeros((), jnp.float32))


def test_the_loss_form_is_checked_by_name():
    """The plain form with a model state, the stateful form without one."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.train import init_train_state, make_train_step

    mesh, plain = _tiny()

    def stateful(model, state, batch, key):
        return _mean_square(model, batch, key)[0], ({}, state)

    step = make_train_step(stateful, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match=r"carries no model state.*takes \(model, state, batch, key\)"):
        step(plain, jnp.ones((8, 4)))
    with_state = init_train_state(lambda k: eqx.nn.make_with_state(_Counted)(), optax.sgd(0.1), jax.random.key(0), mesh=mesh)

    def plain_loss(model, batch, key):
        return jax.lax.pmean(jnp.mean((batch @ model.w.value) ** 2), "dp"), {}

    step = make_train_step(plain_loss, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match=r"carries a model state \(eqx.nn.State\).*takes \(model, batch, key\)"):
        step(with_state, jnp.ones((8, 4)))


def _lm(vocab=16, dim=8, tokens=12):
    import jax

    keys = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(keys[0], (tokens, dim))
    w = jax.random.normal(keys[1], (vocab, dim))
    labels = jax.random.randint(keys[2], (tokens,), 0, vocab)
    return h, w, labels


@pytest.mark.parametrize("bad", [16, 999, -1])
def test_a_label_outside_the_vocabulary_is_never_scored(bad):
    """Fused (one device, and the vocabulary split over tp=4: one global range check) and
    unfused vocabulary-parallel losses: NaN loss and gradients, where optax gives NaN;
    the ignore_index label is exempt."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from equishard.core import fused_linear_cross_entropy
    from equishard.nn import vocab_parallel_cross_entropy

    h, w, labels = _lm()
    labels = labels.at[5].set(bad)

    def fused(h, w, labels, axis=None, **kw):
        sums = fused_linear_cross_entropy(h, w, labels, axis, **kw)
        return sums.loss / sums.tokens

    loss, grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w, labels)
    assert not np.isfinite(float(loss)) and not np.isfinite(np.asarray(grads[0])).all()
    mesh = es.make_mesh("tp=4,dp=2")
    split = es.filter_shard_map(
        lambda h, w, labels: fused(h, w, labels, "tp"), mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=P()
    )
    assert not np.isfinite(float(jax.jit(split)(h, w, labels)))
    per_token = es.filter_shard_map(
        lambda z, labels: vocab_parallel_cross_entropy(z, labels, "tp"), mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=P()
    )
    out = np.asarray(jax.jit(per_token)(h @ w.T, labels))
    assert np.isnan(out[5]) and np.isfinite(np.delete(out, 5)).all()
    ignored = labels.at[5].set(-100)
    loss = jax.jit(lambda *a: fused(*a, ignore_index=-100))(h, w, ignored)
    want = jax.jit(fused)(jnp.delete(h, 5, axis=0), w, jnp.delete(labels, 5))
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))


def test_a_train_step_on_labels_outside_the_vocabulary_is_skipped():
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.core import fused_linear_cross_entropy
    from equishard.train import make_train_step

    mesh, state = _tiny()

    def loss_fn(model, batch, key):  # the 4x4 matrix as a head over 4 "tokens"
        sums = fused_linear_cross_entropy(batch["h"], model.value, batch["labels"])
        return jax.lax.pmean(sums.loss / sums.tokens, "dp"), {}

    step = make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"))
    batch = {"h": jnp.ones((8, 4)), "labels": jnp.arange(8, dtype=jnp.int32) % 4}
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 0
    _, metrics = step(state, {**batch, "labels": batch["labels"].at[3].set(999)})
    assert int(metrics["skipped"]) == 1 and not __import__("math").isfinite(float(metrics["loss"]))


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("label_smoothing", -0.5, "label_smoothing=-0.5 must be a number from 0 to 1"),
        ("label_smoothing", 2.0, "label_smoothing=2.0 must be a number from 0 to 1"),
        ("label_smoothing", float("nan"), "label_smoothing=nan must be a number from 0 to 1"),
        ("z_loss", -1.0, "z_loss=-1.0 must be a finite number, 0 or more"),
        ("softcap", 0.0, "softcap=0.0 must be a finite number above 0, or None"),
        ("chunk_size", 4.0, "chunk_size=4.0 must be a whole number of tokens"),
        ("chunk_size", 0, "chunk_size=0 must be positive"),
        ("labels", "float32", "labels of dtype='float32' is not an integer dtype"),
    ],
)  # fmt: skip
def test_loss_options_out_of_range_are_named(option, value, message):
    from equishard.core._fused_ce import check_loss_options

    kwargs = {"labels": __import__("numpy").zeros(3, "int32"), "chunk_size": None, "ignore_index": None, "z_loss": 0.0, "label_smoothing": 0.0, "softcap": None}
    kwargs[option] = __import__("numpy").zeros(3, value) if option == "labels" else value
    with pytest.raises(es.LayerConfigError) as info:
        check_loss_options(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("dtype,message", [("float16", "no loss scaling"), ("float8_e4m3fn", "float8_e4m3fn is an 8-bit")])
def test_unscaled_compute_dtypes_are_refused(dtype, message):
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from equishard.train import MixedPrecision, make_train_step

    mesh, _ = _tiny()
    with pytest.raises(es.LayerConfigError, match=message):
        make_train_step(_mean_square, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"), precision=MixedPrecision(getattr(jnp, dtype)))


def test_steps_of_exactly_zero_gradients_are_warned_of():
    from equishard._app import TrainConfig
    from equishard._app._run import ZERO_GRADIENT_STEPS, _Streaks

    lines = []
    streaks = _Streaks(TrainConfig(), None)  # type: ignore[arg-type]
    for step in range(1, 2 * ZERO_GRADIENT_STEPS + 2):
        streaks.after(step, {"loss": 1.0, "grad_norm": 0.0 if step != 3 else 0.5, "skipped": 0}, lines.append)
    assert len(lines) == 1 and f"gradients of steps 4 to {3 + ZERO_GRADIENT_STEPS} were all exactly zero" in lines[0]


def test_a_corrupted_checkpoint_is_named_without_raw_tracebacks(two_steps, tmp_path, capsys, monkeypatch):
    """The reads still in flight when a restore fails no longer print `Event loop is
    closed` tracebacks (about 15 before); `--profile` before the resumed step is named."""
    import shutil

    from equishard._cli import main

    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    for path in (run / "checkpoints" / "2").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "metadata" not in path.name.lower():
            path.write_bytes(b"\0" * 7)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    assert main([*SHORT, "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step 2 in" in err and "is corrupt or incomplete" in err and "--resume-step 1" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not [u for u in unraisable if "Event loop is closed" in str(u.exc_value)]
    shutil.move(run / "checkpoints" / "2", tmp_path / "suspect")
    assert main([*SHORT, "--run-dir", str(run), "--resume", "--profile", "0:1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "warning: --profile 0:1 traces steps 0 to 0, all before step 1, where this resumed run starts: nothing will be traced" in out


def test_plan_with_no_device_memory_is_named(capsys):
    from equishard._cli import main

    assert main(["plan", "--model", "tiny", "--layout", "dp=8", "--devices", "8", "--device-memory", "0"]) == 2
    assert "--device-memory '0' must be above 0 bytes" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# 4. The user's files in both directories, byte for byte, through train, resume, overwrite
# ---------------------------------------------------------------------------------------


def test_a_users_files_survive_train_resume_and_overwrite(tmp_path, capsys):
    from equishard._cli import main

    run, outside = tmp_path / "run", tmp_path / "ckpt"
    argv = [*SHORT, "--run-dir", str(run), "--checkpoint-dir", str(outside)]
    assert main([*argv, "--steps", "1"]) == 0
    mine = {d: _plant(d) for d in (run, outside)}

    def unchanged():
        for directory, files in mine.items():
            after = _snapshot(directory)
            assert {k: after.get(k) for k in files} == files

    assert main([*argv, "--steps", "2", "--resume"]) == 0
    unchanged()
    assert main([*argv, "--steps", "1", "--overwrite"]) == 0
    unchanged()
    assert main([*argv, "--steps", "1"]) == 2  # a run is there again: refused, nothing moved
    unchanged()
    moved = [p for p in outside.iterdir() if p.name.startswith("previous-2")]
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == ["1", "2"]
    capsys.readouterr()


def test_the_gpt_step_skips_a_batch_with_labels_outside_its_vocabulary():
    """The reference GPT (vocabulary 256, the fused loss over tp=2): ids up to 999 were
    trained on (loss 5.63, skipped 0); now the step is skipped, its loss not finite."""
    import math

    import numpy as np

    from equishard._app import Run, TrainConfig

    r = Run(TrainConfig(model="tiny", layout="dp=2,fsdp=2,tp=2", batch_size=8, seq_len=32))
    batch = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    batch[3, 7] = 999
    state, metrics = r.train_step(r.init_state(), batch)
    assert int(metrics["skipped"]) == 1 and not math.isfinite(float(metrics["loss"]))
    batch[3, 7] = 7
    _, metrics = r.train_step(state, batch)
    assert int(metrics["skipped"]) == 0
