"""Warnings shown at the user's line: the one home of equishard's `warnings.warn`."""

from __future__ import annotations

import os
import sys
import warnings

import equinox
import jax
import jaxtyping

# Frames in these packages are not the user's: equishard's own, and those of the
# libraries its calls pass through (Equinox's module construction, JAX's tracing,
# jaxtyping's and beartype's checking wrappers, whose frames are named `<@beartype...`).
_INTERNAL = (
    os.path.dirname(__file__) + os.sep,  # equishard
    *(os.path.dirname(m.__file__) + os.sep for m in (equinox, jax, jaxtyping) if m.__file__ is not None),
    "<@beartype",
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)`, attributed to the innermost frame that is
    not in equishard, Equinox or JAX (the user's line that led here).

    **Arguments:**

    - `message`: the warning's text.
    - `category`: its class.
    """
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
