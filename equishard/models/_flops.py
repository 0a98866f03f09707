"""Model FLOPs of the reference GPT: what MFU (`equishard.report.mfu`) divides by a peak.

The FLOPs counted are the *model* FLOPs of a training step, as PaLM (Chowdhery et al.,
2022, appendix B), MaxText and torchtitan count them: every matrix product of the
forward pass costs `2` FLOPs per multiply-add, and the backward pass twice the forward,
so a token costs

    6 · N  +  12 · n_layers · d_model · seq_len

where `N` is the number of parameters a token is multiplied by (the attention and MLP
weights of every block — for a mixture-of-experts block only the `top_k` experts a token
is routed to, plus the router — and the output head; the embedding lookup multiplies
nothing), and the second term is attention's scores `QKᵀ` and weighted values `AV`
(`2 · 2 · seq_len · d_model` per layer forward, counted over the whole square as PaLM
does, not halved for the causal mask). Recomputation (`remat`) is not model FLOPs and is
not counted: MFU measures the model's useful work, not the hardware's.
"""

from __future__ import annotations

from ._gpt import GPTConfig

__all__ = ["gpt_flops_per_token", "gpt_matmul_parameters"]


def gpt_matmul_parameters(config: GPTConfig) -> int:
    """`N` of the FLOPs formula: the weights one token is multiplied by in a forward pass.

    Per block: the query and output projections (`2 d²`), the keys' and values'
    (`2 d·d_kv`, `d_kv = n_kv_heads · d / n_heads` under grouped-query attention) and the
    SwiGLU MLP (`3 d·d_ff`), or for a mixture-of-experts block the router (`d·E`) and
    `top_k` experts (`2 d·d_ff` each); then the output head (`d·V`, tied or not).
    """
    d = config.d_model
    moe_blocks = config.n_layers // config.moe_every if config.moe_every else 0
    dense_blocks = config.n_layers - moe_blocks
    kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    attention = 2 * d * d + 2 * d * (kv_heads * (d // config.n_heads))
    dense = attention + 3 * d * config.d_ff
    moe = attention + d * config.num_experts + config.top_k * 2 * d * config.d_ff
    return dense_blocks * dense + moe_blocks * moe + d * config.vocab_size


def gpt_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Model FLOPs of one training token: `6 N + 12 n_layers d_model seq_len` (see the
    module documentation and the "Reading the train output" guide).

    **Arguments:**

    - `config`: the GPT's hyperparameters.
    - `seq_len`: the training sequence length.

    **Returns:**

    FLOPs per token of a forward and backward pass.
    """
    attention = 12 * config.n_layers * config.d_model * seq_len
    return 6 * gpt_matmul_parameters(config) + attention
