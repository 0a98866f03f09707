"""The names of `equishard.sharding` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._box import with_spec as with_spec
from ._fsdp import (
    DEFAULT_MIN_WEIGHT_SIZE as DEFAULT_MIN_WEIGHT_SIZE,
    axis_size_and_bound as axis_size_and_bound,
)
from ._layout import (
    resolve_layout as resolve_layout,
)
from ._place import is_tracer as is_tracer
from ._rules import (
    compile_pattern as compile_pattern,
    map_modules as map_modules,
)
from ._specs import (
    is_spec as is_spec,
    spec_axes as spec_axes,
)
from ._zero import (
    ZeroAxes as ZeroAxes,
    zero_axes as zero_axes,
    zero_spec as zero_spec,
)
