"""Checkpoints: resharding restore, retention, crash safety, clear errors, plain export."""

import dataclasses
import gc
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import equishard as es
from equishard.train import Checkpointer, export_model, import_model

from .helpers import jax_array

REPO = pathlib.Path(__file__).resolve().parents[1]


def _axis(mesh, name):
    return name if name in mesh.shape else None


class Tiny(eqx.Module):
    """An MLP-like module whose specs depend on the layout (as the reference GPT's do)."""

    w1: es.Sharded
    w2: es.Sharded
    bias: jax.Array
    scale: float
    act: Any = eqx.field(static=True)

    def __init__(self, mesh, width=32, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        fsdp, tp = _axis(mesh, "fsdp"), _axis(mesh, "tp")
        # f32[16, W] split over fsdp rows or tp columns; f32[W, 16] over tp rows.
        self.w1 = es.Sharded(jax.random.normal(k1, (16, width)), P(fsdp, tp))
        self.w2 = es.Sharded(jax.random.normal(k2, (width, 16)), P(tp or fsdp, None))
        self.bias = jax.random.normal(k3, (16,))
        self.scale = 0.5
        self.act = jax.nn.gelu


class State(eqx.Module):
    """A stand-in for the train step's `TrainState`."""

    step: jax.Array
    model: Tiny
    opt_state: Any
    key: jax.Array
    data_position: jax.Array


OPT = optax.adamw(1e-2)


def make_state(mesh, width=32, seed=0):
    key = jax.random.key(seed)
    model = es.sharded_init(lambda k: Tiny(mesh, width, key=k), key, mesh=mesh)
    params = eqx.filter(model, eqx.is_array)
    opt_state = OPT.init(params)
    # One update so that the moments are not trivial.
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    model = eqx.apply_updates(model, updates)
    return State(
        step=jnp.array(1, jnp.int32),
        model=model,
        opt_state=es.shard(opt_state, mesh),
        key=jax.random.fold_in(key, 7),
        data_position=jnp.array(16, jnp.int32),
    )


def host_leaves(tree):
    """Every array of `tree` on the host (keys as their data), with its path."""
    tree = es.unbox(tree)
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if eqx.is_array(x):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            out[jax.tree_util.keystr(path)] = np.asarray(x)
    return out


def assert_bit_identical(a, b):
    la, lb = host_leaves(a), host_leaves(b)
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k].dtype == lb[k].dtype, k
        np.testing.assert_array_equal(la[k], lb[k], err_msg=k)


def test_save_on_fsdp8_restore_on_dp2_tp4(tmp_path):
    mesh_a = es.make_mesh("fsdp=8")
    mesh_b = es.make_mesh("dp=2,tp=4")
    state = make_state(mesh_a)
    sharding = jax_array(state.model.w1).sharding
    assert isinstance(sharding, NamedSharding) and sharding.spec == P("fsdp", None)
    with Checkpointer(tmp_path / "ckpt", metadata={"width": 32}) as ckpt:
        assert ckpt.save(1, state)
    # A shape-only template built for the new layout, placed by its specs on the mesh.
    like = eqx.filter_eval_shape(make_state, mesh_b)
    ckpt = Checkpointer(tmp_path / "ckpt")
    restored = ckpt.restore(like, mesh=mesh_b)
    assert_bit_identical(restored, state)
    w1, w2 = restored.model.w1, restored.model.w2
    assert w1.spec == P(None, "tp") and w2.spec == P("tp", None)
    assert w1.value.sharding == NamedSharding(mesh_b, P(None, "tp"))
    assert w2.value.sharding == NamedSharding(mesh_b, P("tp", None))
    mu = restored.opt_state[0].mu.w1
    assert mu.value.sharding == NamedSharding(mesh_b, P(None, "tp"))
    assert restored.key.dtype == state.key.dtype  # a typed key again
    assert jax.random.key_impl(restored.key) == jax.random.key_impl(state.key)
    assert restored.model.act is jax.nn.gelu and restored.model.scale == 0.5
    # A real state as template: its arrays' shardings decide the placement.
    template = make_state(mesh_b, seed=1)
    again = ckpt.restore(template)
    assert_bit_identical(again, state)
    assert jax_array(again.model.w1).sharding == jax_array(template.model.w1).sharding
    # The restored state trains on: an update on the new layout works.
    params = eqx.filter(restored.model, eqx.is_array)
    updates, _ = OPT.update(params, restored.opt_state, params)
    eqx.apply_updates(restored.model, updates)
    meta = ckpt.read_metadata()
    assert meta["user"] == {"width": 32} and meta["step"] == 1
    by_path = {r["path"]: r for r in meta["arrays"]}
    assert by_path["model.w1"]["shape"] == [16, 32]
    assert by_path["model.w1"]["spec"] == str(P("fsdp", None))
    assert by_path["key"]["dtype"].startswith("key")
    ckpt.close()


class Wrap(eqx.Module):
    """A wrapper that adds a level to the paths (as an FSDP wrapper does)."""

    module: Tiny


class Holder(eqx.Module):
    body: Any


class Pair(eqx.Module):
    body: Any
    w1: Any


def test_path_map_restores_across_wrappers(tmp_path):
    mesh_a, mesh_b = es.make_mesh("fsdp=8"), es.make_mesh("dp=2,tp=4")
    tiny = make_state(mesh_a).model
    unwrap = lambda path: path.replace(".module.", ".")  # noqa: E731
    with Checkpointer(tmp_path, path_map=unwrap) as ckpt:
        ckpt.save(1, Holder(Wrap(tiny)))
    like = eqx.filter_eval_shape(lambda k: Holder(Tiny(mesh_b, key=k)), jax.random.key(0))
    with Checkpointer(tmp_path, path_map=unwrap) as ckpt:
        restored = ckpt.restore(like, mesh=mesh_b)
        keys = [r["path"] for r in ckpt.read_metadata()["arrays"]]
        assert keys == ["body.w1", "body.w2", "body.bias"]
    assert_bit_identical(restored.body, tiny)
    assert restored.body.w1.value.sharding == NamedSharding(mesh_b, P(None, "tp"))
    with Checkpointer(tmp_path) as ckpt:  # without the map the paths differ
        with pytest.raises(es.CheckpointError, match="template has an array `body.module.w1`"):
            ckpt.restore(Holder(Wrap(tiny)))
    with Checkpointer(tmp_path / "x", path_map=lambda p: p.split(".")[-1]) as ckpt:
        with pytest.raises(es.CheckpointError, match="`body.w1` and `w1` .* under the key `w1`"):
            ckpt.save(1, Pair(tiny, tiny.w1))


def test_restore_onto_a_single_device(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = make_state(mesh)
    shapes = eqx.filter_eval_shape(make_state, mesh)  # shape-only, no shardings
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state)
        with pytest.raises(es.CheckpointError, match=r"`model.w1` has spec .* pass `mesh=`"):
            ckpt.restore(shapes)
        # Into the plain (unboxed) model: the paths are the same, one device takes it all.
        restored = ckpt.restore(es.unbox(shapes))
    assert_bit_identical(restored, state)
    assert isinstance(restored.model.w1, jax.Array)
    assert restored.model.w1.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_max_to_keep_and_latest_step(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = make_state(mesh)
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        for step in range(1, 6):
            ckpt.save(step, eqx.tree_at(lambda s: s.step, state, jnp.array(step, jnp.int32)))
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() == 5
        assert int(ckpt.restore(state).step) == 5
        assert int(ckpt.restore(state, step=4).step) == 4
        with pytest.raises(es.CheckpointError, match=r"step 1: .* its steps are \[4, 5\]"):
            ckpt.restore(state, step=1)


def test_refuses_to_overwrite(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = make_state(mesh)
    other = make_state(mesh, seed=5)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        with pytest.raises(es.CheckpointError, match=r"step 2 in .* already exists"):
            ckpt.save(2, other)
        assert ckpt.save(2, other, exist_ok=True) is False
    with Checkpointer(tmp_path) as ckpt:  # a new process finds it on disk
        with pytest.raises(es.CheckpointError, match="never writes over a checkpoint"):
            ckpt.save(2, other)
        assert_bit_identical(ckpt.restore(other), state)


def test_missing_and_empty_directory(tmp_path):
    like = eqx.filter_eval_shape(make_state, es.make_mesh("fsdp=8"))
    missing = tmp_path / "nowhere"
    ckpt = Checkpointer(missing)
    with pytest.raises(es.CheckpointError, match="does not exist") as info:
        ckpt.restore(like)
    assert str(missing) in str(info.value) and info.value.__cause__ is None
    assert not missing.exists()  # opening a Checkpointer creates nothing
    ckpt.close()
    (tmp_path / "empty").mkdir()
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(es.CheckpointError, match="there is no checkpoint in"):
            ckpt.restore(like)


def _saved(tmp_path, mesh):
    state = make_state(mesh)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    return state


def ignore_orbax_failure_noise(test):
    """On its failure paths orbax leaves a coroutine un-awaited and an event loop closed;
    Python reports them when they are garbage-collected (orbax's noise, not ours).
    Tests so marked end with `gc.collect()` so that the reports land in them."""
    test = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")(test)
    return pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)


def _array_data_files(step_dir):
    """The files holding the array bytes of a step (orbax's OCDBT `d/` directories)."""
    files = [p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    return files


def _assert_clean(info):
    message = str(info.value)
    err = info.value
    # No chained traceback from inside JAX or orbax is shown.
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    assert "\n" not in message and "Traceback" not in message


@ignore_orbax_failure_noise
def test_corrupt_checkpoint_deleted_array_files(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = _saved(tmp_path, mesh)
    data_files = _array_data_files(tmp_path / "2")
    for p in data_files:
        p.unlink()
    with Checkpointer(tmp_path) as ckpt:
        match = r"step 2 in .* is corrupt or incomplete"
        with pytest.raises(es.CheckpointError, match=match) as info:
            ckpt.restore(state)
        _assert_clean(info)
        assert "Step 1 is intact" in str(info.value) and "--resume-step 1" in str(info.value)
        assert_bit_identical(ckpt.restore(state, step=1), state)  # step 1 is intact
    gc.collect()


@ignore_orbax_failure_noise
def test_corrupt_checkpoint_truncated_array_file(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = _saved(tmp_path, mesh)
    data_files = _array_data_files(tmp_path / "2")
    for p in data_files:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(es.CheckpointError, match="is corrupt or incomplete") as info:
            ckpt.restore(state)
        _assert_clean(info)
    gc.collect()


@ignore_orbax_failure_noise
def test_corrupt_checkpoint_missing_metadata(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = _saved(tmp_path, mesh)
    for p in (tmp_path / "2" / "meta").iterdir():
        p.unlink()
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(es.CheckpointError, match="metadata could not be read") as info:
            ckpt.restore(state)
        _assert_clean(info)
    gc.collect()


def test_checkpoint_of_a_different_model_shape(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = make_state(mesh, width=32)
    with Checkpointer(tmp_path, metadata={"model": "tiny", "width": 32}) as ckpt:
        ckpt.save(1, state)
    wider = eqx.filter_eval_shape(make_state, mesh, 64)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(es.CheckpointError) as info:
            ckpt.restore(wider, mesh=mesh)
    message = str(info.value)
    _assert_clean(info)
    assert "`model.w1` has shape (16, 32) in the checkpoint but (16, 64) in the template" in message
    assert str(tmp_path) in message and "step 1" in message
    assert '"width": 32' in message

    class Bigger(State):
        extra: jax.Array

    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(State)}
    bigger = Bigger(**fields, extra=jnp.zeros(3))
    with Checkpointer(tmp_path) as ckpt:
        match = r"template has an array `extra` \(shape \(3,\)\)"
        with pytest.raises(es.CheckpointError, match=match):
            ckpt.restore(bigger)
        smaller = eqx.tree_at(lambda s: s.model.bias, state, None)
        match = r"checkpoint holds an array `model.bias` \(shape \(16,\)\)"
        with pytest.raises(es.CheckpointError, match=match):
            ckpt.restore(smaller)
        bad_dtype = eqx.tree_at(lambda s: s.data_position, state, jnp.array(16.0))
        match = "`data_position` has dtype int32 in the checkpoint but float32"
        with pytest.raises(es.CheckpointError, match=match):
            ckpt.restore(bad_dtype)
        with pytest.raises(es.SpecError, match="not divisible"):
            ckpt.restore(eqx.filter_eval_shape(make_state, mesh), mesh=es.make_mesh("fsdp=3"))


def test_save_is_safe_to_donate_and_rejects_deleted_arrays(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    state = make_state(mesh)
    expected = host_leaves(state)
    bump = lambda x: x + 1 if eqx.is_inexact_array(x) else x  # noqa: E731
    step = eqx.filter_jit(lambda s: jax.tree.map(bump, s), donate="all")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        new = step(state)  # the old state is donated while the write may still run
        jax.block_until_ready(new)
        ckpt.wait()
        restored = ckpt.restore(new)
        got = host_leaves(restored)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
        jax_array(state.model.w1).delete()
        with pytest.raises(es.CheckpointError, match="`model.w1`: its array has been deleted"):
            ckpt.save(2, state)


_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import equishard as es
    from equishard.train import Checkpointer

    mesh = es.make_mesh("fsdp=8")
    # About 64 MB of incompressible data: each write takes a noticeable time.
    base = [jax.random.normal(jax.random.key(i), (2048, 2048)) for i in range(4)]
    ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
    step = 0
    while True:
        step += 1
        state = {
            "step": jnp.array(step, jnp.int32),
            "w": [es.shard(es.Sharded(b + step, P("fsdp", None)), mesh) for b in base],
        }
        print("saving", step, flush=True)
        ckpt.save(step, state)
        ckpt.wait()
        print("saved", step, flush=True)
    """
)


def test_sigkill_mid_save_leaves_the_last_complete_step(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, str(script), str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    saved, started = 0, False
    try:
        assert child.stdout is not None
        for line in child.stdout:
            word, number = line.split()
            if word == "saved":
                saved = int(number)
            elif word == "saving" and int(number) == 3:
                started = True
                break
        assert started, "the saving process exited early"
        # Kill as soon as step 3's temporary directory exists: its write is under way.
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("3.") for p in directory.iterdir()):
            assert time.monotonic() < deadline, "step 3's write never started"
            time.sleep(0.002)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    assert saved == 2
    leftovers = sorted(p.name for p in directory.iterdir())
    interrupted = [n for n in leftovers if ".orbax-checkpoint-tmp" in n]
    # The kill landed mid-write: step 3 exists only as a temporary directory.
    assert interrupted and interrupted[0].startswith("3."), leftovers
    assert "3" not in leftovers
    mesh = es.make_mesh("dp=2,tp=4")
    like = eqx.filter_eval_shape(
        lambda: {
            "step": jnp.array(0, jnp.int32),
            "w": [es.Sharded(jnp.zeros((2048, 2048)), P(None, "tp")) for _ in range(4)],
        }
    )
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() == 2
        restored = ckpt.restore(like, mesh=mesh)
        assert int(restored["step"]) == 2
        expected = jax.random.normal(jax.random.key(1), (2048, 2048)) + 2
        np.testing.assert_array_equal(np.asarray(restored["w"][1].value), np.asarray(expected))
        # The leftover is cleared when the directory is reopened, and saving goes on.
        ckpt.save(3, restored)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    assert not [p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def test_export_import_round_trip(tmp_path):
    mesh = es.make_mesh("fsdp=4,tp=2")
    model = make_state(mesh).model
    path = export_model(model, tmp_path / "out" / "tiny")
    assert path == tmp_path / "out" / "tiny.eqx" and path.is_file()
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary left behind
    # The plain model, built without equishard's boxes.
    plain_like = es.unbox(eqx.filter_eval_shape(lambda k: Tiny(mesh, key=k), jax.random.key(1)))
    plain = import_model(path, plain_like)
    assert isinstance(plain.w1, jax.Array) and plain.w1.sharding.num_devices == 1
    assert_bit_identical(plain, model)
    # Plain Equinox reads it with no equishard involved.
    raw = eqx.tree_deserialise_leaves(path, plain_like)
    assert_bit_identical(raw, model)
    # An equishard template gets its boxes refilled; shard places it on a mesh.
    boxed = es.shard(import_model(path, Tiny(mesh, key=jax.random.key(3))), mesh)
    assert_bit_identical(boxed, model)
    assert boxed.w1.value.sharding == NamedSharding(mesh, P("fsdp", "tp"))


def test_import_errors(tmp_path):
    mesh = es.make_mesh("fsdp=8")
    model = make_state(mesh).model
    path = export_model(model, tmp_path / "m.eqx")
    with pytest.raises(es.CheckpointError, match="there is no file"):
        import_model(tmp_path / "other.eqx", model)
    wider = Tiny(mesh, 64, key=jax.random.key(0))
    with pytest.raises(es.CheckpointError, match=r"m\.eqx: it does not fit the template") as info:
        import_model(path, wider)
    assert "(16, 64)" in str(info.value) and "(16, 32)" in str(info.value)
    _assert_clean(info)
    with pytest.raises(es.CheckpointError, match="more arrays than the template"):
        import_model(path, {"w1": model.w1})
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(es.CheckpointError, match=r"m\.eqx: .* is truncated .*EOF"):
        import_model(path, model)


_UNCLOSED_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from equishard.train import Checkpointer

    with Checkpointer(sys.argv[1], async_save=False) as ckpt:
        ckpt.save(1, {"w": jax.random.normal(jax.random.key(0), (4096, 4096))})
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(2, {"w": jax.random.normal(jax.random.key(1), (4096, 4096))})
    # Ends without ckpt.close() while step 2 (64 MB) is being written.
    """
)


def test_program_ending_without_close_never_keeps_a_partial_step(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_UNCLOSED_CHILD)
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # It ends at once: no orbax thread waits out its timeout (Python 3.12 held the exit
    # for five minutes while the step's directory was made by a thread of its own).
    done = subprocess.run(
        [sys.executable, str(script), str(directory)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    names = sorted(p.name for p in directory.iterdir())
    if "2" not in names:  # the usual case: the write was cut off at exit
        assert "the checkpoint of step 2" in done.stderr and "is discarded" in done.stderr
        assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    like = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    with Checkpointer(directory) as ckpt:
        latest = ckpt.latest_step()
        assert latest is not None and latest == (2 if "2" in names else 1)
        restored = ckpt.restore(like)
    expected = jax.random.normal(jax.random.key(latest - 1), (4096, 4096))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(expected))
