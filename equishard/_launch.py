"""`equishard launch`: run a command as several local processes of one JAX multi-process run.

```
equishard launch -n 2 -- equishard train --layout dp=2,fsdp=2,tp=2 --model tiny
```

starts `n` copies of the command on this machine, each told through environment
variables (`equishard.distributed.launch_environment`) where the coordinator is
(`127.0.0.1` and a free port: nothing listens beyond the loopback), its process id, the
number of processes and how many CPU devices to simulate (`--devices` split evenly).
`equishard train` reads them and calls `equishard.distributed.initialize()` first;
any program can do the same. It is how a multi-host run is tested on one machine: the
processes share no memory and talk through gloo over TCP, exactly as hosts would.

Each line the processes print is prefixed with their id (`[0] ...`, `[1] ...`; stdout
to stdout, stderr to stderr), whole: two processes' lines never interleave, whichever
streams they come on. Gloo's "Rank N is connected to M peer ranks" notices (one per
process and peer, written by its C++ runtime piece by piece, sometimes into the middle of
another line or of each other) are dropped. If one process fails (a non-zero exit or a signal), or
the launcher itself gets SIGINT or SIGTERM, the others are stopped: SIGTERM to each
one's process group, then SIGKILL after a grace period (`--grace`, 5 s). JAX's
distributed runtime catches SIGTERM as a preemption notice (a program may poll
`multihost_utils.reached_preemption_sync_point` to save and exit), so a JAX process
typically ends at the SIGKILL; and a process whose peer died is usually stuck in a
collective or in the runtime's shutdown barrier, which only a kill ends. Each process
runs in its own session (process group), so nothing it started outlives it, and on
Linux it is sent SIGKILL if the launcher dies. The launcher exits with the first
failure's status (`128 + signal` for a signal), or 0 once every process has exited
with 0.

On a host with GPUs every process would see all of them: this launcher is for
simulated CPU devices; use a cluster's launcher (`srun`, `mpirun`) with
`equishard.distributed.initialize()` for accelerators.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ._cli_base import HelpFormatter

_POLL_SECONDS = 0.05
# Gloo's connection notice, written once per process and peer by its C++ runtime.
_GLOO_NOTICE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+\n"
)
# The literal pieces that notice is written in: two threads' pieces may interleave.
_GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank | is connected to | peer ranks\. |Expected number of connected peer ranks is : "
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the system picks it).

    **Arguments:**

    - `host`: the address to find a port on.

    **Returns:**

    The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_command(command: Sequence[str]) -> list[str]:
    """The command a process runs: `equishard ...` runs with the launcher's Python.

    **Arguments:**

    - `command`: the command line after `--`.

    **Returns:**

    `[sys.executable, "-P", "-m", "equishard", ...]` if the command is `equishard ...`
    (so the processes use the same interpreter and installation as the launcher; `-P`
    keeps the working directory off `sys.path`, as the `equishard` script does, so a
    `numpy.py` there is not imported), else the command unchanged.
    """
    command = list(command)
    if command and command[0] == "equishard":
        return [sys.executable, "-P", "-m", "equishard", *command[1:]]
    return command


def _die_with_parent() -> None:
    """In the child, before `exec`: ask Linux to SIGKILL it when the launcher dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _without_gloo_notices(text: bytes) -> bytes:
    """`text` without Gloo's connection notices, also where its threads wrote one into
    the middle of another (cut repeatedly until none is left)."""
    count = 1
    while count:
        text, count = _GLOO_NOTICE.subn(b"", text)
    return text


def _is_gloo_debris(line: bytes, after_debris: bool) -> bool:
    """Whether `line` is what is left of Gloo notices whose pieces interleaved: nothing
    but their literal pieces, numbers and blanks (a line of only numbers or blanks
    counts when it follows such a line: a notice's number may come after another's end
    of line)."""
    rest, pieces = _GLOO_PIECES.subn(b"", line)
    return not rest.strip(b" 0123456789\r\n") and (pieces > 0 or after_debris)


class _Pump(threading.Thread):
    """Copy a child's output stream to ours, each line prefixed with the child's id.

    Lines end at `\\n` or `\\r` (a progress bar redraws its line with `\\r`), so a
    redrawn line is prefixed too. Each is written whole under a lock that every pump
    shares, so no two lines interleave. Gloo's connection notices are cut out first,
    even from the middle of another line, and lines made of their interleaved pieces
    are dropped.
    """

    def __init__(self, source: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock):
        super().__init__(daemon=True)
        self._source, self._sink, self._prefix, self._lock = source, sink, prefix, lock

    def _write(self, line: bytes) -> None:
        with self._lock:
            self._sink.write(self._prefix + line)
            self._sink.flush()

    def run(self) -> None:
        pending, after_debris = b"", False
        fd = self._source.fileno()
        while chunk := os.read(fd, 65536):
            pending = _without_gloo_notices(pending + chunk)
            start = 0
            for i, byte in enumerate(pending):
                if byte in b"\n\r":
                    line = pending[start : i + 1]
                    after_debris = _is_gloo_debris(line, after_debris)
                    if not after_debris:
                        self._write(line)
                    start = i + 1
            pending = pending[start:]
        if pending and not _is_gloo_debris(pending, after_debris):
            self._write(pending + b"\n")
        self._source.close()


def _status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    """`n` local processes of one multi-process run (see the module documentation).

    **Arguments:**

    - `command`: the command every process runs.
    - `num_processes`: how many processes.
    - `devices`: CPU devices to simulate in all (split evenly; `None`: JAX's default per
      process).
    - `grace`: seconds between SIGTERM and SIGKILL when stopping the processes.
    - `stdout`, `stderr`: where the prefixed output goes (binary streams).
    """

    def __init__(
        self,
        command: Sequence[str],
        num_processes: int,
        *,
        devices: int | None = 8,
        grace: float = 5.0,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ):
        self.command = child_command(command)
        self.num_processes = num_processes
        self.devices = devices
        self.grace = grace
        self.stdout = sys.stdout.buffer if stdout is None else stdout
        self.stderr = sys.stderr.buffer if stderr is None else stderr
        self.processes: list[subprocess.Popen[bytes]] = []
        self._pumps: list[_Pump] = []
        # One lock for both streams: a terminal shows stdout and stderr as one.
        lock = threading.Lock()
        self._locks = (lock, lock)
        self._received: int | None = None

    def _say(self, text: str) -> None:
        with self._locks[1]:
            self.stderr.write(f"equishard launch: {text}\n".encode())
            self.stderr.flush()

    def _environment(self, coordinator: str, process_id: int) -> dict[str, str]:
        from .distributed import launch_environment

        per_process = None if self.devices is None else self.devices // self.num_processes
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(launch_environment(coordinator, self.num_processes, process_id, per_process))
        return env

    def _start(self) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        per = "" if self.devices is None else f" x {self.devices // self.num_processes} CPU devices"
        self._say(f"{self.num_processes} processes{per}, coordinator {coordinator}")
        for i in range(self.num_processes):
            process = subprocess.Popen(
                self.command,
                env=self._environment(coordinator, i),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, stopped as a whole
                preexec_fn=_die_with_parent,
            )
            self.processes.append(process)
            self._say(f"process {i}: pid {process.pid}")
        # Threads only once every child is forked (`preexec_fn` and threads do not mix).
        for i, process in enumerate(self.processes):
            assert process.stdout is not None and process.stderr is not None
            prefix = f"[{i}] ".encode()
            self._pumps.append(_Pump(process.stdout, self.stdout, prefix, self._locks[0]))
            self._pumps.append(_Pump(process.stderr, self.stderr, prefix, self._locks[1]))
        for pump in self._pumps:
            pump.start()

    def _on_signal(self, sig: int, frame: Any) -> None:
        del frame
        self._received = sig

    def _wait(self) -> int:
        """Wait until all succeed (0), one fails or a signal arrives (its exit code)."""
        while True:
            if self._received is not None:
                name = signal.Signals(self._received).name
                self._say(f"received {name}; stopping all processes")
                return 128 + self._received
            codes = [p.poll() for p in self.processes]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    self._say(
                        f"process {i} (pid {self.processes[i].pid}) {_status(code)}; "
                        f"stopping the others"
                    )
                    return _exit_code(code)
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_SECONDS)

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after `grace` seconds."""
        for process in self.processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(_POLL_SECONDS)
        for process in self.processes:
            _signal_group(process, signal.SIGKILL)
            process.wait()

    def run(self) -> int:
        """Start the processes, relay their output, and wait; stop all on a failure.

        **Returns:**

        0 if every process exited with 0; else the first failure's exit status
        (`128 + signal` if it was killed), or `128 + signal` for a signal the launcher
        received.
        """
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self._start()
            code = self._wait()
        finally:
            self.stop()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        for pump in self._pumps:
            pump.join(timeout=5)
        return code


def _launch(args: argparse.Namespace) -> int:
    from ._errors import EquishardError

    command = list(args.child)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise EquishardError("no command to launch: give it after `--`, e.g. `equishard launch -n 2 -- equishard train`.")
    if args.num_processes < 1:
        raise EquishardError(f"-n must be at least 1, got {args.num_processes}.")
    if args.devices is not None and (args.devices < 1 or args.devices % args.num_processes):
        raise EquishardError(
            f"--devices {args.devices} does not split evenly over {args.num_processes} "
            f"processes; give a multiple of -n."
        )
    program = child_command(command)[0]
    if shutil.which(program) is None:
        raise EquishardError(
            f"cannot launch {command[0]!r}: no such program ({program} is not an executable "
            f"file, nor a command on PATH)."
        )
    launcher = Launcher(command, args.num_processes, devices=args.devices, grace=args.grace)
    return launcher.run()


def add_launch_parser(sub: Any) -> None:
    """Register `equishard launch` on the command line's subparsers, its options generated
    from `LaunchConfig`."""
    p = sub.add_parser(
        "launch",
        help="run a command as several local processes of one JAX multi-process run",
        description=(
            "Start N local processes of COMMAND with the JAX coordinator on 127.0.0.1 "
            "and a free port, each simulating DEVICES/N CPU devices; prefix their output "
            "with their id; stop all if one fails. `equishard train` joins the run by "
            "itself; other programs call equishard.distributed.initialize()."
        ),
        formatter_class=HelpFormatter,
        usage="equishard launch [-h] [-n N] [--devices DEVICES] [--grace SECONDS] -- COMMAND ...",
    )
    from ._app._internal import LaunchConfig, add_options

    add_options(p, LaunchConfig)
    p.set_defaults(run=_launch)
