"""Starting JAX's multi-controller runtime, and the rows of a batch each process reads.

**The runtime.** A multi-host run is JAX's own: one Python process per host (or per
group of devices), each running the same program, joined by `jax.distributed.initialize`
into one set of global devices. Process 0 also runs the *coordinator*, a small gRPC
service the others connect to at start-up (to exchange device topologies) and through
which they keep a key-value store and heartbeats. Cross-process collectives then go
through NCCL on GPUs, the TPU runtime on TPUs and gloo (TCP) on CPUs.

**Where the arguments come from**, first match wins:

1. the arguments given to `initialize`;
2. the variables `equishard launch` sets for each process it starts:
   `EQUISHARD_COORDINATOR` (`host:port`), `EQUISHARD_PROCESS_ID`,
   `EQUISHARD_NUM_PROCESSES` and `EQUISHARD_LOCAL_DEVICE_COUNT` (CPU devices to
   simulate in this process);
3. JAX's own cluster detection (`cluster=`, JAX's `cluster_detection_method`): under
   SLURM (`srun`), Open MPI (`mpirun`), Cloud TPU VMs (GCE and GKE) and Kubernetes
   (with the `kubernetes` package) JAX reads the coordinator, the process count and
   this process's id from the environment, and `JAX_COORDINATOR_ADDRESS` is honoured
   too; other MPI launchers work with `cluster="mpi4py"` (needs `mpi4py`);
   `cluster="deactivate"` turns detection off.

**What listens where.**

- The coordinator (process 0) binds `coordinator_bind_address`. JAX's default is every
  interface (`[::]:port`), which a cluster needs (the other hosts must reach it). When
  the coordinator address is a loopback address (`127.0.0.1`, `localhost`, `::1`), as
  for `equishard launch`, `initialize` binds that address only, so a local run opens no
  port to the network (the gRPC server's socket is dual-stack: it shows as
  `::ffff:127.0.0.1` in `/proc/net/tcp6`).
- gloo (CPU collectives) listens on one TCP port per process and connects to its
  peers' ports, which it learns through the coordinator. JAX creates gloo's TCP device
  with no host name and no interface, so gloo binds **the address this machine's host
  name resolves to**: the first result of `getaddrinfo(gethostname())` it can bind
  (`socket.getaddrinfo(socket.gethostname(), None)` shows the list). On a machine
  whose `/etc/hosts` maps its name to `127.0.0.1` that is the loopback; on a typical
  cluster node it is the node's network address, which multi-host CPU runs need. The
  port is chosen by the system. Make the host name resolve to an address the other
  processes can reach (and, for a local run that must stay off the network, to the
  loopback).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._errors import DistributedError

COORDINATOR_ENV = "EQUISHARD_COORDINATOR"
"""`host:port` of the coordinator (process 0), set by `equishard launch`."""
PROCESS_ID_ENV = "EQUISHARD_PROCESS_ID"
"""This process's id in `range(num_processes)`, set by `equishard launch`."""
NUM_PROCESSES_ENV = "EQUISHARD_NUM_PROCESSES"
"""The number of processes, set by `equishard launch`."""
LOCAL_DEVICE_COUNT_ENV = "EQUISHARD_LOCAL_DEVICE_COUNT"
"""CPU devices to simulate in this process, set by `equishard launch`."""


def is_launched() -> bool:
    """Whether this process was started as one of several (`EQUISHARD_COORDINATOR` is set).

    `equishard train` calls `initialize()` first thing when it is.

    **Returns:**

    `True` if the variables of `equishard launch` are in the environment.
    """
    return bool(os.environ.get(COORDINATOR_ENV))


def launch_environment(
    coordinator_address: str, num_processes: int, process_id: int, local_device_count: int | None
) -> dict[str, str]:
    """The environment variables that make `initialize()` join a run.

    **Arguments:**

    - `coordinator_address`: `host:port` of process 0's coordinator.
    - `num_processes`: how many processes take part.
    - `process_id`: this process, in `range(num_processes)`.
    - `local_device_count`: CPU devices to simulate in this process (`None`: leave it).

    **Returns:**

    A dict of `EQUISHARD_*` variables to add to the process's environment.
    """
    env = {
        COORDINATOR_ENV: coordinator_address,
        NUM_PROCESSES_ENV: str(num_processes),
        PROCESS_ID_ENV: str(process_id),
    }
    if local_device_count is not None:
        env[LOCAL_DEVICE_COUNT_ENV] = str(local_device_count)
    return env


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"the environment variable {name}={text!r} is not an integer.") from None


def _split_host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedError(
            f"the coordinator address {address!r} is not of the form host:port (e.g. "
            f"'127.0.0.1:1234' or '[::1]:1234')."
        )
    return host, port


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 possibly in brackets) is this machine only.

    **Arguments:**

    - `host`: e.g. `"127.0.0.1"`, `"localhost"`, `"[::1]"`, `"node17"`.

    **Returns:**

    `True` for `localhost` and loopback addresses (`127.0.0.0/8`, `::1`).
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_bind_address(coordinator_address: str) -> str | None:
    """Where the coordinator listens unless told otherwise.

    **Arguments:**

    - `coordinator_address`: `host:port`.

    **Returns:**

    The same `host:port` for a loopback host (`localhost` becomes `127.0.0.1`): a local
    run listens on the loopback only. `None` otherwise: JAX's default, every interface
    on that port, which other hosts need.
    """
    host, port = _split_host_port(coordinator_address)
    if not is_loopback(host):
        return None
    return f"{'127.0.0.1' if host == 'localhost' else host}:{port}"


def _set_cpu_config(local_device_count: int | None, cpu_collectives: str | None) -> None:
    try:
        if cpu_collectives is not None:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        if local_device_count is not None:
            if local_device_count < 1:
                raise DistributedError(
                    f"local_device_count must be at least 1, got {local_device_count}."
                )
            jax.config.update("jax_num_cpu_devices", local_device_count)
    except RuntimeError as err:
        raise DistributedError(_too_late(err)) from None


def _too_late(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"equishard.distributed.initialize() must run before JAX starts its backend, i.e. "
        f"before any computation, jax.devices() or device_put in this process ({first})."
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    cluster: str | None = None,
    coordinator_bind_address: str | None = None,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int = 300,
    **jax_kwargs: Any,
) -> None:
    """Join this process to a multi-process run (`jax.distributed.initialize`).

    Call it first thing, before any JAX computation: afterwards `jax.devices()` lists
    every process's devices, meshes span them, and each process runs the same program
    on its own devices. A no-op if the runtime is already initialised.

    ```python
    # explicit, e.g. on two hosts:
    equishard.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    # under srun / mpirun / a Cloud TPU VM / equishard launch: from the environment
    equishard.distributed.initialize()
    ```

    See the module documentation for where unset arguments come from and what binds
    which address.

    **Arguments:**

    - `coordinator_address`: `host:port` of process 0, where it runs the coordinator.
    - `num_processes`: the number of processes.
    - `process_id`: this process's id, in `range(num_processes)`.
    - `local_device_count`: CPU devices to simulate in this process
      (`jax_num_cpu_devices`; the CPU backend only, GPUs and TPUs are what the host
      has).
    - `cluster`: JAX's `cluster_detection_method`: `None` to detect SLURM, Open MPI,
      Cloud TPU and Kubernetes environments, `"mpi4py"` for other MPI launchers,
      `"deactivate"` to rely on the arguments only.
    - `coordinator_bind_address`: where process 0's coordinator listens; default
      `default_bind_address(coordinator_address)` (the loopback for a loopback
      coordinator, every interface otherwise; `JAX_COORDINATOR_ADDRESS` counts as
      the coordinator address when none is given).
    - `cpu_collectives`: the CPU backend's cross-process collectives
      (`jax_cpu_collectives_implementation`): `"gloo"` (TCP), `"mpi"`, or `None` to
      leave JAX's setting.
    - `initialization_timeout`: seconds to wait for every process to connect.
    - `**jax_kwargs`: passed to `jax.distributed.initialize` (e.g.
      `heartbeat_timeout_seconds`, `local_device_ids`).

    **Raises:**

    `DistributedError` if JAX's backend has already started, an `EQUISHARD_*` variable
    is malformed, or the runtime cannot start (one paragraph, with JAX's reason).
    """
    if jax.distributed.is_initialized():
        return
    if coordinator_address is None:
        coordinator_address = os.environ.get(COORDINATOR_ENV) or None
    if num_processes is None:
        num_processes = _env_int(NUM_PROCESSES_ENV)
    if process_id is None:
        process_id = _env_int(PROCESS_ID_ENV)
    if local_device_count is None:
        local_device_count = _env_int(LOCAL_DEVICE_COUNT_ENV)
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator_bind_address is None and address:
        coordinator_bind_address = default_bind_address(address)
    _set_cpu_config(local_device_count, cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            cluster_detection_method=cluster,
            coordinator_bind_address=coordinator_bind_address,
            initialization_timeout=initialization_timeout,
            **jax_kwargs,
        )
    except RuntimeError as err:
        if "before any JAX" in str(err):
            raise DistributedError(_too_late(err)) from None
        raise DistributedError(
            f"could not join the multi-process run (coordinator {coordinator_address}, "
            f"process {process_id} of {num_processes}): {err}"
        ) from None
    except ValueError as err:
        raise DistributedError(
            f"cannot start the multi-process runtime: {err} Give the arguments to "
            f"equishard.distributed.initialize, run under a cluster JAX detects (SLURM, "
            f"Open MPI, Cloud TPU, Kubernetes), or start the processes with `equishard "
            f"launch`."
        ) from None


def is_coordinator() -> bool:
    """Whether this is process 0, the one that prints, plots and writes shared files.

    **Returns:**

    `jax.process_index() == 0` (`True` in a single-process run).
    """
    return jax.process_index() == 0


def process_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> list[range]:
    """The rows of a global array that this process's devices hold.

    Computed from `sharding.addressable_devices_indices_map`, so it is right for any
    device order: with the data axes laid out process-major (as `jax.make_mesh` orders
    CPU and GPU devices), process `i` of `n` holds the contiguous share
    `[i * rows // n, (i + 1) * rows // n)`; replicated rows (a batch not split over
    processes) give every process all rows.

    **Arguments:**

    - `sharding`: the global array's sharding (e.g. `NamedSharding(mesh, P("dp"))`).
    - `global_shape`: the global array's shape, rows first.

    **Returns:**

    Sorted, disjoint, maximal runs of consecutive row indices, e.g. `[range(0, 4)]`.
    """
    num_rows = int(global_shape[0])
    indices = sharding.addressable_devices_indices_map(tuple(global_shape))
    rows: set[int] = set()
    for index in indices.values():
        first = index[0] if index else slice(None)
        rows.update(range(*first.indices(num_rows)))
    runs: list[range] = []
    for row in sorted(rows):
        if runs and runs[-1].stop == row:
            runs[-1] = range(runs[-1].start, row + 1)
        else:
            runs.append(range(row, row + 1))
    return runs


def global_array_from_rows(
    sharding: jax.sharding.Sharding,
    global_shape: Sequence[int],
    read_rows: Callable[[int, int], np.ndarray],
) -> jax.Array:
    """A global array of which this process reads only the rows its devices hold.

    ```python
    batch = global_array_from_rows(
        NamedSharding(mesh, P(("dp", "fsdp"))), (batch_size, seq_len + 1),
        lambda start, stop: get_batch(data, position + start, stop - start, seq_len, seed=0),
    )
    ```

    **Arguments:**

    - `sharding`: the global array's sharding.
    - `global_shape`: its shape, rows first.
    - `read_rows`: `read_rows(start, stop)` returns global rows `[start, stop)` as a
      NumPy array of shape `[stop - start, *global_shape[1:]]`; called once per run of
      `process_rows`.

    **Returns:**

    A `jax.Array` of `global_shape` with `sharding`
    (`jax.make_array_from_process_local_data`).
    """
    runs = process_rows(sharding, global_shape)
    local = np.concatenate([read_rows(r.start, r.stop) for r in runs])
    return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))

