"""Reference models built from `equishard.nn`."""

from ._gpt import (
    GPT as GPT,
    GPTConfig as GPTConfig,
    PRESETS as PRESETS,
    cast_floating as cast_floating,
    count_parameters as count_parameters,
)
from ..sharding import Parallelism as Parallelism  # its home is `equishard.sharding`
