"""`equishard train` end to end: kill and resume, resume on another layout, bad input."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest

from equishard._app import Run, TrainConfig
from equishard._app._metrics import read_metrics
from equishard._cli import main
from equishard.models._gpt import canonical_path
from equishard.train import Checkpointer

STEPS = 24
ARGS = [
    "--model", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32",
    "--checkpoint-every", "4", "--eval-every", str(STEPS), "--sample-bytes", "0",
    "--no-progress", "--no-plot",
]  # fmt: skip
LAYOUT = "dp=2,fsdp=2,tp=2"


def _train(tmp: pathlib.Path, name: str, *extra: str) -> int:
    return main(["train", *ARGS, "--layout", LAYOUT, "--run-dir", str(tmp / name), *extra])


def _rows(run_dir: pathlib.Path) -> dict[int, float]:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len({r["step"] for r in rows}) == len(rows)
    return {r["step"]: r["loss"] for r in rows}


def _final_arrays(checkpoints: pathlib.Path, layout: str) -> list[np.ndarray]:
    run = Run(TrainConfig(layout=layout, model="tiny", batch_size=8, seq_len=32))
    with Checkpointer(checkpoints, path_map=canonical_path) as ckpt:
        state = ckpt.restore(run.state_template(), mesh=run.mesh)
    leaves = jax.tree.leaves(state)
    keys = [jax.random.key_data(x) for x in leaves if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    arrays = [x for x in leaves if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    return [np.asarray(x) for x in arrays + keys]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    assert _train(tmp, "a") == 0
    return tmp


def test_sigkill_then_resume_is_bit_identical(uninterrupted, tmp_path):
    a = uninterrupted / "a"
    b = tmp_path / "b"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "equishard", "train", *ARGS, "--layout", LAYOUT, "--run-dir", str(b)]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = b / "checkpoints" / "4"
    deadline = time.monotonic() + 300
    while not first.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    with Checkpointer(b / "checkpoints") as ckpt:
        resumed_from = ckpt.latest_step()
    assert resumed_from is not None and resumed_from < STEPS  # killed mid-run

    # Resume under another layout, from FSDP to a 1F1B pipeline (a copy of the killed
    # run): the losses continue.
    c = tmp_path / "c"
    # (orbax may be removing the killed write's temporary directory meanwhile: skip it)
    shutil.copytree(b, c, ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp*"))
    argv = ["train", *ARGS, "--layout", "pp=2,dp=2,tp=2", "--pipeline-schedule", "1f1b"]
    assert main([*argv, "--run-dir", str(c), "--resume"]) == 0
    want, got = _rows(a), _rows(c)
    for step in range(resumed_from + 1, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-4 * want[step], (step, got[step], want[step])

    # Resume under the same layout: the final parameters are bit-identical.
    assert _train(tmp_path, "b", "--resume") == 0
    for x, y in zip(_final_arrays(b / "checkpoints", LAYOUT), _final_arrays(a / "checkpoints", LAYOUT)):
        np.testing.assert_array_equal(x, y)


def test_sigterm_saves_a_step_and_the_resume_sees_every_step_once(uninterrupted, tmp_path, capsys):
    """SIGTERM at step 5 of a run: it saves that step and exits 0 with one line. A row
    cut short (a write killed mid-line) is appended as a later fault would leave it. The
    resume (no --no-progress: its stderr is no terminal, so no bar) appends a marker
    and continues the uninterrupted curve exactly; the file's earlier bytes are kept,
    and its reader sees every step once."""
    run = tmp_path / "term"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "equishard", "train", *ARGS, "--layout", LAYOUT, "--run-dir", str(run), "--log-every", "1"]
    cmd += ["--checkpoint-every", "100"]  # neutral: fewer saves, the same curve
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for line in child.stdout:  # a hang guard is the child's own end: it reaches step 24
        if line.startswith(f"step  5/{STEPS}"):
            child.send_signal(signal.SIGTERM)
            break
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    stopped = [x for x in out.splitlines() if "received SIGTERM" in x]
    assert len(stopped) == 1 and "Traceback" not in err, out[-2000:]
    found = re.search(r"stopped after step (\d+) of", stopped[0])
    assert found, stopped[0]
    last = int(found.group(1))
    assert 5 <= last < STEPS
    with Checkpointer(run / "checkpoints") as ckpt:
        assert ckpt.latest_step() == last
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": %d, "loss": 0.0, "grad' % (last + 1))
    before = (run / "metrics.jsonl").read_bytes()
    argv = [x for x in ARGS if x != "--no-progress"]
    capsys.readouterr()
    assert main(["train", *argv, "--layout", LAYOUT, "--run-dir", str(run), "--resume", "--log-every", "1", "--checkpoint-every", "100"]) == 0
    out, err = capsys.readouterr()
    assert "train:" not in err and "it/s" not in err and f"step {STEPS}/{STEPS}" in out
    assert (run / "metrics.jsonl").read_bytes()[: len(before)] == before
    assert f'{{"step": {last}, "resumed": true' in (run / "metrics.jsonl").read_text()
    assert _rows(run) == _rows(uninterrupted / "a")  # steps 1..24, each once, bit-equal


def test_a_context_parallel_run_continues_the_curve_and_resumes_without_cp(uninterrupted, tmp_path):
    """From step 16 on dp=2,cp=4 (ring, zigzag batches) to 24; its step-20 checkpoint then
    resumes on the non-cp layout: both continue the uninterrupted curve within 1e-4."""
    a = uninterrupted / "a"

    def keep_up_to(run: pathlib.Path, last: int) -> None:
        for d in (run / "checkpoints").iterdir():
            if d.name.isdigit() and int(d.name) > last:
                shutil.rmtree(d)

    cp_run = tmp_path / "cp"
    shutil.copytree(a, cp_run)
    keep_up_to(cp_run, 16)
    assert main(["train", *ARGS, "--layout", "dp=2,cp=4", "--run-dir", str(cp_run), "--resume"]) == 0
    back = tmp_path / "back"
    shutil.copytree(cp_run, back)
    keep_up_to(back, 20)
    assert main(["train", *ARGS, "--layout", LAYOUT, "--run-dir", str(back), "--resume"]) == 0
    want = _rows(a)
    for run, first in ((cp_run, 17), (back, 21)):
        got = _rows(run)
        for step in range(first, STEPS + 1):
            assert abs(got[step] - want[step]) <= 1e-4 * want[step], (run.name, step, got[step], want[step])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if "error:" in x]
    assert line, err
    return line[0]


@pytest.mark.parametrize(
    "layout,message",
    [
        ("dp=2,xp=4", "the axis 'xp' has no role"),
        ("dp=16", "needs 16 devices but only 8 exist"),
        ("tp=8", "n_heads=4 is not divisible by the tensor-parallel axis 'tp' of size 8"),
    ],
)
def test_bad_layouts_are_one_paragraph_errors(layout, message, tmp_path, capsys):
    assert main(["train", *ARGS, "--layout", layout, "--run-dir", str(tmp_path / "x")]) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "x" / "checkpoints").exists() or not any((tmp_path / "x" / "checkpoints").iterdir())


def test_missing_checkpoint(tmp_path, capsys):
    assert _train(tmp_path, "empty", "--resume") == 2
    assert "no checkpoint" in _error(capsys)


def test_corrupt_checkpoint(uninterrupted, tmp_path, capsys):
    run = tmp_path / "corrupt"
    shutil.copytree(uninterrupted / "a", run)
    latest = run / "checkpoints" / str(STEPS)
    victims = [p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 0 and "metadata" not in p.name.lower()]
    for path in victims:
        path.write_bytes(b"\0" * 7)
    assert _train(tmp_path, "corrupt", "--resume") == 2
    assert "corrupt" in _error(capsys).lower() or "could not" in _error(capsys).lower()


def test_checkpoint_of_a_different_model(uninterrupted, tmp_path, capsys):
    run = tmp_path / "other"
    shutil.copytree(uninterrupted / "a", run)
    argv = ["train", *ARGS, "--layout", LAYOUT, "--run-dir", str(run), "--resume"]
    argv[argv.index("tiny")] = "small"
    assert main(argv) == 2
    message = _error(capsys)
    assert "shape" in message


def test_a_good_checkpoint_is_never_written_over(uninterrupted, capsys):
    checkpoints = uninterrupted / "a" / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    assert _train(uninterrupted, "a") == 2  # a fresh run into a directory that has a run
    assert "holds an earlier equishard run" in _error(capsys)
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def test_the_trained_model_leaves_as_a_plain_equinox_file(uninterrupted):
    from equishard.models import GPT, PRESETS, Parallelism
    from equishard.train import import_model

    like = GPT(PRESETS["tiny"], Parallelism(), key=jax.random.key(1))
    model = import_model(uninterrupted / "a" / "model.eqx", like)
    ids = jax.numpy.arange(32, dtype=jax.numpy.int32)[None]
    logits = model(ids)  # one device, global view, no mesh
    assert logits.shape == (1, 32, 256) and bool(np.isfinite(np.asarray(logits)).all())


# ------------------------------------------------- the library without the application

HIDE_EXTRAS = """
import importlib.abc, sys
HIDDEN = ("orbax", "tqdm", "matplotlib")  # the `train` extra

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
"""


def test_report_inspect_and_plan_need_no_training_extras():
    # As after `pip install equishard` with no extras: orbax, tqdm and matplotlib absent.
    script = HIDE_EXTRAS + (
        "import equishard, equishard.report, equishard.train\n"
        "try:\n"
        "    equishard.train.Checkpointer\n"
        "except ImportError as err:\n"
        "    print('checkpoint:', err)\n"
        "from equishard._cli import main\n"
        "rc = main(['plan', '--model', 'tiny', '--layout', 'fsdp=4,tp=2', '--devices', '8',\n"
        "           '--seq-len', '32'])\n"
        "print('rc', rc, sorted(m for m in sys.modules if m.split('.')[0] in HIDDEN))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint: equishard.train.Checkpointer needs orbax-checkpoint" in out.stdout
    assert re.search(r"peak per device .*: fits", out.stdout), out.stdout[-2000:]
    assert out.stdout.rstrip().endswith("rc 0 []")


def test_importing_the_library_loads_no_application_dependency():
    script = (
        "import sys, equishard, equishard.train, equishard.report\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tqdm', 'matplotlib', 'orbax') or m.startswith('equishard._app')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def _compiles(run: Callable[[], int]) -> int:
    """How many programs XLA compiles while `run()` trains, from empty caches."""
    count = []

    def listen(event: str, duration_secs: float, **_: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count.append(duration_secs)

    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert run() == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(count)


def test_a_longer_run_compiles_nothing_more(tmp_path):
    # Each step, save, evaluation and log line reuses the programs of the first ones: a
    # program compiled per step or per save would be slow and would hold its machine code
    # in memory maps of its own for the rest of the run (a process has 65530). Last in the
    # file: it empties JAX's caches.
    cadence = ["--checkpoint-every", "2", "--eval-every", "2", "--log-every", "1"]
    short = _compiles(lambda: _train(tmp_path, "short", *cadence, "--steps", "4"))
    long = _compiles(lambda: _train(tmp_path, "long", *cadence, "--steps", "12"))
    assert short > 0 and long == short, (short, long)
