"""Attention kernels on local blocks, valid inside `shard_map`.

- `dense_attention`: the plain softmax attention, the `[Sq, Sk]` scores in memory.
- `blockwise_attention`: the same result computed block by block with an online
  softmax (query blocks outside, key/value blocks inside); the `[Sq, Sk]` matrix never
  exists, and the backward pass (a custom VJP) recomputes each block's scores. Returns
  the per-row log-sum-exp, so partial results over disjoint keys merge exactly
  (`merge_attention`).
- `attention`: the dispatcher (cuDNN on a GPU where its rules allow; otherwise dense
  below `BLOCKWISE_THRESHOLD` keys and blockwise at or above it).
- `ring_attention`, `alltoall_attention`: context parallelism, the sequence split over
  a mesh axis (contiguous or zigzag layout).

One module per kernel: `_dense`, `_blockwise`, `_dispatch` (`attention`), `_zigzag`
(the layouts), `_ring`, `_alltoall`, over `_common` (the canonical layout they share).

Every kernel supports grouped-query attention (`k` and `v` with `n_kv_heads` heads, a
divisor of the query's `n_heads`; query head `h` reads key/value head
`h // (n_heads // n_kv_heads)`), causal and non-causal masks, explicit positions (the
causal mask is `kv_position <= q_position`, so permuted or packed sequences mask
correctly) and segment ids (a query sees only keys of its own segment).

Shapes: `q` is `[..., Sq, n_heads, head_dim]`, `k` and `v` are
`[..., Sk, n_kv_heads, head_dim]`, positions and segment ids `[Sq]` / `[Sk]` or with
the same leading (batch) dimensions.
"""

from ._alltoall import alltoall_attention as alltoall_attention
from ._blockwise import (
    blockwise_attention as blockwise_attention,
    merge_attention as merge_attention,
)
from ._common import (
    BLOCKWISE_THRESHOLD as BLOCKWISE_THRESHOLD,
    CAUSAL as CAUSAL,
    DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE,
    AttentionMask as AttentionMask,
)
from ._dense import dense_attention as dense_attention
from ._dispatch import attention as attention, cudnn_supported as cudnn_supported
from ._ring import (
    ring_attention as ring_attention,
    ring_attention_block_pairs as ring_attention_block_pairs,
)
from ._zigzag import (
    context_positions as context_positions,
    zigzag_indices as zigzag_indices,
    zigzag_permute as zigzag_permute,
    zigzag_unpermute as zigzag_unpermute,
)
