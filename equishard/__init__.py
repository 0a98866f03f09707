"""equishard: explicit, exact sharded training for Equinox models.

The top level exports the sharding floor; `equishard.core`, `equishard.nn`,
`equishard.train` and `equishard.distributed` (multi-process runs) are the other
public namespaces.
"""

from . import (
    _env as _env,  # checks JAX's environment variables before JAX reads them
    core as core,
    distributed as distributed,
    nn as nn,
    sharding as sharding,
)
from ._errors import (
    CheckpointError as CheckpointError,
    ConventionError as ConventionError,
    DistributedError as DistributedError,
    EquishardError as EquishardError,
    GenerationError as GenerationError,
    LayerConfigError as LayerConfigError,
    MeshError as MeshError,
    SpecError as SpecError,
    TrainingError as TrainingError,
    TrainStepError as TrainStepError,
)
from ._version import __version__ as __version__
from .nn import parallelize as parallelize
from .sharding import (
    Layout as Layout,
    Parallelism as Parallelism,
    Sharded as Sharded,
    add_leading_axis as add_leading_axis,
    apply_rules as apply_rules,
    box as box,
    check_threefry_partitionable as check_threefry_partitionable,
    drop_leading_axis as drop_leading_axis,
    filter_shard_map as filter_shard_map,
    format_param_table as format_param_table,
    fsdp_split_params as fsdp_split_params,
    gather as gather,
    is_sharded as is_sharded,
    make_mesh as make_mesh,
    param_table as param_table,
    parse_layout as parse_layout,
    plain_arrays as plain_arrays,
    restrict_specs as restrict_specs,
    shard as shard,
    shard_params as shard_params,
    sharded_init as sharded_init,
    specs_of as specs_of,
    sync_gradients as sync_gradients,
    unbox as unbox,
    zero_split as zero_split,
)
