"""The names of the `equishard train` application that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._config import (
    DTYPES as DTYPES,
    WIDTH as WIDTH,
    EvalConfig as EvalConfig,
    ExportConfig as ExportConfig,
    GenerateConfig as GenerateConfig,
    InspectConfig as InspectConfig,
    LaunchConfig as LaunchConfig,
    LayoutOptions as LayoutOptions,
    PlanConfig as PlanConfig,
    TokenizeConfig as TokenizeConfig,
    TrainCommand as TrainCommand,
    layout_from_options as layout_from_options,
    load_config as load_config,
)
from ._data import stdlib_files as stdlib_files
from ._export import export_run as export_run
from ._generate import (
    evaluate_run as evaluate_run,
    generate_from_hf as generate_from_hf,
    generate_from_run as generate_from_run,
)
from ._options import add_options as add_options, from_args as from_args
from ._tokenize import tokenize as tokenize
