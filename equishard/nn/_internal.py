"""What other equishard packages use of `equishard.nn` without it being public.

equishard's one rule for imports across its packages: a module imports another package
through that package (`from ..sharding import specs_of`, its public names) or through the
package's `_internal` module (this one), never from one of its private modules directly.
So a package's private modules can be split or renamed by changing its `__init__` and
this file only; `tests/test_structure.py` holds the rule.
"""

from ._fsdp_regather import after as after
from ._fsdp_scan import (
    scan_units as scan_units,
    scannable as scannable,
)
from ._linear import matmul_t as matmul_t
