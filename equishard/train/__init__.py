"""The functional train step, `TrainState` and checkpoints.

`Checkpointer` loads orbax, the `train` extra, when first used: `import equishard.train`,
the train step and the plain-Equinox export need only the base install.
"""

import importlib
import typing
import warnings

from ._export import export_model as export_model, import_model as import_model
from ._gradients import global_norm as global_norm
from ._state import TrainState as TrainState, init_train_state as init_train_state
from ._step import (
    CompiledTrainStep as CompiledTrainStep,
    TrainStep as TrainStep,
    make_train_step as make_train_step,
)

if typing.TYPE_CHECKING:
    from ._checkpoint import Checkpointer as Checkpointer

_CHECKPOINT_NAMES = ("Checkpointer",)

_MOVED = {
    "Layout": "equishard.sharding",
    "AXES": "equishard.sharding",
    "TrainConfig": "equishard._app",
    "run": "equishard._app",
    "ByteCorpus": "equishard._app",
    "get_batch": "equishard._app",
    "load_stdlib_corpus": "equishard._app",
    "split_batch": "equishard._app",
    "stdlib_corpus": "equishard._app",
    "stdlib_files": "equishard._app",
    "unigram_entropy": "equishard._app",
}
"""Names that left `equishard.train`, and their new module (deprecated here)."""


def __getattr__(name: str) -> typing.Any:
    if name in _CHECKPOINT_NAMES:
        try:
            module = importlib.import_module("._checkpoint", __name__)
        except ModuleNotFoundError as err:
            raise ImportError(
                f"equishard.train.{name} needs orbax-checkpoint, which is not installed: "
                f"pip install 'equishard[train]'."
            ) from err
        return getattr(module, name)
    if name in _MOVED:
        home = _MOVED[name]
        where = (
            f"`{home}.{name}`"
            if home == "equishard.sharding"
            else "the `equishard train` command's private application package"
        )
        warnings.warn(
            f"equishard.train.{name} is deprecated and will be removed in the next release: "
            f"it moved to {where}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
