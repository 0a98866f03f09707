"""The `equishard train` application: the demo job built on the library.

Private: the command line uses it, and the guides' examples borrow its corpus. It holds
what a training script is made of but the library does not need — the options of the
`train` command (`TrainConfig`), the job itself (`run`), the standard-library byte corpus
with its position-indexed batches, the loss plot and text sampling. The library it runs
on is `equishard.train` (the step, the state, checkpoints) and `equishard.sharding`
(`Layout`).
"""

from ._config import (
    CheckpointOptions as CheckpointOptions,
    DataOptions as DataOptions,
    LayoutOptions as LayoutOptions,
    LogOptions as LogOptions,
    ModelOptions as ModelOptions,
    OptimizerOptions as OptimizerOptions,
    StartOptions as StartOptions,
    TrainConfig as TrainConfig,
)
from ._data import (
    ByteCorpus as ByteCorpus,
    get_batch as get_batch,
    load_stdlib_corpus as load_stdlib_corpus,
    sample_offsets as sample_offsets,
    split_batch as split_batch,
    stdlib_corpus as stdlib_corpus,
    stdlib_dir as stdlib_dir,
    stdlib_files as stdlib_files,
    unigram_entropy as unigram_entropy,
)
from ._run import (
    Run as Run,
    make_optimizer as make_optimizer,
    plot_losses as plot_losses,
    run as run,
    sample_text as sample_text,
)
