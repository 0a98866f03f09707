"""The functional train step, `TrainState` and checkpoints.

`Checkpointer` loads orbax, the `train` extra, when first used: `import equishard.train`,
the train step and the plain-Equinox export need only the base install.
"""

import importlib
import typing

from ._base import base_fingerprint as base_fingerprint
from ._data import (
    IGNORE_LABEL as IGNORE_LABEL,
    DataSource as DataSource,
    batch_at as batch_at,
    counter_bits as counter_bits,
    epoch_permutation as epoch_permutation,
    example_indices as example_indices,
    mix64 as mix64,
    pack_windows as pack_windows,
    read_examples as read_examples,
)
from ._export import export_model as export_model, import_model as import_model
from ._gradients import global_norm as global_norm
from ._opt_sharding import (
    Mirror as Mirror,
    OptStateSharding as OptStateSharding,
    ZeRO1 as ZeRO1,
)
from ._precision import (
    FULL_PRECISION as FULL_PRECISION,
    MixedPrecision as MixedPrecision,
    Precision as Precision,
)
from ._safetensors import (
    OutTensor as OutTensor,
    Padded as Padded,
    Permuted as Permuted,
    Stacked as Stacked,
    Tensor as Tensor,
    Transposed as Transposed,
    array_paths as array_paths,
    check_mapping as check_mapping,
    checkpoint_tensors as checkpoint_tensors,
    load_safetensors as load_safetensors,
    source_tensors as source_tensors,
    tensor_of as tensor_of,
    write_safetensors as write_safetensors,
)
from ._state import TrainState as TrainState, init_train_state as init_train_state
from ._step import (
    CompiledTrainStep as CompiledTrainStep,
    LocalView as LocalView,
    TrainStep as TrainStep,
    make_train_step as make_train_step,
)
from ._token_files import TokenFiles as TokenFiles, read_manifest as read_manifest
from ._trainable import (
    Trainable as Trainable,
    TrainableMask as TrainableMask,
    trainable_mask as trainable_mask,
)

if typing.TYPE_CHECKING:
    from ._checkpoint import Checkpointer as Checkpointer

_CHECKPOINT_NAMES = ("Checkpointer",)


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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
