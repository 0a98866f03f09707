"""Communication and memory reports of compiled train steps, and analytical minima.

`read_collectives(compiled)` is the HLO collective reader the tests, the benchmarks and
the reports share: every collective a compiled program runs, its replica groups, loop
trip counts applied, and the bytes each device sends. `report(compiled, mesh=...)` lists every collective of a compiled program with its mesh
axes and the bytes each device sends, and the compiler's per-device memory;
`gpt_report` compiles the reference GPT's real train step for any layout, from shapes
alone, and sets the measured bytes beside `gpt_minimum`, the analytical minimum (see
`equishard.report._minimum` for every formula).
"""

from .._text import human_bytes as human_bytes
from ._axes import axes_of_groups as axes_of_groups, axes_of_pairs as axes_of_pairs
from ._flops import (
    DEVICE_PROFILES as DEVICE_PROFILES,
    DeviceProfile as DeviceProfile,
    device_profile as device_profile,
    gpt_flops_per_token as gpt_flops_per_token,
    gpt_matmul_parameters as gpt_matmul_parameters,
    mfu as mfu,
)
from ._gpt import (
    AbstractStep as AbstractStep,
    abstract_train_step as abstract_train_step,
    check_gpt_layout as check_gpt_layout,
    gpt_report as gpt_report,
    preset as preset,
)
from ._hlo import (
    COLLECTIVE_KINDS as COLLECTIVE_KINDS,
    CollectiveOp as CollectiveOp,
    collective_bytes as collective_bytes,
    collective_table as collective_table,
    count_collectives as count_collectives,
    parse_replica_groups as parse_replica_groups,
    read_collectives as read_collectives,
)
from ._memory import (
    MemoryEstimate as MemoryEstimate,
    format_memory_estimate as format_memory_estimate,
    gpt_memory as gpt_memory,
)
from ._minimum import (
    Minimum as Minimum,
    Term as Term,
    data_parallel_minimum as data_parallel_minimum,
    expert_parallel_minimum as expert_parallel_minimum,
    format_minimum as format_minimum,
    fsdp_minimum as fsdp_minimum,
    gpt_minimum as gpt_minimum,
    gpt_param_rows as gpt_param_rows,
    pipeline_minimum as pipeline_minimum,
    state_bytes as state_bytes,
    tensor_parallel_minimum as tensor_parallel_minimum,
)
from ._report import (
    CollectiveRow as CollectiveRow,
    MemoryStats as MemoryStats,
    StepReport as StepReport,
    format_report as format_report,
    memory_stats as memory_stats,
    report as report,
)
