"""Multi-process runs with JAX's own runtime: `initialize`, the launch variables, per-process data."""

from ._runtime import (
    COORDINATOR_ENV as COORDINATOR_ENV,
    LOCAL_DEVICE_COUNT_ENV as LOCAL_DEVICE_COUNT_ENV,
    NUM_PROCESSES_ENV as NUM_PROCESSES_ENV,
    PROCESS_ID_ENV as PROCESS_ID_ENV,
    DistributedError as DistributedError,
    default_bind_address as default_bind_address,
    global_array_from_rows as global_array_from_rows,
    initialize as initialize,
    is_coordinator as is_coordinator,
    is_launched as is_launched,
    is_loopback as is_loopback,
    launch_environment as launch_environment,
    process_rows as process_rows,
)
