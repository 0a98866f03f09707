"""The names of the `equishard train` application that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).
"""

from ._config import load_config as load_config
