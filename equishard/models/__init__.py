"""Reference models built from `equishard.nn`."""

from ..sharding import Parallelism as Parallelism  # its home is `equishard.sharding`
from ._gpt import (
    GPT as GPT,
    PRESETS as PRESETS,
    GPTConfig as GPTConfig,
    cast_floating as cast_floating,
    check_context_split as check_context_split,
    count_parameters as count_parameters,
    token_batch as token_batch,
)
