"""Nothing silently wrong: verified checkpoints, interrupted saves, unusable directories,
failed background writes, and shapes or specs that do not fit."""

import errno
import gc
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import equishard as es
from equishard.train import Checkpointer, make_train_step
from equishard.train._checkpoint import FAULT_ENV, probe_writable
from equishard.train._format import FORMAT_VERSION, checksums

REPO = pathlib.Path(__file__).resolve().parents[1]


def _state(step, mesh, spec):
    """A small state whose values depend on the step: f32[64, 48] sharded, u32 key, i32."""
    w = jax.random.normal(jax.random.key(step), (64, 48))  # incompressible, as weights are
    return {
        "w": es.shard(es.Sharded(w, spec), mesh),
        "b": jnp.linspace(-1.0, 1.0, 5, dtype=jnp.bfloat16) * step,
        "key": jax.random.fold_in(jax.random.key(0), step),
        "step": jnp.array(step, jnp.int32),
    }


def _assert_bit_identical(a, b):
    a, b = es.unbox(a), es.unbox(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------


def test_checksum_is_independent_of_the_layout():
    x = jax.random.normal(jax.random.key(1), (16, 24))
    reference = checksums({"x": x})["x"]
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    for spec in [P("a", "b"), P("b"), P(("a", "b")), P(None, ("b", "a")), P()]:
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        assert checksums({"x": placed})["x"] == reference, spec
    assert checksums({"x": np.asarray(x)})["x"] == reference


def test_checksum_sees_a_flipped_bit_and_a_swap():
    x = jax.random.normal(jax.random.key(2), (8, 8))
    base = checksums({"x": x})["x"]
    bits = np.asarray(x).view(np.uint32).copy()
    bits[3, 5] ^= 1
    assert checksums({"x": bits.view(np.float32)})["x"] != base
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksums({"x": swapped})["x"] != base
    for dtype in [jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint32]:
        y = (x > 0) if dtype == jnp.bool_ else x.astype(dtype)
        assert len(checksums({"y": y})["y"]) == 16


@pytest.fixture
def saved(tmp_path):
    """Steps 1 and 2 saved under fsdp=8, with their states."""
    mesh = es.make_mesh("fsdp=8")
    states = {s: _state(s, mesh, P("fsdp")) for s in (1, 2)}
    with Checkpointer(tmp_path) as ckpt:
        for s, state in states.items():
            ckpt.save(s, state)
    return tmp_path, states


def _flip_64_bytes(step_dir):
    """Flip 64 bytes in the middle of each data file of a step that holds bytes of `w`.

    `w` (12 KiB) lands in one to several data files, as orbax batches its shards' writes
    (one of 12.2 KiB, or 9.3 + 3.3, or 10.8 + 1.8 KiB, run to run; a shard is 1.5 KiB);
    every other data file (the other arrays, the index) is under 1 KiB."""
    files = [p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]
    large = [p for p in files if p.stat().st_size > 1024]
    assert large
    for path in large:
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
        path.write_bytes(bytes(data))


def test_a_corrupted_step_names_the_array_and_the_intact_step(saved):
    directory, states = saved
    with Checkpointer(directory) as ckpt:
        recorded = {r["path"]: r["checksum"] for r in ckpt.read_metadata(2)["arrays"]}
    assert set(recorded) == {"['w']", "['b']", "['key']", "['step']"}
    _flip_64_bytes(directory / "2")
    # Restored on another layout: the checksums recorded under fsdp=8 still apply.
    mesh = es.make_mesh("dp=2,tp=4")
    like = _state(0, mesh, P(None, "tp"))
    with Checkpointer(directory) as ckpt:
        with pytest.raises(es.CheckpointError) as info:
            ckpt.restore(like, mesh=mesh)
        message = str(info.value)
        assert "step 2" in message and "`['w']`" in message
        assert "Step 1 is intact" in message and "--resume-step 1" in message
        assert info.value.__cause__ is None and "\n" not in message
        restored = ckpt.restore(like, step=1, mesh=mesh)
    _assert_bit_identical(restored, states[1])
    gc.collect()


def _swap_in_arrays(step_dir, other_dir):
    """Replace a step's array files with another step's: every file reads back cleanly,
    with the other step's values. (Flipped bytes in the middle of a data file can land
    on a compressed chunk's framing, and then no array reads back at all: the damage is
    seen whether checksums are on or not.)"""
    shutil.rmtree(step_dir / "arrays")
    shutil.copytree(other_dir / "arrays", step_dir / "arrays")


def test_checksums_can_be_turned_off(saved):
    directory, states = saved
    with Checkpointer(directory, checksums=False) as ckpt:
        ckpt.save(3, states[2])
        assert all("checksum" not in r for r in ckpt.read_metadata(3)["arrays"])
        _swap_in_arrays(directory / "2", directory / "1")
        damaged = ckpt.restore(states[2], step=2)  # not verified: the damage goes unseen
    _assert_bit_identical(damaged, states[1])
    with Checkpointer(directory) as ckpt:
        _assert_bit_identical(ckpt.restore(states[2], step=3), states[2])  # nothing recorded
        with pytest.raises(es.CheckpointError, match="step 2 .* corrupt"):
            ckpt.restore(states[2], step=2)


# ---------------------------------------------------------------------------------------
# A failed background write, unusable directories
# ---------------------------------------------------------------------------------------


class _DiskFull:
    """A commit future that fails as a full disk does."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_background_write_raises_at_the_next_poll(tmp_path, monkeypatch):
    mesh = es.make_mesh("fsdp=8")
    states = {s: _state(s, mesh, P("fsdp")) for s in (1, 2, 3)}
    ckpt = Checkpointer(tmp_path, max_to_keep=1)
    ckpt.save(1, states[1])
    ckpt.wait()
    write = ocp.StandardCheckpointHandler.async_save

    async def full_disk(self, directory, *args, **kwargs):
        return [*(await write(self, directory, *args, **kwargs) or []), _DiskFull()]

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", full_disk)
    ckpt.save(2, states[2])
    with pytest.raises(es.CheckpointError) as info:
        for _ in range(60_000):  # the next training steps, until the write has failed
            ckpt.poll()
            time.sleep(0.001)
    message = str(info.value)
    assert "step 2" in message and "No space left on device" in message
    assert "untouched: [1]" in message and "\n" not in message
    monkeypatch.undo()
    # max_to_keep=1, yet step 1 survives: old steps go only once a newer one is complete.
    assert ckpt.all_steps() == [1]
    _assert_bit_identical(ckpt.restore(states[1]), states[1])
    ckpt.save(3, states[3])
    ckpt.close()
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [3]
        _assert_bit_identical(ckpt.restore(states[3]), states[3])
    gc.collect()


def test_a_directory_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(es.CheckpointError, match="is a file, not a directory"):
        Checkpointer(path)
    with pytest.raises(es.CheckpointError, match="run directory .* is not usable"):
        probe_writable(path / "below", "run directory")


def _as_nobody(script, *args):
    """Run `script` in a child that imports equishard as root, then drops to `nobody`
    (tests run as root, which may write into a read-only directory).

    Every module of equishard is imported, and JAX's lazily imported ones by a first
    computation on 8 CPU devices, before the drop: the checkout (and a venv inside it)
    may sit in a directory only root can read."""
    prologue = textwrap.dedent(
        """
        import importlib, os, pkgutil, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        import equishard
        for module in pkgutil.walk_packages(equishard.__path__, "equishard."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
        from equishard._app import load_stdlib_corpus
        load_stdlib_corpus()  # cached: the interpreter's files are root's here
        import jax, jax.numpy as jnp
        jax.config.update("jax_num_cpu_devices", 8)
        jax.jit(jnp.add)(jnp.arange(2), 1).block_until_ready()  # JAX imports some lazily
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


@pytest.fixture
def open_tmp():
    """A temporary directory every user may enter (pytest's own is private to root)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="equishard-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_read_only_directory_is_found_by_the_probe(open_tmp):
    read_only = open_tmp / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    result = _as_nobody(
        """
        from equishard import CheckpointError
        from equishard.train import Checkpointer
        try:
            Checkpointer(sys.argv[1]).check_writable()
        except CheckpointError as err:
            print("ERROR", err)
        """,
        read_only,
    )
    assert result.returncode == 0, result.stderr
    assert f"ERROR the checkpoint directory {read_only} is not usable: Permission denied" in (
        result.stdout
    )
    assert list(read_only.iterdir()) == []


# ---------------------------------------------------------------------------------------
# A run killed during a save, at deterministic points, then resumed
# ---------------------------------------------------------------------------------------

_SAVER = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, {tests!r})
import equishard as es
from jax.sharding import PartitionSpec as P
from equishard.train import Checkpointer
from test_reliability import _state

mesh = es.make_mesh("fsdp=8")
ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
for step in (1, 2, 3):
    ckpt.save(step, _state(step, mesh, P("fsdp")))
    ckpt.wait()
ckpt.close()
print("finished")
"""

# point -> steps found afterwards (max_to_keep=2; the kill is at step 3's save, or at
# the removal of step 1 that follows it).
_FAULTS = {
    "before-write:3": [1, 2],
    "arrays-written:3": [1, 2],
    "committed:3": [1, 2, 3],
    "pruning:1": [2, 3],
}


def test_a_run_killed_during_a_save_resumes_verified(tmp_path):
    children = {}
    for point in _FAULTS:
        directory = tmp_path / point.replace(":", "-")
        env = {**os.environ, FAULT_ENV: point}
        script = _SAVER.format(tests=str(REPO / "tests"))
        children[point] = (
            directory,
            subprocess.Popen(
                [sys.executable, "-c", script, str(directory)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    saving = es.make_mesh("fsdp=8")
    mesh = es.make_mesh("dp=2,tp=4")  # resumed under another layout
    like = _state(0, mesh, P(None, "tp"))
    for point, (directory, child) in children.items():
        out, err = child.communicate(timeout=300)
        assert child.returncode == -9, (point, out, err[-2000:])
        assert "finished" not in out
        with Checkpointer(directory) as ckpt:
            assert ckpt.all_steps() == _FAULTS[point], point
            for step in ckpt.all_steps():  # every array verified against its checksum
                restored = ckpt.restore(like, step=step, mesh=mesh)
                _assert_bit_identical(restored, _state(step, saving, P("fsdp")))
            # The run goes on from the newest step.
            ckpt.save(4, _state(4, mesh, P(None, "tp")))
        leftovers = [p.name for p in directory.iterdir() if not p.name.isdigit()]
        assert leftovers == [], (point, leftovers)


# ---------------------------------------------------------------------------------------
# The command line: one-line errors (exit 2) before anything is compiled
# ---------------------------------------------------------------------------------------

TRAIN = [
    "train", "--model", "tiny", "--layout", "dp=2,fsdp=2,tp=2", "--batch-size", "8",
    "--seq-len", "32", "--eval-every", "2", "--sample-bytes", "0", "--no-progress", "--no-plot",
]  # fmt: skip


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pipeline-repeats", "0", "--layout", "pp=2,dp=4"], "pipeline_repeats (--pipeline-repeats) must be at least 1, got 0"),
        (["--microbatches", "0", "--layout", "pp=2,dp=4"], "num_microbatches (--microbatches) must be at least 1, got 0"),
        (["--devices", "0"], "--devices must be at least 1, got 0"),
        (["--warmup", "-5"], "--warmup must be 0 or more, got -5"),
        (["--lr", "-0.001"], "--lr must be a finite number above 0, got -0.001"),
        (["--lr", "nan"], "--lr must be a finite number above 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number above 0, got inf"),
        (["--max-skipped-steps", "0"], "--max-skipped-steps must be at least 1, got 0"),
        (["--pipeline-schedule", "1f1b", "--microbatches", "2"], "--pipeline-schedule, --microbatches apply only to a pipeline, and the layout 'dp=2,fsdp=2,tp=2' has no pp axis"),
        (["--pipeline-repeats", "2"], "--pipeline-repeats apply only to a pipeline"),
        (["--clip-norm", "-1"], "--clip-norm must be a finite number above 0, or 0 / none for no clipping, got -1.0"),
        (["--steps", "3000000000"], "--steps 3000000000 is more than the 2147483647 a run's int32 counters hold"),
        (["--steps", "2000000000"], "--steps 2000000000 x --batch-size 8 samples is more than the 2147483647"),
        (["--require-verified", "--no-verify-checkpoints"], "--require-verified and --no-verify-checkpoints exclude each other"),
    ],
)
def test_bad_train_options_are_refused(argv, message, tmp_path, capsys):
    from equishard._cli import main

    assert main([*TRAIN, "--run-dir", str(tmp_path / "run"), *argv]) == 2
    assert message in _one_line_error(capsys)
    assert not (tmp_path / "run").exists()  # found before anything was written


@pytest.mark.parametrize(
    "argv,message",
    [
        (["plan", "--model", "tiny", "--layout", "dp=2", "--devices", "0"], "--devices must be at least 1, got 0"),
        (["inspect", "--model", "tiny", "--layout", "pp=2,dp=4", "--pipeline-repeats", "0"], "must be at least 1, got 0"),
        (["launch", "-n", "2", "--", "/missing/program"], "cannot launch '/missing/program': no such program"),
        (["plan", "--model", "tiny", "--layout", "dp=2", "--devices", "100000000"], "--devices 100000000 is more than the 65536 devices equishard simulates at most"),
    ],
)
def test_bad_options_of_the_other_commands(argv, message, capsys):
    from equishard._cli import main

    assert main(argv) == 2
    assert message in _one_line_error(capsys)


def test_unusable_run_and_checkpoint_directories(tmp_path, capsys):
    from equishard._cli import main

    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main([*TRAIN, "--run-dir", str(a_file)]) == 2
    assert f"the run directory (--run-dir) {a_file} is a file" in _one_line_error(capsys)
    run = tmp_path / "run"
    assert main([*TRAIN, "--run-dir", str(run), "--checkpoint-dir", str(a_file)]) == 2
    assert f"the checkpoint directory {a_file} is a file" in _one_line_error(capsys)


def test_read_only_checkpoints_with_resume_fail_at_once(open_tmp):
    read_only = open_tmp / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    (open_tmp / "run").mkdir()
    os.chown(open_tmp / "run", 65534, 65534)  # the run directory is writable, the other not
    result = _as_nobody(
        """
        from equishard._cli import main
        sys.exit(main(sys.argv[1:]))
        """,
        *TRAIN, "--steps", "2", "--run-dir", open_tmp / "run", "--checkpoint-dir", read_only, "--resume",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"the checkpoint directory {read_only} is not usable: Permission denied" in lines[0]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A run whose every update is NaN: `--lr nan` is refused up front, so the optimizer
    is replaced by one with a NaN learning rate (a schedule gone wrong past the check).
    Returns the run directory and the error line; checkpoints at steps 1 and 2."""
    import optax

    from equishard._app import _run
    from equishard._cli import main

    run = tmp_path_factory.mktemp("reliability") / "run"
    argv = [*TRAIN, "--steps", "6", "--max-skipped-steps", "3", "--checkpoint-every", "1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            _run,
            "make_optimizer",
            lambda config: optax.adamw(lambda count: count * jnp.nan, b1=0.9, b2=0.95),
        )
        stderr = io.StringIO()
        patch.setattr(sys, "stderr", stderr)
        code = main([*argv, "--run-dir", str(run)])
    lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr.getvalue()
    return run, lines[0]


def test_a_nan_learning_rate_never_reaches_the_parameters(nan_run):
    """The NaN updates are skipped: the run stops after --max-skipped-steps (exit 2) and
    every checkpoint holds the initial, finite parameters, verified on restore."""
    from equishard._app import Run, TrainConfig
    from equishard.models._gpt import canonical_path

    run, message = nan_run
    assert "steps 1 to 3 were all skipped (3 in a row, --max-skipped-steps)" in message
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows if "skipped" in r] == [1.0, 1.0, 1.0]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    r = Run(TrainConfig(layout="dp=2,fsdp=2,tp=2", model="tiny", batch_size=8, seq_len=32))
    initial = r.init_state()
    with Checkpointer(run / "checkpoints", path_map=canonical_path) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        for step in (1, 2):  # restored and verified against the recorded checksums
            state = ckpt.restore(r.state_template(), step=step, mesh=r.mesh)
            _assert_bit_identical(state.model, initial.model)
            # A skipped step consumes its batch: step count and data position advance.
            assert int(state.step) == step and int(state.skipped) == step
            assert int(state.data_position) == step * 8


def test_resume_past_steps_says_so(nan_run, tmp_path, capsys):
    from equishard._cli import main

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    assert main([*TRAIN, "--steps", "2", "--run-dir", str(run), "--resume"]) == 2
    assert "is at step 2, and --steps is 2: nothing is left to train" in _one_line_error(capsys)


def test_resume_step_continues_from_an_earlier_step(nan_run, tmp_path, capsys):
    """`--resume-step 1` with step 2 still there is refused before any compute (the run
    would save step 2 again); with step 2 moved away it trains on from step 1."""
    from equishard._cli import main
    from equishard.models._gpt import canonical_path

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    argv = [*TRAIN, "--steps", "3", "--run-dir", str(run), "--resume-step", "1"]
    assert main(argv) == 2
    message = _one_line_error(capsys)
    assert "--resume-step 1" in message and "later step(s) 2" in message
    shutil.move(run / "checkpoints" / "2", tmp_path / "suspect-step-2")
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-2:] == [2, 3]
    with Checkpointer(run / "checkpoints", path_map=canonical_path) as ckpt:
        assert ckpt.latest_step() == 3


def test_resume_over_another_corpus_is_refused(nan_run, tmp_path, capsys):
    from equishard._cli import main

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    meta = run / "checkpoints" / "1" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["user"]["corpus"]["sha256"] = "0" * 64
    meta.write_text(json.dumps(record))
    assert main([*TRAIN, "--steps", "3", "--run-dir", str(run), "--resume-step", "1"]) == 2
    message = _one_line_error(capsys)
    assert "step 1" in message and "another corpus" in message and "sha256 000000000000" in message


# ---------------------------------------------------------------------------------------
# Library mistakes named before JAX sees them
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,out_specs,message",
    [
        (lambda x: x * 2, P(), "output `<root>` (local shape (4, 4)) with out_spec P() on Mesh('dp': 2, 'tp': 4): the value varies over 'dp'"),
        (lambda x: {"a": x, "b": x.sum()}, {"a": P("dp"), "b": P()}, "output `['b']` (local shape ())"),
        (lambda x: x * 2, P("xx"), "out_specs P('xx',) on Mesh('dp': 2, 'tp': 4): axis 'xx' is not an axis of the mesh"),
        (lambda x: x * 2, P("dp", None, None), "the spec has 3 entries but the output has only 2 dimensions"),
        (lambda x: x * 2, (P("dp"), P()), "do not match the structure of the outputs"),
    ],
)
def test_out_specs_are_checked(fn, out_specs, message):
    mesh = es.make_mesh("dp=2,tp=4")
    with pytest.raises(es.SpecError) as info:
        mapped = es.filter_shard_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=out_specs)
        jax.jit(mapped)(jnp.ones((8, 4)))
    assert message in str(info.value)
    assert "check_vma" not in str(info.value)
    if "varies" in message:
        assert "`jax.lax.psum` or `jax.lax.pmean` over 'dp'" in str(info.value)


def test_a_reduced_output_passes():
    mesh = es.make_mesh("dp=2,tp=4")
    mapped = es.filter_shard_map(
        lambda x: jax.lax.psum(x.sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P()
    )
    assert float(jax.jit(mapped)(jnp.ones((8, 4)))) == 32.0


@pytest.mark.parametrize("name", ["ring_shift", "mp_copy", "mp_reduce", "mp_scatter", "mp_gather"])
def test_collectives_on_an_unbound_axis_name_it(name):
    fn = getattr(es.core, name)
    mesh = es.make_mesh("dp=2,tp=4")
    with pytest.raises(es.MeshError, match=f"{name}: the axis 'tp' is not bound here; no mesh axis"):
        fn(jnp.ones(8), axis_name="tp")
    mapped = es.filter_shard_map(lambda x: fn(x, axis_name="pp"), mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(es.MeshError) as info:
        jax.jit(mapped)(jnp.ones(8))
    assert f"{name}: the axis 'pp' is not bound here; the bound mesh axes are ('dp', 'tp')" in str(
        info.value
    )


def test_a_loss_written_as_on_one_device_is_averaged_by_the_step():
    """The local mean, never pmean-ed (one loss for both views): the step averages it
    over the data axes it varies over; the same losses and parameters as the pmean-ed
    loss and as one device."""
    import optax

    mesh = es.make_mesh("dp=4,tp=2")
    batch = jax.random.normal(jax.random.key(1), (8, 4))
    w = jax.random.normal(jax.random.key(2), (4, 4))

    def local_loss(model, batch, key):  # the local mean, as on one device
        return jnp.mean((batch @ model.value) ** 2), {"first": jnp.mean(batch[:, 0])}

    def global_loss(model, batch, key):
        loss, metrics = local_loss(model, batch, key)
        return jax.lax.pmean(loss, "dp"), jax.lax.pmean(metrics, "dp")

    results = []
    for loss_fn, m in ((local_loss, mesh), (global_loss, mesh), (local_loss, es.make_mesh("dp=1", devices=jax.devices()[:1]))):
        step = make_train_step(loss_fn, optax.sgd(0.1), mesh=m, batch_spec=P("dp"))
        state = step.init_state(lambda k: es.Sharded(w, P()), jax.random.key(0))
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((float(metrics["loss"]), float(metrics["first"]), np.asarray(state.model.value)))
    for other in results[1:]:
        assert abs(other[0] - results[0][0]) <= 1e-6 * abs(results[0][0]) and abs(other[1] - results[0][1]) <= 1e-6
        assert np.linalg.norm(other[2] - results[0][2]) <= 1e-6 * np.linalg.norm(results[0][2])


def test_a_layer_whose_weight_was_not_split_says_so():
    mesh = es.make_mesh("dp=2,tp=4")
    layer = es.sharded_init(
        lambda k: es.nn.ColumnParallelLinear(16, 64, axis_name="tp", key=k), jax.random.key(0), mesh=mesh
    )
    x = jnp.ones((2, 16))
    # gather_output=True: every device returns the whole output.
    split = es.filter_shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(None, P()), out_specs=P())
    assert jax.jit(split)(layer, x).shape == (2, 64)
    whole = es.filter_shard_map(lambda m, x: m(x), mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(es.LayerConfigError) as info:
        jax.jit(whole)(layer, x)
    message = str(info.value)
    assert "ColumnParallelLinear: its local weight has shape (64, 16)" in message
    assert "axis 'tp' of size 4 each device should hold 256 elements" in message


def test_a_box_whose_value_is_not_its_global_shape_is_refused():
    with pytest.raises(es.SpecError) as info:
        es.Sharded(jnp.ones((4, 4)), P("tp"), global_shape=(8, 4))
    assert "the value has shape (4, 4) but the box's global shape is (8, 4)" in str(info.value)
    assert "outside `shard_map` a box holds the global array, of shape (8, 4)" in str(info.value)
    # Inside shard_map a box holds its block: shape= gives the global shape.
    mesh = es.make_mesh("dp=2,tp=4")

    def block(x):
        with pytest.raises(es.SpecError, match="inside `shard_map` a box holds this device's block"):
            es.Sharded(x, P("tp"), global_shape=(16, 4))  # a global shape the block does not fit
        return es.Sharded(x, P("tp"), global_shape=(8, 4))

    out = jax.jit(es.filter_shard_map(block, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(
        jnp.ones((8, 4))
    )
    assert out.global_shape == (8, 4)


def test_adafactor_factored_moments_still_fall_back_to_replicated():
    import optax

    mesh = es.make_mesh("dp=2,tp=4")
    params = {"w": es.shard(es.Sharded(jnp.ones((256, 128)), P("tp")), mesh)}
    state = optax.adafactor(1e-3, min_dim_size_to_factor=32).init(params)
    specs = jax.tree.leaves(es.specs_of(state), is_leaf=lambda s: isinstance(s, P))
    assert P() in specs  # the factored row/column moments do not fit P("tp"): replicated


# ---------------------------------------------------------------------------------------
# A run directory is one run's; what a resume reads back; the environment
# ---------------------------------------------------------------------------------------


def _snapshot(directory):
    """Every file under `directory` with its bytes (to assert nothing was changed)."""
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_a_run_directory_is_one_runs(nan_run, tmp_path, capsys):
    """An unmarked non-empty directory and another run's are refused, files unchanged;
    a lock held by a live process is refused naming it; --overwrite with --resume too."""
    from equishard._app._rundir import LOCK
    from equishard._cli import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.toml").write_text("# my own\n")
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(mine)
    assert main([*TRAIN, "--run-dir", str(mine)]) == 2
    assert "is not empty (config.toml, metrics.jsonl) and holds no equishard run" in _one_line_error(capsys)
    assert _snapshot(mine) == before

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    before = _snapshot(run)
    assert main([*TRAIN, "--run-dir", str(run), "--checkpoint-dir", str(tmp_path / "other")]) == 2
    assert "holds an earlier equishard run" in _one_line_error(capsys)
    assert main([*TRAIN, "--run-dir", str(run), "--resume", "--overwrite"]) == 2
    assert "--overwrite and --resume exclude each other" in _one_line_error(capsys)
    (run / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": "then"}))
    assert main([*TRAIN, "--run-dir", str(run), "--resume"]) == 2
    assert f"is in use by another run (pid {os.getpid()} on host {os.uname().nodename}" in _one_line_error(capsys)
    (run / LOCK).unlink()
    assert _snapshot(run) == before


def test_a_stale_lock_is_taken_over_and_overwrite_moves_the_run_aside(nan_run, tmp_path):
    from equishard._app._rundir import LOCK, MARKER, RunLock, claim

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    before = _snapshot(run)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / LOCK).write_text(json.dumps({"pid": int(gone.stdout), "host": os.uname().nodename}))
    notes = []
    lock = claim(run, run / "checkpoints", resume=False, overwrite=True, print_fn=notes.append)
    assert f"taking over the stale lock of {run} (pid {int(gone.stdout)}" in notes[0]
    assert "--overwrite: moved 4 file(s) of the earlier run into" in notes[1]
    with pytest.raises(es.CheckpointError, match="in use by another run"):
        RunLock(run, notes.append)  # held now
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == sorted([MARKER, notes[1].split("/")[-1]])
    previous = run / notes[1].split("/")[-1]
    assert previous.name.startswith("previous-")
    assert _snapshot(previous) == {k: v for k, v in before.items() if k.parts[0] != MARKER}


def _edit_meta(run, step, edit):
    path = run / "checkpoints" / str(step) / "meta" / "metadata"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def test_a_resume_warns_of_an_unverified_step_and_refuses_a_newer_format(nan_run, tmp_path, capsys):
    from equishard._cli import main

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    _edit_meta(run, 2, lambda r: [a.pop("checksum") for a in r["arrays"]])
    argv = [*TRAIN, "--steps", "2", "--run-dir", str(run), "--resume"]
    assert main([*argv, "--require-verified"]) == 2
    message = _one_line_error(capsys)
    assert "--require-verified: the checkpoint at step 2" in message and "carries no checksums" in message
    assert main(argv) == 2  # warned, then: nothing left to train at step 2
    out, err = capsys.readouterr()
    assert "warning: the checkpoint at step 2" in out and "restored unverified" in out
    assert "nothing is left to train" in err
    _edit_meta(run, 2, lambda r: r.update(format_version=99))
    assert main(argv) == 2
    message = _one_line_error(capsys)
    assert "has checkpoint format version 99 (written by equishard" in message
    assert f"newer than the version {FORMAT_VERSION} this equishard reads" in message


def test_what_a_resume_reads_back_is_refused_in_one_line(nan_run, tmp_path, capsys, monkeypatch):
    """A binary metrics.jsonl, a config file that is not UTF-8 or is a directory, an
    oversized integer, an option spelled twice; a full disk writing config.toml; Ctrl-C.
    Each: exit 2, one line, the files as they were."""
    from equishard._app import _run
    from equishard._cli import main

    run = tmp_path / "run"
    shutil.copytree(nan_run[0], run)
    (run / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    before = _snapshot(run)
    assert main([*TRAIN, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    assert "metrics.jsonl is not a metrics log: byte 0 is not UTF-8" in _one_line_error(capsys)
    assert _snapshot(run) == before

    config = tmp_path / "bad.toml"
    for content, message in [
        (b"steps = 3\n\xff\xfe", "not UTF-8 text (byte 10)"),
        (b"steps = 99999999999999999999\n", "steps = 99999999999999999999 is too large"),
        (b"batch_size = 8\nbatch-size = 16\n", "'batch_size' and 'batch-size' are the same option"),
        (b"clip_norm = -1.0\n", "--clip-norm must be a finite number above 0, or 0 / none"),
    ]:
        config.write_bytes(content)
        assert main([*TRAIN, "--config", str(config), "--run-dir", str(tmp_path / "x")]) == 2
        assert message in _one_line_error(capsys)
    assert main([*TRAIN, "--config", str(tmp_path), "--run-dir", str(tmp_path / "x")]) == 2
    assert "cannot read it (Is a directory)" in _one_line_error(capsys)

    fsync = os.fsync

    def full_disk(fd):  # only the config file's write fails, as on a full disk
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".config.toml.tmp-" + str(os.getpid())):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(os, "fsync", full_disk)
    assert main([*TRAIN, "--steps", "3", "--run-dir", str(fresh)]) == 2
    assert f"cannot write {fresh.absolute()}/config.toml (No space left on device)" in _one_line_error(capsys)
    assert not [p for p in fresh.iterdir() if "config" in p.name]
    monkeypatch.undo()

    shutil.copy(nan_run[0] / "metrics.jsonl", run / "metrics.jsonl")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_run, "_write_config", interrupted)
    assert main([*TRAIN, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    line = _one_line_error(capsys)
    assert "interrupted (Ctrl-C); the last complete checkpoint is step 2" in line


def test_clip_norm_zero_or_none_means_no_clipping(tmp_path, monkeypatch):
    """On the command line and in a config file (and back from a run's config.toml)."""
    from equishard import _app
    from equishard._app._config import config_toml, load_config
    from equishard._cli import main

    seen = []
    monkeypatch.setattr(_app, "run", seen.append)
    for flag in ("0", "none", "0.5"):
        assert main([*TRAIN, "--clip-norm", flag]) == 0
    assert [c.clip_norm for c in seen] == [None, None, 0.5]
    config = tmp_path / "c.toml"
    for text in ("clip_norm = 0", "clip-norm = 'none'", "clip_norm = 0.0"):
        config.write_text(text)
        assert load_config(config) == {"clip_norm": None}
    config.write_text(config_toml(seen[0]))
    assert load_config(config)["clip_norm"] is None


def test_a_stray_step_name_is_never_removed(saved):
    directory, _ = saved
    (directory / "7").write_text("my notes")
    (directory / "0").mkdir()
    (directory / "0" / "x").write_text("mine")
    with pytest.raises(es.CheckpointError) as info:
        Checkpointer(directory, max_to_keep=1)
    assert "holds 0, 7, named like checkpoint steps but not saved ones" in str(info.value)
    assert (directory / "7").read_text() == "my notes" and (directory / "0" / "x").read_text() == "mine"


def test_orbax_errors_at_close_stay_checkpoint_errors(saved, monkeypatch):
    directory, states = saved

    def fails(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt = Checkpointer(directory)
    monkeypatch.setattr(ocp.CheckpointManager, "close", fails)
    with pytest.raises(es.CheckpointError, match=r"closing the checkpoints in .* failed \(.*No space left"):
        ckpt.close()
    ckpt = Checkpointer(directory)
    ckpt.close(quiet=True)  # while another error is reported: nothing raised over it
    monkeypatch.undo()


@pytest.mark.parametrize(
    "variable,value,argv,message",
    [
        ("JAX_PLATFORMS", "cuda", ["plan", "--model", "tiny", "--layout", "dp=8", "--devices", "8"], "JAX_PLATFORMS=cuda: this machine has no cuda backend (it has: cpu)"),
        ("JAX_PLATFORMS", "gpu", [*TRAIN], "JAX_PLATFORMS=gpu: this machine has no gpu backend (it has: cpu)"),
        ("JAX_NUM_CPU_DEVICES", "abc", [*TRAIN], "JAX_NUM_CPU_DEVICES='abc' is not a whole number"),
    ],
)  # fmt: skip
def test_the_environment_is_named_in_one_line(variable, value, argv, message, tmp_path, capsys, monkeypatch):
    from equishard._cli import main

    monkeypatch.setenv(variable, value)
    assert main([*argv, *(["--run-dir", str(tmp_path / "r")] if argv[0] == "train" else [])]) == 2
    assert message in _one_line_error(capsys)


def test_launch_relays_one_line_per_child(capfd, monkeypatch):
    """Two children started with a backend the machine lacks: each says so in one line
    (and a fresh `python -m equishard` refuses JAX_NUM_CPU_DEVICES=abc before JAX does)."""
    from equishard._cli import main

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert main(["launch", "-n", "2", "--", "equishard", "plan", "--model", "tiny", "--layout", "dp=2", "--devices", "2"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    for i in (0, 1):
        lines = [line for line in err.splitlines() if line.startswith(f"[{i}]")]
        assert len(lines) <= 1, lines  # the first failure stops the other, maybe before it printed
    assert "[0] equishard plan: error: JAX_PLATFORMS=cuda" in err or "[1] equishard plan: error: JAX_PLATFORMS=cuda" in err
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "abc"}
    env.pop("JAX_PLATFORMS")
    child = subprocess.run([sys.executable, "-m", "equishard", "train"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert child.returncode == 2 and child.stderr.count("\n") == 1, child.stderr
    assert "equishard: error: JAX_NUM_CPU_DEVICES='abc' is not a whole number" in child.stderr
