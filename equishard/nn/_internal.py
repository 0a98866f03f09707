"""The names of `equishard.nn` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._fsdp_regather import after as after
from ._fsdp_scan import (
    scan_units as scan_units,
    scannable as scannable,
)
from ._linear import matmul_t as matmul_t
from ._lora import (
    LoRADropout as LoRADropout,
    adapter_dropout as adapter_dropout,
    lora_of as lora_of,
)
