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

    if getattr(jax.config, "jax_num_cpu_devices") == n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass
