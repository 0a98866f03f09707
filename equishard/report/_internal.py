"""The names of `equishard.report` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._abstract import (
    abstract_state as abstract_state,
    lower_from_shapes as lower_from_shapes,
)
from ._minimum import ring_fraction as ring_fraction
