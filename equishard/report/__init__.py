"""Communication and memory reports of compiled train steps, and analytical minima.

`read_collectives(compiled)` is the HLO collective reader the tests, the benchmarks and
the reports share: every collective a compiled program runs, its replica groups, loop
trip counts applied, and the bytes each device sends. `report(compiled, mesh=...)` lists
every collective of a compiled program with its mesh axes and the bytes each device
sends, and the compiler's per-device memory, beside an analytical `Minimum` and
`MemoryEstimate` where given. The textbook minima are here; the reference GPT's report
(`gpt_report`, `gpt_minimum`, `gpt_memory`, its FLOPs) is `equishard.models`', which sits
above this package.
"""

from .._text import human_bytes as human_bytes
from ._axes import axes_of_groups as axes_of_groups, axes_of_pairs as axes_of_pairs
from ._flops import (
    DEVICE_PROFILES as DEVICE_PROFILES,
    DeviceProfile as DeviceProfile,
    device_profile as device_profile,
    mfu as mfu,
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
)
from ._minimum import (
    Minimum as Minimum,
    Term as Term,
    data_parallel_minimum as data_parallel_minimum,
    expert_parallel_minimum as expert_parallel_minimum,
    format_minimum as format_minimum,
    fsdp_minimum as fsdp_minimum,
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
