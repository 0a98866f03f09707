"""The sharding floor: how modules carry specs, and the transforms that read them."""

from .._names import CONTEXT_IMPLS as CONTEXT_IMPLS
from ._box import (
    Sharded as Sharded,
    add_leading_axis as add_leading_axis,
    box as box,
    drop_leading_axis as drop_leading_axis,
    is_sharded as is_sharded,
    plain_arrays as plain_arrays,
    restrict_specs as restrict_specs,
    unbox as unbox,
)
from ._fsdp import (
    AutoSharded as AutoSharded,
    fsdp_dimension as fsdp_dimension,
    fsdp_split_params as fsdp_split_params,
    reference_dimension as reference_dimension,
    shard_params as shard_params,
)
from ._layout import (
    AXES as AXES,
    Layout as Layout,
    Parallelism as Parallelism,
)
from ._mesh import make_mesh as make_mesh, parse_layout as parse_layout
from ._place import gather as gather, shard as shard
from ._rules import apply_rules as apply_rules
from ._shard_map import filter_shard_map as filter_shard_map
from ._sharded_init import (
    check_threefry_partitionable as check_threefry_partitionable,
    sharded_init as sharded_init,
)
from ._specs import (
    check_spec as check_spec,
    check_tree_specs as check_tree_specs,
    is_array_like as is_array_like,
    path_str as path_str,
    specs_of as specs_of,
)
from ._sync import sync_gradients as sync_gradients
from ._table import (
    ParamRow as ParamRow,
    format_param_rows as format_param_rows,
    format_param_table as format_param_table,
    param_table as param_table,
)
from ._zero import zero_split as zero_split
