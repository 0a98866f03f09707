"""The environment variables JAX reads as it is imported, checked before it is.

JAX refuses a malformed `JAX_NUM_CPU_DEVICES` with a traceback from inside its import;
importing equishard checks it first. The `equishard` command prints one line and exits
with status 2; a program importing the library gets an `EquishardError` naming it.
"""

from __future__ import annotations

import os
import pathlib
import sys

from ._errors import EquishardError


def _run_as_command() -> bool:
    """Whether this process is the `equishard` command (`python -m equishard`, or the
    console script), not a program importing the library."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "equishard":
        return True
    return len(argv) > 1 and pathlib.Path(argv[1]).name == "equishard"


def check_jax_environment() -> None:
    """Refuse a `JAX_NUM_CPU_DEVICES` that is not a whole number.

    **Raises:**

    `EquishardError` naming the variable, its value and this machine's CPU cores.
    """
    value = os.environ.get("JAX_NUM_CPU_DEVICES")
    if value is None:
        return
    try:
        int(value)
    except ValueError:
        raise EquishardError(
            f"JAX_NUM_CPU_DEVICES={value!r} is not a whole number: it is how many CPU devices "
            f"JAX simulates (this machine has {os.cpu_count()} CPU cores); unset it or give a "
            f"count such as 8."
        ) from None


try:
    check_jax_environment()
except EquishardError as _err:
    if not _run_as_command():
        raise
    print(f"equishard: error: {_err}", file=sys.stderr)
    sys.exit(2)
