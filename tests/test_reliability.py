"""Nothing silently wrong: verified checkpoints, interrupted saves, unusable directories,
failed background writes, and shapes or specs that do not fit."""

import errno
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import equishard as es
from equishard.train import Checkpointer
from equishard.train._checkpoint import FAULT_ENV, probe_writable
from equishard.train._format import checksums

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
    """Flip 64 bytes in the middle of each large array data file of a step (orbax keeps
    the bytes of `w` in its process's file and in the merged one)."""
    files = [p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]
    large = [p for p in files if p.stat().st_size > 4096]
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


def test_checksums_can_be_turned_off(saved):
    directory, states = saved
    with Checkpointer(directory, checksums=False) as ckpt:
        ckpt.save(3, states[2])
        assert all("checksum" not in r for r in ckpt.read_metadata(3)["arrays"])
        _flip_64_bytes(directory / "2")
        ckpt.restore(states[2], step=2)  # not verified: the damage goes unseen
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
        for _ in range(10_000):  # the next training steps
            ckpt.poll()
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
    (tests run as root, which may write into a read-only directory)."""
    prologue = textwrap.dedent(
        """
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        import equishard.train._checkpoint
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
