"""XLA compiler options, checked before the program they are for is traced.

`jax.jit(..., compiler_options=)` hands its options to XLA only when it compiles, after
the whole program is traced and lowered, and XLA refuses a misspelt name or a value of
the wrong type with a runtime error of its own. equishard's functions that take
`compiler_options` (`make_train_step`, `sharded_init`) check them first, here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ._errors import EquishardError
from ._text import first_line


@functools.cache
def _compile_with(items: tuple[tuple[str, Any], ...]) -> None:
    """Compile a one-instruction program with these options (cached once accepted)."""
    jax.jit(lambda x: x + 1, compiler_options=dict(items)).lower(np.float32(0)).compile()


def check_compiler_options(options: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
    """The XLA options `options` as a dict, once XLA has accepted them.

    XLA reads them on a program of one instruction, compiled for the default backend
    (a fraction of a second, once per set of options in a process), so that a bad name or
    value is reported before the program they are for is traced.

    **Arguments:**

    - `options`: `jax.jit`'s `compiler_options`, or `None`.
    - `where`: the function they were given to, for the message.

    **Returns:**

    `dict(options)`, or `None`.

    **Raises:**

    `EquishardError` naming `where`, the options and XLA's reason (an option XLA does not
    have, or a value it cannot read).
    """
    if options is None:
        return None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise EquishardError(
            f"{where}: compiler_options must map XLA option names to values "
            f"(e.g. {{'xla_backend_optimization_level': 0}}), got {options!r}."
        )
    items = tuple(sorted(options.items()))
    try:
        _compile_with(items)
    except TypeError:  # a value that is not hashable: XLA's values are numbers and text
        raise EquishardError(
            f"{where}: compiler_options {dict(options)!r}: each value must be a number, a "
            f"bool or a string."
        ) from None
    except jax.errors.JaxRuntimeError as err:
        raise EquishardError(
            f"{where}: XLA refuses compiler_options {dict(options)!r}: {first_line(err)}"
        ) from None
    return dict(options)
