"""The names of the `equishard train` application that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._config import (
    DTYPES as DTYPES,
    WIDTH as WIDTH,
    InspectConfig as InspectConfig,
    LaunchConfig as LaunchConfig,
    LayoutOptions as LayoutOptions,
    PlanConfig as PlanConfig,
    TrainCommand as TrainCommand,
    layout_from_options as layout_from_options,
    load_config as load_config,
)
from ._options import add_options as add_options, from_args as from_args
