"""Multi-process runs for real: `equishard launch` starts JAX processes on localhost.

The processes share nothing but the file system and talk through JAX's coordinator and
gloo over TCP, as hosts would. They run in subprocesses, so this process's own 8
simulated devices serve only the single-process reference runs.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from equishard._app import Run, TrainConfig, get_batch, load_stdlib_corpus
from equishard._cli import main
from equishard._launch import child_command
from equishard.distributed import (
    DistributedError,
    default_bind_address,
    global_array_from_rows,
    initialize,
    is_coordinator,
    is_loopback,
    launch_environment,
    process_rows,
)
from equishard.models._gpt import canonical_path
from equishard.train import Checkpointer

STEPS = 10
LAYOUT = "dp=2,fsdp=2,tp=2"
ARGS = [
    "--layout", LAYOUT, "--model", "tiny", "--steps", str(STEPS), "--batch-size", "8",
    "--seq-len", "32", "--checkpoint-every", "3", "--eval-every", str(STEPS),
    "--sample-bytes", "0", "--no-progress", "--no-plot",
]  # fmt: skip
LAUNCH_TIMEOUT = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQUISHARD_")}
    return dict(env, JAX_PLATFORMS="cpu")


def _launch(log: pathlib.Path, *command: str, n: int = 2, grace: float = 5.0) -> subprocess.Popen:
    argv = [sys.executable, "-m", "equishard", "launch", "-n", str(n), "--devices", "8",
            "--grace", str(grace), "--", *command]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def _launch_train(run_dir: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    # `equishard` as the command: the processes run with the launcher's Python.
    return _launch(log, "equishard", "train", *ARGS, "--run-dir", str(run_dir))


def _wait_for(predicate, launcher: subprocess.Popen, log: pathlib.Path, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited ({launcher.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    launcher.kill()
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def _from_log(log: pathlib.Path, pattern: str) -> list[str]:
    return re.findall(pattern, log.read_text(errors="replace"))


def _pids(log: pathlib.Path) -> list[int] | None:
    pids = [int(p) for p in _from_log(log, r"process \d+: pid (\d+)")]
    return pids if len(pids) == 2 else None


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    from equishard._app._metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")  # a resumed run's, as its readers see it
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"metrics.jsonl repeats steps: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range) -> float:
    worst = 0.0
    for step in steps:
        rel = abs(got[step] - want[step]) / abs(want[step])
        assert rel <= 1e-5, (step, got[step], want[step])
        worst = max(worst, rel)
    return worst


def _alive(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run on this process's 8 devices."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", *ARGS, "--run-dir", str(run_dir)]) == 0
    return run_dir


# -------------------------------------------------------------------------------------
# Listening sockets, read from /proc
# -------------------------------------------------------------------------------------

_LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1


def _listening() -> list[tuple[str, int, str]]:
    """(local address as /proc writes it, port, socket inode) of every LISTEN socket."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A":  # TCP_LISTEN
                rows.append((address, int(port, 16), fields[9]))
    return rows


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(pathlib.Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:  # the process has exited
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _proc_address(ip: str) -> set[str]:
    """How /proc/net writes an IPv4 address: as itself and as an IPv4-mapped IPv6 one."""
    hex_ip = socket.inet_aton(ip)[::-1].hex().upper()
    return {hex_ip, "0000000000000000FFFF0000" + hex_ip}


def _host_name_addresses() -> set[str]:
    """Where gloo may listen: what this machine's host name resolves to (IPv4)."""
    infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    return set().union(*(_proc_address(str(info[4][0])) for info in infos))


# -------------------------------------------------------------------------------------
# The acceptance tests: 2 processes x 4 devices against 1 process x 8
# -------------------------------------------------------------------------------------


def test_two_processes_train_like_one_and_listen_on_loopback(reference, tmp_path):
    run_dir, log = tmp_path / "two", tmp_path / "launch.log"
    start = time.monotonic()
    launcher = _launch_train(run_dir, log)
    try:
        port = int(_wait_for(lambda: _from_log(log, r"coordinator 127\.0\.0\.1:(\d+)"), launcher, log, "the coordinator")[0])
        pids = _wait_for(lambda: _pids(log), launcher, log, "the processes' ids")

        def listeners() -> dict[int, list[tuple[str, int]]] | None:
            rows = _listening()
            owned = {pid: _socket_inodes(pid) for pid in pids}
            found = {pid: [(a, p) for a, p, inode in rows if inode in owned[pid]] for pid in pids}
            # process 0: the coordinator and gloo; process 1: gloo
            return found if len(found[pids[0]]) >= 2 and len(found[pids[1]]) >= 1 else None

        found = _wait_for(listeners, launcher, log, "the processes' listening sockets")
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    seconds = time.monotonic() - start
    assert code == 0, log.read_text()[-5000:]

    # The coordinator listens on 127.0.0.1 only; gloo on the host name's address.
    coordinator = [a for a, p in found[pids[0]] if p == port]
    assert coordinator and set(coordinator) <= _LOOPBACK, (coordinator, found)
    allowed = _LOOPBACK | _host_name_addresses()
    for pid, sockets in found.items():
        assert {a for a, _ in sockets} <= allowed, (pid, sockets, allowed)

    # Per-step losses equal the single-process run's; metrics.jsonl written once.
    want, got = _losses(reference), _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = _assert_same_losses(got, want, range(1, STEPS + 1))
    print(f"\n2 processes x 4 devices: {seconds:.0f} s, worst relative loss difference {worst:.1e}")
    text = log.read_text()
    assert "[0] done: 10 steps" in text and "[1] done:" not in text  # process 0 prints
    assert "Gloo" not in text  # gloo's connection notices are dropped
    assert (run_dir / "model.eqx").is_file()

    # The checkpoint the two processes wrote restores in this single process.
    run = Run(TrainConfig(layout=LAYOUT, model="tiny", batch_size=8, seq_len=32))
    template = run.state_template()
    with Checkpointer(run_dir / "checkpoints", path_map=canonical_path) as ckpt:
        assert ckpt.all_steps() == [6, 9, 10]  # keep_checkpoints=3 of 3, 6, 9, 10
        two = ckpt.restore(template, mesh=run.mesh)
    with Checkpointer(reference / "checkpoints", path_map=canonical_path) as ckpt:
        one = ckpt.restore(template, mesh=run.mesh)
    assert int(two.step) == STEPS and int(two.data_position) == STEPS * 8
    pairs = zip(jax.tree.leaves(two.model), jax.tree.leaves(one.model), strict=True)
    for x, y in pairs:
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_killing_one_process_stops_the_other_and_the_run_resumes(reference, tmp_path):
    run_dir, log = tmp_path / "killed", tmp_path / "launch.log"
    launcher = _launch_train(run_dir, log)
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "3").is_dir(), launcher, log, "the first checkpoint")
        pids = _pids(log)
        assert pids is not None
        os.kill(pids[1], signal.SIGKILL)
        code = launcher.wait(timeout=LAUNCH_TIMEOUT)  # a hang guard, not a measurement
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # The launcher saw process 1 die, stopped process 0 and exits with the failure's status.
    assert code == 128 + signal.SIGKILL
    assert re.search(rf"process 1 \(pid {pids[1]}\) .*SIGKILL; stopping the others", log.read_text())
    assert not any(_alive(pid) for pid in pids)

    # The last complete checkpoint is intact, and one process resumes the two's run
    # on the same sample sequence: the losses continue those of the reference.
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        last = ckpt.latest_step()
    assert last is not None and 3 <= last < STEPS
    assert main(["train", *ARGS, "--run-dir", str(run_dir), "--resume"]) == 0
    _assert_same_losses(_losses(run_dir), _losses(reference), range(last + 1, STEPS + 1))


_CHECK_ROWS = """
import numpy as np, jax
from equishard import distributed
distributed.initialize()
from jax.experimental import multihost_utils
from equishard._app import Run, TrainConfig, get_batch, load_stdlib_corpus

run = Run(TrainConfig(layout="dp=2,fsdp=2,tp=2", model="tiny", batch_size=8, seq_len=32))
i = jax.process_index()
# the data axes span the processes process-major: process i holds rows [4i, 4i + 4)
assert distributed.process_rows(run.batch_sharding, (8, 33)) == [range(4 * i, 4 * i + 4)]
data = load_stdlib_corpus().train
batch = run.batch(data, 16)
want = get_batch(data, 16, 8, 32, seed=0)
for shard in batch.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
np.testing.assert_array_equal(multihost_utils.process_allgather(batch, tiled=True), want)
print("rows ok")
"""


def test_each_process_reads_only_the_rows_its_devices_hold(tmp_path):
    log = tmp_path / "launch.log"
    code = _launch(log, sys.executable, "-c", _CHECK_ROWS).wait(timeout=LAUNCH_TIMEOUT)
    assert code == 0, log.read_text()[-3000:]
    assert "[0] rows ok" in log.read_text() and "[1] rows ok" in log.read_text()


# -------------------------------------------------------------------------------------
# The launcher with plain Python children (no JAX): output, environment, failures
# -------------------------------------------------------------------------------------

_SHOW_ENV = (
    "import os; e = os.environ; print(e['EQUISHARD_PROCESS_ID'], e['EQUISHARD_NUM_PROCESSES'], "
    "e['EQUISHARD_LOCAL_DEVICE_COUNT'], e['EQUISHARD_COORDINATOR']); print('two\\nlines')"
)


def test_launcher_prefixes_output_and_sets_the_environment(tmp_path):
    log = tmp_path / "launch.log"
    assert _launch(log, sys.executable, "-c", _SHOW_ENV, n=4).wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    for i in range(4):
        shown = [line for line in lines if line.startswith(f"[{i}] {i} 4 2 127.0.0.1:")]
        assert len(shown) == 1, lines
        assert f"[{i}] two" in lines and f"[{i}] lines" in lines


_FAIL = """
import os, subprocess, sys, time
me, flag = os.environ["EQUISHARD_PROCESS_ID"], sys.argv[1]
if me == "0":
    child = subprocess.Popen(["sleep", "600"])
    with open(flag + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(flag + ".tmp", flag)
    time.sleep(600)
    open(flag + ".slept", "w").close()  # only if nobody stopped it
else:
    while not os.path.exists(flag):
        time.sleep(0.02)
    sys.exit(3)
"""


_CHATTY = """
import os, sys, time
me = os.environ["EQUISHARD_PROCESS_ID"]
gloo = "[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n"
for i in range(30):
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{me}-{i}-")  # half a line, then a pause: another process may write
        stream.flush()
        if i % 3 == 0:  # gloo's threads write into the middle of lines, and of each other
            notice = gloo.format(me)
            stream.write(notice[:12] + gloo.format(1 - int(me)) + notice[12:])
            stream.flush()
        time.sleep(0.002)
        stream.write("x" * 40 + "\\n")
        stream.flush()
        if i % 3 == 1:  # two threads write a notice each, piece by piece, one a piece behind
            pieces = [["[Gloo] Rank ", str(r), " is connected to ", "1", " peer ranks. ",
                       "Expected number of connected peer ranks is : ", "1", "\\n"] for r in (0, 1)]
            for a, b in zip(pieces[0] + [""], [""] + pieces[1]):
                stream.write(a + b)
                stream.flush()
"""


def test_launcher_lines_are_whole_and_gloo_notices_dropped(tmp_path):
    log = tmp_path / "launch.log"  # the launcher's stdout and stderr, as on a terminal
    assert _launch(log, sys.executable, "-c", _CHATTY).wait(timeout=60) == 0
    lines = [line for line in log.read_text().splitlines() if not line.startswith("equishard launch:")]
    want = sorted(f"[{p}] {p}-{i}-{'x' * 40}" for p in (0, 1) for i in range(30) for _ in range(2))
    assert sorted(lines) == want


def test_launched_equishard_ignores_a_numpy_py_in_the_working_directory(tmp_path):
    marker = tmp_path / "executed"
    (tmp_path / "numpy.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(9)\n")
    # `-P`: the launcher as the `equishard` script runs it, without the directory on sys.path.
    argv = [sys.executable, "-P", "-m", "equishard", "launch", "-n", "2", "--devices", "2", "--",
            "equishard", "train", "--help"]  # fmt: skip
    done = subprocess.run(argv, env=_env(), cwd=tmp_path, capture_output=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"[0] usage: equishard train" in done.stdout and b"[1] usage: equishard train" in done.stdout
    assert not marker.exists()


def test_launcher_stops_everything_when_one_process_fails(tmp_path):
    log, flag = tmp_path / "launch.log", tmp_path / "pids"
    # Process 0 would sleep 600 s: the launcher must stop it, not wait for it.
    code = _launch(log, sys.executable, "-c", _FAIL, str(flag), grace=2).wait(timeout=LAUNCH_TIMEOUT)
    assert code == 3, log.read_text()
    assert re.search(r"process 1 \(pid \d+\) exited with status 3; stopping the others", log.read_text())
    assert not pathlib.Path(str(flag) + ".slept").exists()
    for pid in map(int, flag.read_text().split()):  # process 0 and the `sleep` it started
        assert not _alive(pid)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--warmup", "-5"], "--warmup must be 0 or more, got -5."),
        (["--batch-size", "6"], "--batch-size 6 is not divisible by the 4 ways"),
        (["--checkpoint-dir", "{file}"], "is a file, not a directory"),
    ],
)
def test_every_process_raises_the_same_error(extra, message, tmp_path):
    """A bad option, a layout that does not fit, an unusable directory: each process says
    the same one line, and the launcher exits with its status."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    extra = [arg.replace("{file}", str(a_file)) for arg in extra]
    log = tmp_path / "launch.log"
    argv = [*ARGS, "--run-dir", str(tmp_path / "run"), *extra]
    code = _launch(log, "equishard", "train", *argv).wait(timeout=LAUNCH_TIMEOUT)
    text = log.read_text()
    assert code == 2 and "Traceback" not in text, text
    errors = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\[(\d)\] (equishard train: error: .*)", line)
        if match:
            errors.setdefault(match[1], []).append(match[2])
    assert sorted(errors) == ["0", "1"], text
    assert errors["0"] == errors["1"] and len(errors["0"]) == 1 and message in errors["0"][0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["launch", "-n", "3", "--", "true"], "does not split evenly over 3 processes"),
        (["launch", "-n", "2"], "no command to launch"),
    ],
)
def test_launch_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_equishard_children_use_the_launchers_python():
    assert child_command(["equishard", "train"]) == [sys.executable, "-P", "-m", "equishard", "train"]
    assert child_command(["./my_script.py", "-x"]) == ["./my_script.py", "-x"]


# -------------------------------------------------------------------------------------
# equishard.distributed in this (single) process
# -------------------------------------------------------------------------------------


def test_a_local_coordinator_binds_the_loopback_only():
    assert default_bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert default_bind_address("localhost:99") == "127.0.0.1:99"
    assert default_bind_address("[::1]:5") == "[::1]:5"
    assert default_bind_address("10.0.0.1:1234") is None  # JAX's default: every interface
    assert default_bind_address("node17:1234") is None
    assert is_loopback("127.3.2.1") and not is_loopback("192.0.2.2")
    with pytest.raises(DistributedError, match="host:port"):
        default_bind_address("127.0.0.1")


def test_launch_environment_is_what_initialize_reads():
    env = launch_environment("127.0.0.1:5", 2, 1, 4)
    assert env == {
        "EQUISHARD_COORDINATOR": "127.0.0.1:5",
        "EQUISHARD_NUM_PROCESSES": "2",
        "EQUISHARD_PROCESS_ID": "1",
        "EQUISHARD_LOCAL_DEVICE_COUNT": "4",
    }


def test_initialize_after_jax_started_is_a_clear_error():
    jax.devices()  # this process's backend is running
    with pytest.raises(DistributedError, match="before JAX starts its backend"):
        initialize("127.0.0.1:1", 2, 0, local_device_count=4)
    assert not jax.distributed.is_initialized() and is_coordinator()


class _FakeSharding(jax.sharding.Sharding):
    """A process's view of a sharding: the one method `process_rows` reads, given rows."""

    def __init__(self, *rows: slice):
        self.rows = rows

    def addressable_devices_indices_map(self, shape):
        return {i: (r, slice(None)) for i, r in enumerate(self.rows)}


def test_process_rows():
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    one_process = NamedSharding(mesh, P(("dp", "fsdp")))
    assert process_rows(one_process, (8, 33)) == [range(0, 8)]
    # devices holding rows 2-3 (twice: replicas over tp) and 4-5, and non-adjacent ones
    assert process_rows(_FakeSharding(slice(2, 4), slice(2, 4), slice(4, 6)), (8, 3)) == [range(2, 6)]
    assert process_rows(_FakeSharding(slice(6, 8), slice(0, 2)), (8, 3)) == [range(0, 2), range(6, 8)]
    assert process_rows(_FakeSharding(slice(None)), (8, 3)) == [range(0, 8)]


def test_global_array_from_rows_is_the_global_batch():
    data = load_stdlib_corpus().train
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    sharding = NamedSharding(mesh, P("dp"))
    reads = []

    def rows(start, stop):
        reads.append((start, stop))
        return get_batch(data, 40 + start, stop - start, 16, seed=3)

    batch = global_array_from_rows(sharding, (8, 17), rows)
    assert batch.sharding == sharding and reads == [(0, 8)]
    np.testing.assert_array_equal(np.asarray(batch), get_batch(data, 40, 8, 16, seed=3))
