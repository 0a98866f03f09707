"""What every `equishard` subcommand's parser shares: the help formatter and the CPU
device count, set before JAX starts. `_cli`, `_cli_report` and `_launch` import it (so
none of them imports another)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default appended once: not where the help already
    says it, nor for switches (`--no-plot`) and options whose default is "none"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings:
            return text
        if action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


def use_cpu_devices(n: int) -> None:
    """Simulate `n` CPU devices (only affects the CPU backend; call before JAX starts).

    If JAX has already started (e.g. `main` called from a program that uses JAX), the
    devices it has are kept.
    """
    import jax

    if getattr(jax.config, "jax_num_cpu_devices") != n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass
    check_platforms()


def check_platforms() -> None:
    """Refuse a `JAX_PLATFORMS` this machine has no backend for, naming the variable and
    the backends it has (call it once JAX's options are set: it starts the backends).

    **Raises:**

    `EquishardError` with one line.
    """
    import os

    import jax

    from ._errors import EquishardError

    wanted = os.environ.get("JAX_PLATFORMS", "").strip()
    if not wanted:
        return
    missing = []
    for name in (n.strip() for n in wanted.split(",") if n.strip()):
        try:
            jax.devices(name)
        except (RuntimeError, AssertionError):  # an unknown backend, or none could start
            missing.append(name)
    if missing:
        before = getattr(jax.config, "jax_platforms")
        jax.config.update("jax_platforms", None)  # what the machine has, to say so
        try:
            have = sorted({d.platform for d in jax.devices()})
        finally:
            jax.config.update("jax_platforms", before)
        raise EquishardError(
            f"JAX_PLATFORMS={wanted}: this machine has no {', '.join(missing)} backend (it "
            f"has: {', '.join(have)}); unset JAX_PLATFORMS or name one of those."
        )
