"""The names of `equishard.train` that other equishard packages import but users do not:
the one way into its private modules from outside it (see `tests/test_structure.py`).

Importing it imports orbax (the `train` extra): only the application does.
"""

from ._checkpoint import committed_steps as committed_steps, probe_writable as probe_writable
