"""The names of `equishard.core` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._collectives import ring_index as ring_index
from ._fused_ce import default_chunk_size as default_chunk_size
from ._microbatch import split_microbatches as split_microbatches
from ._pipeline import check_stage_output as check_stage_output
from ._random import hash_bits as hash_bits, hash_keep as hash_keep, hash_seed as hash_seed
