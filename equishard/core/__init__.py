"""Pure functions on local blocks, valid inside `shard_map`: collectives, collective matmuls, attention kernels, MoE routing and pipeline schedules."""

from ._attention import (
    BLOCKWISE_THRESHOLD as BLOCKWISE_THRESHOLD,
    CAUSAL as CAUSAL,
    DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE,
    AttentionMask as AttentionMask,
    alltoall_attention as alltoall_attention,
    attention as attention,
    blockwise_attention as blockwise_attention,
    context_positions as context_positions,
    cudnn_supported as cudnn_supported,
    dense_attention as dense_attention,
    merge_attention as merge_attention,
    ring_attention as ring_attention,
    ring_attention_block_pairs as ring_attention_block_pairs,
    zigzag_indices as zigzag_indices,
    zigzag_permute as zigzag_permute,
    zigzag_unpermute as zigzag_unpermute,
)
from ._batch_stats import example_mean as example_mean
from ._collectives import (
    ReduceOp as ReduceOp,
    async_gather as async_gather,
    async_gather_bidirectional as async_gather_bidirectional,
    async_gather_split as async_gather_split,
    async_scatter as async_scatter,
    async_scatter_split as async_scatter_split,
    mp_copy as mp_copy,
    mp_gather as mp_gather,
    mp_reduce as mp_reduce,
    mp_scatter as mp_scatter,
    ring_all_gather as ring_all_gather,
    ring_all_gather_bidirectional as ring_all_gather_bidirectional,
    ring_all_gather_split as ring_all_gather_split,
    ring_reduce_scatter as ring_reduce_scatter,
    ring_reduce_scatter_split as ring_reduce_scatter_split,
    ring_shift as ring_shift,
)
from ._executor import (
    execute_schedule as execute_schedule,
    schedule_weights as schedule_weights,
)
from ._fp8 import (
    E4M3 as E4M3,
    E5M2 as E5M2,
    Fp8MatmulMeta as Fp8MatmulMeta,
    Fp8Meta as Fp8Meta,
    dequantize as dequantize,
    fp8_matmul as fp8_matmul,
    fp8_matmul_meta as fp8_matmul_meta,
    fp8_max as fp8_max,
    fp8_meta as fp8_meta,
    fp8_meta_update as fp8_meta_update,
    fp8_scale as fp8_scale,
    quantize as quantize,
)
from ._fused_ce import (
    CHUNK_ELEMENTS as CHUNK_ELEMENTS,
    CrossEntropySums as CrossEntropySums,
    fused_linear_cross_entropy as fused_linear_cross_entropy,
)
from ._gather import (
    gather_array as gather_array,
    gather_array_with_mean_grads as gather_array_with_mean_grads,
    gather_tokens as gather_tokens,
    scatter_tokens as scatter_tokens,
)
from ._matmul import (
    all_gather_matmul as all_gather_matmul,
    matmul_reduce_scatter as matmul_reduce_scatter,
)
from ._moe import (
    RaggedPlan as RaggedPlan,
    capacity_mask as capacity_mask,
    chunk_offsets as chunk_offsets,
    dense_combine as dense_combine,
    dense_dispatch as dense_dispatch,
    expert_capacity as expert_capacity,
    load_balancing_loss as load_balancing_loss,
    native_ragged_all_to_all as native_ragged_all_to_all,
    ragged_all_to_all_emulated as ragged_all_to_all_emulated,
    ragged_combine as ragged_combine,
    ragged_dispatch as ragged_dispatch,
    router_z_loss as router_z_loss,
    top_k_router as top_k_router,
)
from ._pipeline import (
    execute_circular_pipeline as execute_circular_pipeline,
    execute_pipeline as execute_pipeline,
    execute_pipeline_step as execute_pipeline_step,
    from_last_stage as from_last_stage,
    pipeline_layer_order as pipeline_layer_order,
)
from ._random import (
    bernoulli_block as bernoulli_block,
    example_keys as example_keys,
    global_index as global_index,
)
from ._schedule import (
    SCHEDULES as SCHEDULES,
    PipelineSchedule as PipelineSchedule,
    ScheduleReport as ScheduleReport,
    pipeline_schedule as pipeline_schedule,
    schedule_report as schedule_report,
)
