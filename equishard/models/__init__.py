"""Reference models built from `equishard.nn`."""

from ..sharding import Parallelism as Parallelism  # its home is `equishard.sharding`
from ._gpt import (
    GPT as GPT,
    PRESETS as PRESETS,
    GPTConfig as GPTConfig,
    cast_floating as cast_floating,
    count_parameters as count_parameters,
)
