"""Equinox layers in local view, composing `equishard.core`."""

from ._batch_norm import SyncBatchNorm as SyncBatchNorm, sync_batch_norms as sync_batch_norms
from ._cross_entropy import (
    fused_cross_entropy as fused_cross_entropy,
    vocab_parallel_cross_entropy as vocab_parallel_cross_entropy,
)
from ._embedding import ParallelEmbedding as ParallelEmbedding
from ._fsdp import (
    FSDP as FSDP,
    fsdp_wrap as fsdp_wrap,
    shard_module_params as shard_module_params,
)
from ._fsdp_gather import (
    GathersFSDP as GathersFSDP,
    fsdp_gather_params as fsdp_gather_params,
    gather_params as gather_params,
    with_fsdp_dtypes as with_fsdp_dtypes,
)
from ._initializers import (
    INIT_TYPES as INIT_TYPES,
    InitType as InitType,
    init_bias as init_bias,
    init_weight as init_weight,
    initialize_model_parallel_affine_weight_ as initialize_model_parallel_affine_weight_,
    scale_init as scale_init,
)
from ._linear import (
    ColumnParallelLinear as ColumnParallelLinear,
    LinearOptions as LinearOptions,
    RowParallelLinear as RowParallelLinear,
)
from ._lora import LORA_TARGETS as LORA_TARGETS, LoRA as LoRA, LoRAAdapter as LoRAAdapter
from ._moe import MoE as MoE, MoEAux as MoEAux
from ._parallelize import (
    ColwiseParallel as ColwiseParallel,
    DropoutParallel as DropoutParallel,
    EmbeddingParallel as EmbeddingParallel,
    GuardedDropout as GuardedDropout,
    HeadParallel as HeadParallel,
    Replicate as Replicate,
    RowwiseParallel as RowwiseParallel,
    SequenceParallel as SequenceParallel,
    SplitDropout as SplitDropout,
    parallelize as parallelize,
)
from ._pipeline import PipelineModule as PipelineModule
from ._remat import REMAT_POLICIES as REMAT_POLICIES, remat_policy as remat_policy
from ._tp_dense import Dense as Dense, TPAsyncDense as TPAsyncDense, TPDense as TPDense
from ._transformer import (
    ParallelAttention as ParallelAttention,
    ParallelMLP as ParallelMLP,
    RMSNorm as RMSNorm,
    SharedKVLinear as SharedKVLinear,
    TransformerBlock as TransformerBlock,
    causal_attention as causal_attention,
    rotary_embedding as rotary_embedding,
)
from ._wrapper import ModelParallelismWrapper as ModelParallelismWrapper
