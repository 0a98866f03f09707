"""The names of `equishard.models` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._gpt import (
    canonical_path as canonical_path,
    to_single_device as to_single_device,
)
