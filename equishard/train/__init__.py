"""The functional train step, `TrainState`, checkpoints and data."""

from ._checkpoint import Checkpointer as Checkpointer
from ._export import export_model as export_model, import_model as import_model
from ._data import (
    ByteCorpus as ByteCorpus,
    get_batch as get_batch,
    load_stdlib_corpus as load_stdlib_corpus,
    process_slice as process_slice,
    split_batch as split_batch,
    stdlib_corpus as stdlib_corpus,
    stdlib_files as stdlib_files,
    unigram_entropy as unigram_entropy,
)
from ._layout import AXES as AXES, Layout as Layout
from ._step import (
    TrainState as TrainState,
    global_norm as global_norm,
    init_train_state as init_train_state,
    make_train_step as make_train_step,
)
from ._run import TrainConfig as TrainConfig, run as run
