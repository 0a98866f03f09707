"""What other equishard packages use of `equishard.sharding` without it being public.

equishard's one rule for imports across its packages: a module imports another package
through that package (`from ..sharding import specs_of`, its public names) or through the
package's `_internal` module (this one), never from one of its private modules directly.
So a package's private modules can be split or renamed by changing its `__init__` and
this file only; `tests/test_structure.py` holds the rule.
"""

from ._box import with_spec as with_spec
from ._fsdp import (
    DEFAULT_MIN_WEIGHT_SIZE as DEFAULT_MIN_WEIGHT_SIZE,
    axis_size_and_bound as axis_size_and_bound,
)
from ._layout import layout_from_options as layout_from_options
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
