"""The reference decoder-only transformer, built only from `equishard.nn` layers.

Token embedding (vocabulary-parallel over the tensor axis), pre-norm blocks of causal
multi-head attention with rotary embeddings and a SwiGLU MLP (optionally a mixture of
experts every `moe_every` blocks), a final RMSNorm and a tied or untied output head,
with the loss computed by `fused_cross_entropy` from the final hidden states, chunk by
chunk over the tokens (never forming the `[tokens, V]` logits; `GPTConfig.fused_loss`).

The blocks are stacked and run with `jax.lax.scan`, so compile time does not grow with
depth; with a pipeline axis they are split into stages instead. Which axes exist is
the layout's business (`Parallelism`): the model code is the same for every layout,
and on a mesh without some axis the layers that would use it compute locally.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import cast_varying, is_bound, varying_axes
from .._errors import LayerConfigError
from .._names import ALLTOALL, RING, differentiated_scan
from ..core import (
    from_last_stage,
    gather_tokens,
    global_index,
    pipeline_layer_order,
    zigzag_indices,
)
from ..nn import (
    FSDP,
    ColumnParallelLinear,
    GathersFSDP,
    LoRA,
    MoE,
    ParallelEmbedding,
    PipelineModule,
    RMSNorm,
    TransformerBlock,
    fsdp_gather_params,
    fused_cross_entropy,
    remat_policy,
    vocab_parallel_cross_entropy,
)
from ..nn._internal import (
    LoRADropout,
    adapter_dropout,
    after as _after,
    lora_of,
    matmul_t,
    scan_units,
    scannable,
)
from ..sharding import (
    Parallelism,
    add_leading_axis,
    drop_leading_axis,
    fsdp_split_params,
    is_sharded,
    restrict_specs,
    unbox as es_unbox,
)
from ..sharding._internal import spec_axes
from ..train import IGNORE_LABEL

TP = "tp"
"""The tensor axis's name where the layout has none (the layers then compute locally)."""


def tensor_axis(par: Parallelism) -> str:
    """The mesh axis that plays the tensor role in `par` (the user's name), or `TP`."""
    return par.tensor or TP


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The hyperparameters of the reference GPT.

    **Fields:**

    - `vocab_size`: vocabulary (256 for bytes).
    - `d_model`, `n_heads`, `n_layers`, `d_ff`: width, heads, depth, MLP hidden width.
    - `n_kv_heads`: key/value heads of grouped-query attention (`None`: `n_heads`,
      multi-head attention; 1: multi-query). With a tensor axis larger than
      `n_kv_heads` the key/value projection is replicated over it (Megatron's rule).
    - `tied`: share the embedding table with the output head.
    - `moe_every`: every `moe_every`-th block has a mixture-of-experts MLP (0: none).
    - `num_experts`, `top_k`, `capacity_factor`, `moe_group_size`: the MoE layers'.
    - `aux_loss_weight`, `z_loss_weight`: weights of the MoE auxiliary losses.
    - `rotary_base`: the rotary embeddings' frequency base.
    - `remat`: what each block keeps for the backward pass (`equishard.nn.remat_policy`):
      `"none"`, `"full"` (recompute each block in the backward pass), `"dots"` (keep
      only matrix products), `"minimal"` (keep the projections' outputs) or
      `"minimal_with_context"` (also the attention context).
    - `remat_offload`: keep what `remat` saves in host memory instead (GPU and TPU
      backends; the `minimal` policies).
    - `batch_chunks`: run the blocks on the local batch in this many equal pieces, one
      after another: each piece goes through all the layers (a `lax.scan` of its own),
      forward and then backward. The results are those of one piece (up to the order
      of the parameter gradients' sums); the activations the layers keep are the same,
      but the backward pass works on one piece of a layer at a time, so the compiler's
      temporaries fall. The tensor-parallel collectives run once per piece on a piece
      each (the same bytes); under FSDP each piece gathers the blocks' parameters again.
      Not with a pipeline axis (its micro-batches split the batch already) or MoE
      layers (their auxiliary losses are over the whole batch). The parameters and
      checkpoints are the same for every value.
    - `scan_unroll`: how many layers each iteration of the layer scan runs
      (`jax.lax.scan`'s `unroll`; `n_layers` unrolls the stack into straight-line code).
      `"auto"` (the default) unrolls the whole stack when JAX's default backend is a GPU
      and runs a loop of one layer an iteration elsewhere: on an H200 the 124 M GPT's bf16
      step at 16 x 1024 ran 1.35x faster unrolled with 34 % less memory (XLA:GPU keeps the
      loop's stacked residuals and slices as separate copies), while on the CPU and TPU
      a loop compiles in a time that does not grow with depth. The same values either
      way. The FSDP units' own scan (regathering units without a remat policy) runs one
      layer an iteration whatever this is.
    - `fused_loss`: compute the loss from the final hidden states in chunks of tokens
      (`equishard.nn.fused_cross_entropy`: no `[tokens, V]` logits, softmax or gradient
      formed whole); `False`: form the logits, then `vocab_parallel_cross_entropy`.
      The same values and gradients either way.
    - `norm_eps`: the RMSNorms' epsilon.
    - `qkv_bias`: biases in the attention's query, key and value projections (Qwen2's).
    - `rotary_scaling`: Llama 3.1's rotary frequency scaling, `(factor, low_freq_factor,
      high_freq_factor, original_max_position_embeddings)`, or `None`.
    - `real_vocab_size`: with a vocabulary padded to divide the tensor axis, the number
      of real ids (`None`: all `vocab_size`): the logits of the padding ids are the
      lowest finite value, so they are never sampled, and the loss leaves them out
      (the cross-entropy of the real ids alone; the padding rows get no gradient).
    - `loss_chunk_size`: tokens per chunk of the fused loss (`None`: at most 2²⁷ logits
      per chunk, a power of two of tokens, `equishard.core.CHUNK_ELEMENTS`: 2048 tokens
      at a vocabulary of 50304).
    - `document_masking`: for a packed batch (one with `segment_ids`, see
      `equishard.train.pack_windows`), attention stays inside each document and the
      rotary positions restart at each document (`document_positions`); `False`: the
      packed sequence is attended to as one text with its global `positions`. Either way
      the labels the packer masked (`IGNORE_LABEL`: each document's last token, which
      would predict the next document's first) count for nothing, and the loss is the
      mean over the labelled tokens of the global batch. Ignored for unpacked batches.
    """

    vocab_size: int = 256
    d_model: int = 192
    n_heads: int = 8
    n_layers: int = 4
    d_ff: int = 512
    n_kv_heads: int | None = None
    tied: bool = False
    moe_every: int = 0
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_group_size: int = 64
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 1e-3
    rotary_base: float = 10000.0
    remat: Literal["none", "full", "dots", "minimal", "minimal_with_context"] = "none"
    remat_offload: bool = False
    batch_chunks: int = 1
    scan_unroll: int | Literal["auto"] = "auto"
    fused_loss: bool = True
    loss_chunk_size: int | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    rotary_scaling: tuple[float, float, float, float] | None = None
    real_vocab_size: int | None = None
    document_masking: bool = True


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=64, n_heads=4, n_layers=2, d_ff=128),
    "small": GPTConfig(),
    "small-moe": GPTConfig(moe_every=2, num_experts=8, top_k=2, d_ff=256),
    "base": GPTConfig(d_model=384, n_heads=6, n_layers=8, d_ff=1024),
    # GPT-2 small: vocabulary padded from 50257 to 50304 (as nanoGPT does) so that it
    # divides a tensor axis; a SwiGLU MLP of 2048 = 2/3 x 4 d_model keeps GPT-2's MLP
    # parameter count; tied embeddings. 124 M parameters.
    "gpt2-small": GPTConfig(vocab_size=50304, d_model=768, n_heads=12, n_layers=12, d_ff=2048, tied=True),
    # Llama 2 7B (multi-head attention): 6.74 B parameters.
    "llama2-7b": GPTConfig(vocab_size=32000, d_model=4096, n_heads=32, n_layers=32, d_ff=11008),
    # Llama 3 / 3.1 (grouped-query attention with 8 key/value heads, vocabulary 128,256,
    # rotary base 500,000, untied head): 8.03 B, 70.55 B and 405.85 B parameters.
    "llama3-8b": GPTConfig(
        vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, d_ff=14336,
        rotary_base=500000.0,
    ),
    "llama3-70b": GPTConfig(
        vocab_size=128256, d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80, d_ff=28672,
        rotary_base=500000.0,
    ),
    "llama3-405b": GPTConfig(
        vocab_size=128256, d_model=16384, n_heads=128, n_kv_heads=8, n_layers=126, d_ff=53248,
        rotary_base=500000.0,
    ),
}
"""Size presets of the reference GPT, the same names for every command (`equishard train`, `inspect` and `plan --model NAME`)."""


class MoEAuxSum(eqx.Module):
    """The MoE statistics of one forward pass, summed over the MoE layers."""

    load_balancing_loss: Float[Array, ""]
    z_loss: Float[Array, ""]
    dropped: Int[Array, ""]

    @staticmethod
    def zeros() -> "MoEAuxSum":
        return MoEAuxSum(jnp.zeros(()), jnp.zeros(()), jnp.zeros((), jnp.int32))

    def __add__(self, other: "MoEAuxSum") -> "MoEAuxSum":
        return jax.tree.map(jnp.add, self, other)


def _block(
    config: GPTConfig, par: Parallelism, moe: bool, *, key: PRNGKeyArray, lora: LoRA | None = None
) -> TransformerBlock:
    """One pre-norm block: rotary attention, then a SwiGLU MLP or (with `moe`) an MoE
    layer; with `lora`, adapters on its targets."""
    style = "sequence" if par.sequence_parallel else "megatron"
    experts = None
    if moe:
        # The block splits `key` into (attention, feed-forward) keys: the MoE takes the second.
        experts = MoE(
            config.d_model, config.d_ff, config.num_experts, config.top_k,
            capacity_factor=config.capacity_factor, group_size=config.moe_group_size,
            expert_axis_name=par.expert or "ep",
            data_axis_name=tuple(a for a in par.data_axes if a != par.expert),
            activation=jax.nn.silu, key=jax.random.split(key)[1],
        )  # fmt: skip
    n_kv = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    return TransformerBlock(
        config.d_model, config.n_heads, config.d_ff, n_kv_heads=n_kv,
        kv_replicated=par.size(par.tensor) > n_kv, axis_name=tensor_axis(par), context_axis_name=par.context,
        context_impl=par.context_impl, style=style, rotary=True,
        rotary_base=config.rotary_base, rotary_scaling=config.rotary_scaling, swiglu=True,
        qkv_bias=config.qkv_bias, eps=config.norm_eps, moe=experts, key=key,
        lora=lora,
    )  # fmt: skip


class Unit(eqx.Module):
    """The repeating unit of the stack: `moe_every` blocks (the last with MoE), or one."""

    blocks: list[TransformerBlock]

    def __init__(self, config: GPTConfig, par: Parallelism, *, key: PRNGKeyArray, lora: LoRA | None = None):
        k = max(config.moe_every, 1)
        keys = jax.random.split(key, k)
        self.blocks = [
            _block(config, par, moe=config.moe_every > 0 and i == k - 1, key=keys[i], lora=lora)
            for i in range(k)
        ]

    def __call__(
        self, x: Array, positions: Array | None = None, segment_ids: Array | None = None,
        lora_dropout: LoRADropout | None = None,
    ) -> tuple[Array, MoEAuxSum]:  # fmt: skip
        """`lora_dropout`: the adapters' draw for this unit (its index folded in), each
        block's index in the unit folded in here."""
        total = MoEAuxSum.zeros()
        for i, block in enumerate(self.blocks):
            drop = None if lora_dropout is None else lora_dropout.at(i)
            x, aux = block.call_with_aux(x, positions=positions, segment_ids=segment_ids, lora_dropout=drop)
            if aux is not None:
                total = total + MoEAuxSum(aux.load_balancing_loss, aux.z_loss, aux.dropped)
        return x, total


class _OutputOnly(eqx.Module):
    """A unit as a pipeline stage: activations in, activations out.

    `positions` (`[T]`, the same for every example) reaches every stage's call unchanged.
    A packed batch's per-example positions and segment ids travel with the activations
    instead (`_attach_tokens`: features past `d_model`), so each micro-batch has its own.
    With adapter dropout (`seed`, the draw's `uint32[2]`, given), the last `_DROPOUT_FEATURES`
    carry each example's global index and the global index of the unit it enters
    (`_attach_ints`), which each unit advances: the layers need not know where the
    schedule put them.
    """

    unit: Any
    d_model: int = eqx.field(static=True, default=0)

    def __call__(self, x: Array, positions: Array | None = None, seed: Array | None = None) -> Array:
        if seed is None and (not self.d_model or x.shape[-1] == self.d_model):
            return self.unit(x, positions)[0]
        h, carried = x[..., : self.d_model], x[..., self.d_model :]
        tokens = carried[..., : carried.shape[-1] - (0 if seed is None else _DROPOUT_FEATURES)]
        segments = None
        if tokens.shape[-1]:
            positions, segments = _detach_tokens(tokens)
        if seed is None:
            return jnp.concatenate([self.unit(h, positions, segments)[0], carried], axis=-1)
        assert positions is not None  # the model passes them with a seed
        examples, layer = _detach_ints(carried[..., tokens.shape[-1] :]).T  # int32[b] each
        # Every example of a micro-batch enters the same unit.
        drop = LoRADropout(seed, examples, positions, segments).at(layer[0])
        y = self.unit(h, positions, segments, drop)[0]
        advanced = _attach_ints(y, jnp.stack([examples, layer + 1], axis=-1))
        return jnp.concatenate([advanced[..., : self.d_model], tokens, advanced[..., self.d_model :]], axis=-1)


_DIGITS = 3  # base-256 digits per carried int: ids below 2**24, exact in bf16 and float16
_DROPOUT_FEATURES = 2 * _DIGITS  # an example's global index and a unit's, in digits


def _digits(ints: Array, dtype: Any) -> Array:
    """`int32[..., n]` as `[..., n * _DIGITS]` base-256 digits in `dtype`, never differentiated."""
    digits = jnp.stack([(ints >> (8 * i)) & 255 for i in range(_DIGITS)], axis=-1)  # [..., n, 3]
    return jax.lax.stop_gradient(digits.reshape(*ints.shape[:-1], -1).astype(dtype))


def _from_digits(carried: Array) -> Array:
    """`_digits`' features `[..., n * _DIGITS]` back to `int32[..., n]`."""
    digits = jnp.round(jax.lax.stop_gradient(carried).astype(jnp.float32)).astype(jnp.int32)
    digits = digits.reshape(*carried.shape[:-1], -1, _DIGITS)
    ints = digits[..., 0]
    for i in range(1, _DIGITS):
        ints = ints | (digits[..., i] << (8 * i))
    return ints


def _attach_ints(x: Array, ints: Array) -> Array:
    """`x` `[b, t, D]` with `int32[b, n]`, one row per example (below 2**24), appended as
    features `[b, t, D + n * _DIGITS]` (the same at every token)."""
    carried = jnp.broadcast_to(_digits(ints, x.dtype)[:, None, :], (*x.shape[:2], ints.shape[-1] * _DIGITS))
    return jnp.concatenate([x, cast_varying(carried, varying_axes(x))], axis=-1)


def _detach_ints(carried: Array) -> Array:
    """`_attach_ints`' appended features `[b, t, n * _DIGITS]` back to `int32[b, n]`."""
    return _from_digits(carried[:, 0, :])


def _attach_tokens(x: Array, positions: Array, segments: Array) -> Array:
    """`x` `[b, t, D]` with the tokens' int positions and segment ids `[b, T]` appended as
    features `[b, t, D + 6 T / t]`: base-256 digits (exact in any float dtype, no
    arithmetic the pipeline does changes them), never differentiated."""
    b, t = x.shape[:2]
    if positions.shape[-1] >= 2 ** (8 * _DIGITS):  # positions and segment ids are below T
        raise LayerConfigError(
            f"GPT: a pipeline carries a packed batch's positions in {_DIGITS} base-256 digits; "
            f"sequences of {positions.shape[-1]} tokens need more."
        )
    ints = jnp.stack([positions, segments], axis=-1).astype(jnp.int32)  # i32[b, T, 2]
    carried = _digits(ints, x.dtype).reshape(b, t, -1)  # [b, T, 2 * 3] -> [b, t, 6 T / t]
    return jnp.concatenate([x, cast_varying(carried, varying_axes(x))], axis=-1)


def _detach_tokens(carried: Array) -> tuple[Array, Array]:
    """`_attach_tokens`' appended features back to int32 positions and segment ids `[b, T]`."""
    ints = _from_digits(carried.reshape(carried.shape[0], -1, 2 * _DIGITS))  # i32[b, T, 2]
    return ints[..., 0], ints[..., 1]


def _remat(fn: Any, config: GPTConfig) -> Any:
    policy = remat_policy(config.remat, offload=config.remat_offload)
    return fn if policy is None else eqx.filter_checkpoint(fn, policy=policy)


def _unroll(config: GPTConfig) -> int:
    """The layer scan's `unroll`: `config.scan_unroll`, with `"auto"` resolved (see `GPTConfig`)."""
    if config.scan_unroll != "auto":
        return config.scan_unroll
    return config.n_layers if jax.default_backend() == "gpu" else 1


def _check(config: GPTConfig, par: Parallelism) -> None:
    k = max(config.moe_every, 1)
    if config.n_layers % k:
        raise LayerConfigError(
            f"GPT: n_layers={config.n_layers} is not divisible by moe_every={config.moe_every}."
        )
    remat_policy(config.remat, offload=config.remat_offload)  # raises for a bad name
    if config.scan_unroll != "auto" and config.scan_unroll < 1:
        raise LayerConfigError(
            f"GPT: scan_unroll={config.scan_unroll!r} must be 'auto' or at least 1."
        )
    if config.batch_chunks < 1:
        raise LayerConfigError(f"GPT: batch_chunks={config.batch_chunks} must be at least 1.")
    if config.batch_chunks > 1 and par.pipeline:
        raise LayerConfigError(
            f"GPT: batch_chunks={config.batch_chunks} with a pipeline axis: the pipeline's "
            f"micro-batches split the batch already; use batch_chunks=1."
        )
    if config.batch_chunks > 1 and config.moe_every:
        raise LayerConfigError(
            f"GPT: batch_chunks={config.batch_chunks} with MoE layers: their auxiliary "
            f"losses are over the whole batch; use batch_chunks=1."
        )
    if par.pipeline and config.moe_every:
        raise LayerConfigError(
            "GPT: a mixture-of-experts model cannot run on a pipeline axis (a stage passes "
            "activations only, not the MoE auxiliary losses); drop pp or moe_every."
        )
    if par.expert and not config.moe_every:
        raise LayerConfigError(
            f"GPT: the layout has an expert axis {par.expert!r} but the model has no MoE "
            f"layers (moe_every=0); use an MoE preset such as 'small-moe'."
        )
    if par.sequence_parallel and config.moe_every:
        raise LayerConfigError("GPT: sequence parallelism with MoE layers is not supported.")
    if par.context and config.moe_every:
        raise LayerConfigError(
            f"GPT: a context-parallel axis {par.context!r} with MoE layers is not "
            f"supported; drop cp or moe_every."
        )
    explicit = not differentiated_scan(par.pipeline_schedule)
    if par.context and par.pipeline and explicit and par.context_impl == RING:
        raise LayerConfigError(
            f"GPT: ring attention over the context axis {par.context!r} does not run under "
            f"the {par.pipeline_schedule!r} pipeline schedule (its key/value ring would "
            f"run inside the schedule's per-stage branches, which XLA:CPU does not "
            f"execute); use cp_impl='alltoall', or pipeline_schedule='gpipe' or 'circular'."
        )
    if par.context and par.context_impl == ALLTOALL:
        local_heads = config.n_heads // max(par.size(par.tensor), 1)
        if local_heads % par.size(par.context):
            raise LayerConfigError(
                f"GPT: all-to-all context parallelism needs the {local_heads} heads per tensor "
                f"shard divisible by the context axis {par.context!r} of size "
                f"{par.size(par.context)}; use cp_impl='ring'."
            )
    tp = par.size(par.tensor)
    for name, value in (
        ("n_heads", config.n_heads),
        ("d_ff", config.d_ff),
        ("vocab_size", config.vocab_size),
    ):
        if value % tp:
            raise LayerConfigError(
                f"GPT: {name}={value} is not divisible by the tensor-parallel axis "
                f"{par.tensor!r} of size {tp}; choose a layout whose tp divides it."
            )
    if config.d_model % config.n_heads:
        raise LayerConfigError(
            f"GPT: n_heads={config.n_heads} does not divide d_model={config.d_model}."
        )
    n_kv = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    if n_kv < 1 or config.n_heads % n_kv:
        raise LayerConfigError(
            f"GPT: n_kv_heads={config.n_kv_heads} does not divide n_heads={config.n_heads}."
        )
    if (tp % n_kv if tp > n_kv else n_kv % tp):
        raise LayerConfigError(
            f"GPT: n_kv_heads={n_kv} and the tensor-parallel axis {par.tensor!r} of size {tp} "
            f"do not divide one another (key/value heads are split over the axis, or "
            f"replicated over it when it is larger); choose a layout whose tp divides or is a "
            f"multiple of n_kv_heads."
        )
    ep = par.size(par.expert)
    if config.moe_every and config.num_experts % ep:
        raise LayerConfigError(
            f"GPT: num_experts={config.num_experts} is not divisible by the expert axis "
            f"{par.expert!r} of size {ep}."
        )
    if par.pipeline:
        units = config.n_layers // k
        if units % (par.num_stages * par.pipeline_repeats):
            raise LayerConfigError(
                f"GPT: n_layers={config.n_layers} is not divisible by the {par.num_stages} "
                f"pipeline stages x {par.pipeline_repeats} repeats."
            )


class GPT(eqx.Module, GathersFSDP):
    """The reference decoder-only transformer (local view; see the module documentation).

    **Arguments:**

    - `config`: a `GPTConfig` (see `PRESETS`).
    - `parallelism`: how the model uses the mesh (a `Parallelism`, normally from
      `equishard.Layout`); the default is one device.
    - `key`: a PRNG key. The global parameters depend on it alone, not on the layout.
    - `lora`: LoRA adapters on the blocks' projections (`equishard.models.LoRA`; `None`:
      none). To adapt a model that has its weights already, use `add_lora`.
    """

    embed: ParallelEmbedding
    units: Any
    norm: RMSNorm
    head: ColumnParallelLinear | None
    config: GPTConfig = eqx.field(static=True)
    parallelism: Parallelism = eqx.field(static=True)
    gather_dtype: Any = eqx.field(static=True)
    grad_scatter_dtype: Any = eqx.field(static=True)

    after_pipeline: ClassVar[tuple[str, ...]] = ("norm", "head")
    """The fields run after the blocks: with a pipeline axis they are replicated over the
    stages and every stage runs them (on its mostly-zero pipeline output), so their
    gradients are summed over the stages too (see `equishard.report.gpt_minimum`)."""

    def __init__(
        self, config: GPTConfig, parallelism: Parallelism = Parallelism(), *, key: PRNGKeyArray,
        lora: LoRA | None = None,
    ):  # fmt: skip
        par = parallelism
        _check(config, par)
        ekey, ukey, hkey = jax.random.split(key, 3)
        sp = par.sequence_parallel
        axes = par.axes
        self.embed = ParallelEmbedding(
            config.vocab_size, config.d_model, axis_name=tensor_axis(par), partition="vocab",
            sequence_parallel=sp, init_type="normal", normal_std=0.02, key=ekey,
        )  # fmt: skip
        num_units = config.n_layers // max(config.moe_every, 1)

        def make_unit(key: PRNGKeyArray) -> Any:
            unit: Any = Unit(config, par, key=key, lora=lora)
            if par.fsdp:
                unit = FSDP(unit, par.fsdp, min_weight_size=par.fsdp_min_weight_size)
            return unit

        if par.pipeline:
            units: Any = PipelineModule(
                lambda k: _OutputOnly(make_unit(k), config.d_model), par.pipeline, par.num_microbatches,
                num_layers=num_units, num_stages=par.num_stages, repeats=par.pipeline_repeats,
                schedule=par.pipeline_schedule, key=ukey,
            )  # fmt: skip
        else:
            keys = jax.random.split(ukey, num_units)
            units = add_leading_axis(eqx.filter_vmap(make_unit)(keys))
        head = None if config.tied else ColumnParallelLinear(
            config.d_model, config.vocab_size, axis_name=tensor_axis(par), bias=False, gather_output=False,
            sequence_parallel=sp, key=hkey,
        )  # fmt: skip
        norm = RMSNorm(config.d_model, eps=config.norm_eps)
        if par.fsdp is not None:
            fsdp = par.fsdp
            # The arrays outside the units are split over fsdp too, by the same rule
            # (on the dimension tp leaves free; small ones stay replicated): the
            # embedding and the head, both f32[V/tp, D/fsdp].
            mesh = jax.sharding.AbstractMesh(par.sizes, par.axes)
            split = lambda m: fsdp_split_params(m, fsdp, par.fsdp_min_weight_size, mesh=mesh)  # noqa: E731
            self.embed, norm, head = split(self.embed), split(norm), split(head)
        # Axes the mesh lacks drop out of the specs; their layers then compute locally.
        self.embed = restrict_specs(self.embed, axes)
        self.units = restrict_specs(units, axes)
        self.norm = restrict_specs(norm, axes)
        self.head = restrict_specs(head, axes)
        self.config = config
        self.parallelism = par
        # The dtypes the embedding, norm and head are gathered in under fsdp (`None`:
        # their own), set by the train step's precision policy (`with_fsdp_dtypes`).
        self.gather_dtype = self.grad_scatter_dtype = None

    def hidden(
        self,
        ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        index: Int[Array, " examples"] | None = None,
    ) -> tuple[Array, MoEAuxSum]:
        """The final hidden states `[batch, seq(/tp), d_model]` and the MoE statistics.

        `positions`: the tokens' global positions (required with a context axis, where
        `ids` is this device's part of the sequence); default `0, 1, ...`. With
        `segment_ids` (packed documents: attention stays inside each), each token's
        position in its document. `key`, `index`: the LoRA adapters' dropout, as `loss`
        takes them (`key=None`: none).
        """
        if self.parallelism.context and positions is None:
            raise LayerConfigError(
                f"GPT: the sequence is split over the context axis {self.parallelism.context!r}; "
                f"give the batch as token_batch(windows, cp) (inputs, labels and positions)."
            )
        drop = self._lora_dropout(key, index, ids, positions, segment_ids)
        # The table's gradient is reduce-scattered over fsdp by the gather's transpose;
        # the lookup's backward is a scatter-add that needs no table.
        x = self._gathered(self.embed, ids)(ids)
        if self.parallelism.pipeline:
            return self._pipelined(x, positions, segment_ids, drop), MoEAuxSum.zeros()
        chunks = self.config.batch_chunks
        if chunks == 1:
            return self._blocks(x, self.units, positions, segment_ids, drop)
        batch = x.shape[0]
        if batch % chunks:
            raise LayerConfigError(
                f"GPT: the local batch of {batch} examples does not split into "
                f"batch_chunks={chunks} equal pieces."
            )
        # Cast once to vary like the activations: the gradients of the parameters
        # replicated over an axis (the norms' scales; over dp all of them) are then
        # summed over it once for all the pieces, not once per piece.
        params, static = eqx.partition(self.units, eqx.is_array)
        units = eqx.combine(cast_varying(params, varying_axes(x)), static)
        size = batch // chunks
        pieces = [slice(i * size, (i + 1) * size) for i in range(chunks)]
        piece = lambda a, p: None if a is None else a[p]  # noqa: E731
        outs = [
            self._blocks(x[p], units, piece(positions, p), piece(segment_ids, p), None if drop is None else drop.rows(p))[0]
            for p in pieces
        ]
        # No MoE layers here (`_check`): their statistics are zero.
        return jnp.concatenate(outs, axis=0), MoEAuxSum.zeros()

    def _pipelined(
        self, x: Array, positions: Array | None, segment_ids: Array | None, drop: LoRADropout | None
    ) -> Array:
        """The pipeline's output `[B, T(/tp), D]` from the embeddings `x`: what each
        micro-batch needs of the batch travels with its activations (`_OutputOnly`)."""
        examples = None if drop is None else drop.examples
        y = self.units(_entering(x, positions, segment_ids, examples), *_stage_args(positions, segment_ids, drop))
        return y if y.shape[-1] == self.config.d_model else y[..., : self.config.d_model]

    def _blocks(
        self, x: Array, units: Any, positions: Array | None, segments: Array | None, drop: LoRADropout | None
    ) -> tuple[Array, MoEAuxSum]:
        """The stacked units (no pipeline) on `x`: the hidden states and the MoE statistics."""
        params, static = eqx.partition(units, eqx.is_array)
        call = _remat(lambda unit, x, positions, segments, drop: unit(x, positions, segments, drop), self.config)
        # Regathering FSDP units without a remat policy, dense and on one context shard,
        # keep only top-level tensor-parallel collectives: their scan is differentiated
        # as one (`scan_units`, the same values and gradients, traced in fewer passes).
        # Not with adapter dropout, whose draw needs each unit's index.
        as_one = (
            remat_policy(self.config.remat, offload=self.config.remat_offload) is None
            and not self.config.moe_every
            and not self.parallelism.context
            and drop is None
            and scannable(params, static, x)
        )

        def body(x: Array, layer_and_index: Any) -> tuple[Array, MoEAuxSum]:
            layer, i = layer_and_index
            unit = drop_leading_axis(eqx.combine(layer, static))
            return call(unit, x, positions, segments, None if drop is None else drop.at(i))

        if as_one:
            x, aux = scan_units(params, static, x, positions, segments)
        elif drop is None:
            x, aux = jax.lax.scan(lambda x, layer: body(x, (layer, None)), x, params, unroll=_unroll(self.config))
        else:  # each unit's index scanned beside its arrays
            steps = (params, jnp.arange(jax.tree.leaves(params)[0].shape[0], dtype=jnp.int32))
            x, aux = jax.lax.scan(body, x, steps, unroll=_unroll(self.config))
        return x, jax.tree.map(lambda a: a.sum(0), aux)

    def _lora_dropout(
        self, key: PRNGKeyArray | None, index: Array | None, ids: Array, positions: Array | None,
        segments: Array | None,
    ) -> LoRADropout | None:  # fmt: skip
        """The adapters' dropout draw for the local batch `ids` `[B, T]` (`None`: no key,
        or no adapter with dropout). `index` defaults to the examples' places in the
        global batch split over the data axes (that of a step without micro-steps)."""
        if key is None or not adapter_dropout(self.units):
            return None
        batch, seq = ids.shape
        if index is None:
            axes = tuple(a for a in self.parallelism.data_axes if is_bound(a))
            index = global_index(batch, axes or None)
        if index.shape != (batch,):
            raise LayerConfigError(
                f"GPT: index has shape {index.shape}; it must hold the global index of each of "
                f"the {batch} local examples (int32[{batch}])."
            )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), ids.shape)
        return LoRADropout.from_key(key, index.astype(jnp.int32), positions, segments)

    def logits(self, h: Array) -> Float[Array, "batch seq vocab_local"]:
        """Logits split over the vocabulary on the tensor axis: `[batch, seq, V/tp]`."""
        h = self._gathered(self.norm, h)(h)
        if self.head is not None:
            # Gathered once h exists; the gathered f32[D, V/tp] is kept for the
            # backward pass (the input's gradient needs it): no second gather.
            return self._masked(self._gathered(self.head, h)(h))
        table = jnp.asarray(self._gathered(self.embed, h).weight.value)
        if self.parallelism.sequence_parallel:
            h = gather_tokens(h, tensor_axis(self.parallelism))
        # f32[B, T(/tp), D] @ f32[D, V/tp]
        return self._masked(matmul_t(h, table))

    def _masked(self, logits: Array) -> Array:
        """`logits` `[B, T, V/tp]` with the padding ids' (`GPTConfig.real_vocab_size`) set
        to the lowest finite value."""
        return _mask_padding_ids(self.config, self.parallelism, logits)

    def _cross_entropy(self, h: Array, labels: Array) -> Float[Array, ""]:
        """The mean cross-entropy of the local tokens from the blocks' output `h`."""
        h = self._gathered(self.norm, h)(h)
        # Gathered once h exists (under fsdp); the head's or the table's rows f32[V/tp, D].
        head = self._gathered(self.head, h)
        table = None if head is not None else self._gathered(self.embed, h).weight
        return _mean_cross_entropy(self.config, self.parallelism, h, head, table, labels)

    def _packed_loss(self, h: Array, labels: Array, aux: MoEAuxSum) -> tuple[Array, dict[str, Array]]:
        """The loss of a packed batch: the cross-entropy summed over the labelled tokens of
        the global batch over their count (devices hold different counts), plus the MoE
        auxiliary losses as `loss` adds them."""
        par = self.parallelism
        h = self._gathered(self.norm, h)(h)
        head = self._gathered(self.head, h)
        table = None if head is not None else self._gathered(self.embed, h).weight
        total, count = _cross_entropy_sums(self.config, par, h, head, table, labels, IGNORE_LABEL)
        mean_axes = (*par.data_axes, *((par.context,) if par.context else ()))
        if mean_axes:
            total, count = jax.lax.psum((total, count), mean_axes)
        ce = total / jnp.maximum(count, 1).astype(total.dtype)
        metrics = {"cross_entropy": ce}
        loss = ce
        moe_layers = self.config.n_layers // self.config.moe_every if self.config.moe_every else 0
        if moe_layers:
            lb, z = aux.load_balancing_loss / moe_layers, aux.z_loss / moe_layers
            if mean_axes:
                lb, z = jax.lax.pmean((lb, z), mean_axes)
            loss = loss + self.config.aux_loss_weight * lb + self.config.z_loss_weight * z
            metrics.update(load_balancing_loss=lb, z_loss=z, dropped=aux.dropped)
        if par.pipeline:  # computed on every stage, from the last stage's outputs
            loss, ce = from_last_stage(loss, par.pipeline), from_last_stage(ce, par.pipeline)
            metrics["cross_entropy"] = ce
        return loss, metrics

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab_local"]:
        """Logits for `ids` (local view)."""
        return self.logits(self.hidden(ids)[0])

    def _gathered(self, module: Any, anchor: Array) -> Any:
        """`module` with its arrays split over fsdp all-gathered (inside `shard_map`).

        The gathers wait for `anchor` (so that they are not hoisted to the start of the
        step) and the local blocks are first cast to vary like it, so that the
        gradients' sum over the other data axes is taken on the blocks, after the
        reduce-scatter. Anything else (no fsdp axis, outside `shard_map`, nothing
        split) is `module` itself.
        """
        fsdp = self.parallelism.fsdp
        if fsdp is None or module is None or not is_bound(fsdp):
            return module
        boxes = jax.tree.leaves(module, is_leaf=is_sharded)
        if not any(is_sharded(b) and fsdp in spec_axes(b.spec) for b in boxes):
            return module
        return fsdp_gather_params(_after(module, anchor), fsdp, self.gather_dtype, self.grad_scatter_dtype)

    def _tie_varying(self, ids: Array) -> "GPT":
        """This model with the tied table cast to vary like the batch, once for both uses.

        The lookup and the head then share one cast, whose transpose sums the table's
        gradient over the data axes in one all-reduce of `f32[V/tp, D]`; cast by each
        use, it would be reduced twice (once transposed). Under fsdp the table is
        gathered once for both uses, and its gradient reduce-scattered once.
        """
        if self._gathered(self.embed, ids) is not self.embed:
            return eqx.tree_at(lambda m: m.embed, self, self._gathered(self.embed, ids))
        table = cast_varying(jnp.asarray(self.embed.weight.value), varying_axes(ids))
        return eqx.tree_at(lambda m: m.embed.weight.value, self, table)

    def _scheduled_loss(
        self, ids: Array, labels: Array, positions: Array | None = None,
        segments: Array | None = None, packed: bool = False, drop: LoRADropout | None = None,
    ) -> tuple[Array, dict[str, Array]]:  # fmt: skip
        """The loss with an explicit pipeline schedule (1F1B, interleaved 1F1B, ZB-H1).

        The embedding runs on the first stage and the final norm, head and cross-entropy
        on the last, micro-batch by micro-batch inside the schedule
        (`PipelineModule.loss`); their gradients leave the pipeline per micro-batch. A
        packed batch's micro-batches carry their positions and segment ids with their
        activations, and each one's loss is its labelled tokens' sum over the global
        count (known before the schedule). With adapter dropout (`drop`), each example's
        global index travels with its activations too.
        """
        par = self.parallelism
        mean_axes = (*par.data_axes, *((par.context,) if par.context else ()))
        d_model = self.config.d_model
        # Under fsdp the embedding, norm and head are gathered here, once per step (their
        # gradients summed over the micro-batches, then reduce-scattered once), as the
        # pipeline gathers its units.
        # Cast to vary over the stages (each runs on one) and like the batch first: the
        # sums of their gradients over both then run on the split blocks, after the
        # reduce-scatters, one all-reduce for all three.
        embed, norm, head = cast_varying(
            (self.embed, self.norm, self.head), {self.units.model_axis_name, *varying_axes(ids)}
        )
        embed = self._gathered(embed, ids)
        norm, head = self._gathered(norm, ids), self._gathered(head, ids)
        embed_arrays, embed_static = eqx.partition(embed, eqx.is_array)
        tail = (norm, head, None if head is not None else embed.weight)
        tail_arrays, tail_static = eqx.partition(tail, eqx.is_array)

        def first(arrays: Any, inputs_m: Any) -> Array:
            ids_m, positions_m, segments_m, examples_m = inputs_m
            # f32[b, T(/tp), D], with what the micro-batch carries appended
            return _entering(eqx.combine(arrays, embed_static)(ids_m), positions_m, segments_m, examples_m)

        def last(arrays: Any, h: Array, targets_m: Any) -> Array:
            norm, head, table = eqx.combine(arrays, tail_static)
            h = norm(h[..., :d_model])
            if not packed:
                return _mean_cross_entropy(self.config, par, h, head, table, targets_m)
            labels_m, scale_m = targets_m
            total = _cross_entropy_sums(self.config, par, h, head, table, labels_m, IGNORE_LABEL)[0]
            return total * scale_m[0]

        targets: Any = labels
        if packed:
            # The schedule averages its micro-batches: each one's sum is scaled by
            # M / (the global batch's labelled tokens), one value per example. f32[B]
            count = jnp.sum(labels != IGNORE_LABEL)
            count = jax.lax.psum(count, mean_axes) if mean_axes else count
            scale = self.units.num_microbatches / jnp.maximum(count, 1).astype(jnp.float32)
            targets = (labels, jnp.broadcast_to(scale, labels.shape[:1]))
        inputs = (ids, None if segments is None else positions, segments, None if drop is None else drop.examples)
        ce = self.units.loss(
            inputs, targets, first=first, first_params=embed_arrays, last=last,
            last_params=tail_arrays, layer_args=_stage_args(positions, segments, drop),
        )  # fmt: skip
        if mean_axes:
            ce = jax.lax.psum(ce, mean_axes) if packed else jax.lax.pmean(ce, mean_axes)
        return ce, {"cross_entropy": ce}

    def loss(
        self, batch: Int[Array, "batch seq_plus_one"] | dict[str, Array], key: PRNGKeyArray | None = None,
        *, index: Int[Array, " examples"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:  # fmt: skip
        """The global next-token loss of a local batch (to differentiate), and metrics.

        **Arguments:**

        - `batch`: this device's `int32[B/data, T + 1]` windows (inputs `[:, :-1]`,
          targets `[:, 1:]`), or the dict of `token_batch` (`inputs`, `labels`,
          `positions`, each `int32[B/data, T/cp]`), which a context axis needs, or a
          packed batch of documents (`equishard.train.pack_windows`: also
          `segment_ids` and `document_positions`; see `GPTConfig.document_masking`).
        - `key`: the step's key (the same on every device), for the LoRA adapters'
          dropout (`LoRA(dropout=p)`); `None` (evaluation): no dropout. Unused by a model
          without adapter dropout.
        - `index`: `int32[B/data]`, the global indices of the local examples in the
          step's batch, which the dropout masks are drawn by (`make_train_step` gives a
          loss function that takes `index` these: pass them on, and the masks are the
          one-device masks under every layout and `grad_accum`). `None`: the examples'
          places in the global batch split over the data axes, right without
          accumulation micro-steps.

        **Returns:**

        `(loss, metrics)`: cross-entropy (nats per token) plus the weighted MoE
        auxiliary losses, averaged over the global batch (a packed batch: over its
        labelled tokens); metrics are global scalars.
        """
        par = self.parallelism
        ids, labels, positions, segments, packed = _batch_fields(self.config, par, batch)
        if isinstance(self.units, PipelineModule) and self.units.explicit:
            if par.context and positions is None:
                self.hidden(ids, positions)  # raises: the context axis needs positions
            drop = self._lora_dropout(key, index, ids, positions, segments)
            return self._scheduled_loss(ids, labels, positions, segments, packed, drop)
        model = self._tie_varying(ids) if self.config.tied else self
        h, aux = model.hidden(ids, positions, segments, key=key, index=index)
        if packed:
            return model._packed_loss(h, labels, aux)
        ce = model._cross_entropy(h, labels)
        loss = ce
        moe_layers = self.config.n_layers // self.config.moe_every if self.config.moe_every else 0
        if moe_layers:
            loss = loss + (
                self.config.aux_loss_weight * aux.load_balancing_loss
                + self.config.z_loss_weight * aux.z_loss
            ) / moe_layers
        # Every device holds as many tokens: the mean over the data and context axes of
        # the local means is the global mean.
        mean_axes = (*par.data_axes, *((par.context,) if par.context else ()))
        if mean_axes:
            loss = jax.lax.pmean(loss, mean_axes)
            ce = jax.lax.pmean(ce, mean_axes)
        if par.pipeline:
            loss = from_last_stage(loss, par.pipeline)
            ce = from_last_stage(ce, par.pipeline)
        metrics = {"cross_entropy": ce}
        if moe_layers:
            metrics["load_balancing_loss"] = aux.load_balancing_loss / moe_layers
            metrics["z_loss"] = aux.z_loss / moe_layers
            metrics["dropped"] = aux.dropped
        return loss, metrics


def _mean_cross_entropy(
    config: GPTConfig, par: Parallelism, h: Array, head: ColumnParallelLinear | None,
    table: Any, labels: Array,
) -> Float[Array, ""]:  # fmt: skip
    """The mean cross-entropy of the local tokens from the normed hidden states `h`.

    `h`: `[B, T(/tp), D]` (split over the tokens with sequence parallelism); the output
    weight is the untied `head`'s or the tied embedding `table` (`f32[V/tp, D]`).
    """
    return _cross_entropy_sums(config, par, h, head, table, labels, None)[0] / labels.size


def _mask_padding_ids(config: GPTConfig, par: Parallelism, logits: Array) -> Array:
    """`logits` `[..., V/tp]` with the padding ids' (`GPTConfig.real_vocab_size`) set to
    the lowest finite value: no weight in a softmax, never an argmax."""
    real = config.real_vocab_size
    if real is None or real >= config.vocab_size:
        return logits
    local = logits.shape[-1]
    ids = jnp.arange(local)
    tp = tensor_axis(par)
    if is_bound(tp):
        ids = ids + jax.lax.axis_index(tp) * local
    return jnp.where(ids < real, logits, jnp.finfo(logits.dtype).min)


def _cross_entropy_sums(
    config: GPTConfig, par: Parallelism, h: Array, head: ColumnParallelLinear | None,
    table: Any, labels: Array, ignore_index: int | None,
) -> tuple[Float[Array, ""], Int[Array, ""]]:  # fmt: skip
    """The cross-entropy summed over the local tokens whose label is not `ignore_index`,
    and their count, from the normed hidden states `h` (as `_mean_cross_entropy`)."""
    tp = tensor_axis(par)
    if config.fused_loss:
        if par.sequence_parallel and is_bound(tp):
            h = gather_tokens(h, tp)  # f32[B, T/tp, D] -> f32[B, T, D]
        weight = head.weight if head is not None else table
        sums = fused_cross_entropy(
            h, weight, labels, tp, chunk_size=config.loss_chunk_size, ignore_index=ignore_index,
            vocab_size=config.real_vocab_size,
        )  # the padding ids of a padded vocabulary count for nothing
        return sums.loss, sums.tokens
    if head is not None:
        logits = head(h)
    else:
        if par.sequence_parallel and is_bound(tp):
            h = gather_tokens(h, tp)
        # f32[B, T, D] @ f32[D, V/tp]
        logits = matmul_t(h, jnp.asarray(table.value))
    logits = _mask_padding_ids(config, par, logits)
    ce = vocab_parallel_cross_entropy(logits.astype(jnp.float32), labels, tp, ignore_index=ignore_index)
    count = labels.size if ignore_index is None else jnp.sum(labels != ignore_index)
    return jnp.sum(ce), jnp.asarray(count, jnp.int32)


def _batch_fields(
    config: GPTConfig, par: Parallelism, batch: Any
) -> tuple[Array, Array, Array | None, Array | None, bool]:
    """`(ids, labels, positions, segment_ids, packed)` of a batch given to `GPT.loss`.

    A packed batch (with `segment_ids`) under `config.document_masking` gives its
    documents' positions and segment ids; without, its global positions and no segments.
    """
    if not isinstance(batch, dict):
        return batch[:, :-1], batch[:, 1:], None, None, False
    ids, labels, positions = batch["inputs"], batch["labels"], batch["positions"]
    if "segment_ids" not in batch:
        return ids, labels, positions, None, False
    if config.document_masking:
        return ids, labels, batch["document_positions"], batch["segment_ids"], True
    return ids, labels, positions, None, True


def _entering(x: Array, positions: Array | None, segments: Array | None, examples: Array | None) -> Array:
    """The embeddings `x` `[b, t, D]` as they enter a pipeline: with a packed batch's
    positions and segment ids (`_attach_tokens`), then with adapter dropout the
    examples' global indices and the first unit's index, 0 (`_attach_ints`), appended."""
    if segments is not None:
        assert positions is not None
        x = _attach_tokens(x, positions, segments)
    if examples is not None:
        x = _attach_ints(x, jnp.stack([examples, jnp.zeros_like(examples)], axis=-1))
    return x


def _stage_args(positions: Array | None, segments: Array | None, drop: LoRADropout | None) -> tuple[Any, ...]:
    """The arguments every pipeline layer call gets (`_OutputOnly`): the positions row
    (none for a packed batch, whose micro-batches carry theirs) and with adapter dropout
    the draw's seed (the positions row then always given)."""
    if drop is None:
        return _position_row(positions) if segments is None else ()
    return ((drop.positions[0],) if segments is None else (None,)) + (drop.seed,)


def _position_row(positions: Array | None) -> tuple[Array, ...]:
    """`(positions[0],)`, the one positions row `int32[T/cp]` a pipeline's layers share, or `()`.

    A pipeline passes its layers one set of extra arguments for every micro-batch, so the
    rows must agree: `token_batch` gives every example the same positions.
    """
    return () if positions is None else (positions[0],)


def check_context_split(par: Parallelism, seq_len: int) -> None:
    """Check that a sequence of `seq_len` tokens splits over the layout's context axis.

    The zigzag split needs `seq_len` divisible by `2 cp`, and with sequence parallelism
    each device's `seq_len / cp` tokens must split over the tensor axis too.

    **Raises:**

    `LayerConfigError` naming the sizes.
    """
    cp = par.size(par.context)
    if cp == 1:
        return
    tp = par.size(par.tensor) if par.sequence_parallel else 1
    if seq_len % (2 * cp * tp):
        raise LayerConfigError(
            f"the sequence length {seq_len} does not split over the context axis "
            f"{par.context!r} of size {cp} in zigzag order (2 x {cp} chunks"
            + (f", each device's part over tp={tp}" if tp > 1 else "")
            + f"); use a multiple of {2 * cp * tp}."
        )


def token_batch(windows: Any, cp: int = 1) -> dict[str, Any]:
    """Inputs, labels and positions `[B, S]` from windows `[B, S + 1]`, in zigzag order over `cp`.

    Inputs are `windows[:, :-1]`, labels `windows[:, 1:]`, positions `0, ..., S - 1`;
    with `cp > 1` the three are permuted together along the sequence by
    `equishard.core.zigzag_indices(S, cp)`, so that splitting them evenly over the
    context axis gives device `i` chunks `i` and `2 cp - 1 - i` (every device the same
    causal work; see the "Long sequences" guide). Works on NumPy and JAX arrays alike.

    **Arguments:**

    - `windows`: `int32[B, S + 1]` (e.g. from the data pipeline's `get_batch`).
    - `cp`: the size of the context-parallel axis (`S` a multiple of `2 cp` when > 1).

    **Returns:**

    `{"inputs", "labels", "positions"}`, each `int32[B, S]`.
    """
    xp = np if isinstance(windows, np.ndarray) else jnp
    inputs, labels = windows[:, :-1], windows[:, 1:]
    positions = xp.broadcast_to(xp.arange(inputs.shape[1], dtype=xp.int32), inputs.shape)
    out = {"inputs": inputs, "labels": labels, "positions": positions}
    if cp > 1:
        order = zigzag_indices(inputs.shape[1], cp)
        out = {k: v[:, order] for k, v in out.items()}
    return out


def count_parameters(model: Any) -> int:
    """The number of parameters (array elements) of `model`."""
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with every floating array cast to `dtype` (for mixed-precision compute)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


def canonical_path(path: str) -> str:
    """A parameter path with the layout's wrappers taken out.

    The same parameter is `model.units.module.blocks[0]...` under FSDP (the `FSDP`
    wrapper), `model.units.layers.unit.blocks[0]...` in a pipeline and
    `model.units.blocks[0]...` otherwise (a pipeline of FSDP units nests both:
    `model.units.layers.unit.module.blocks[0]...`); checkpoints store it under the last,
    so that a run saved under one layout restores under another.
    """
    # The pipeline's level first: what it leaves of a pipeline of FSDP units is `.units.module.`.
    return path.replace(".units.layers.unit.", ".units.").replace(".units.module.", ".units.")


def _canonical_units(model: GPT) -> Any:
    """The model's units as one unboxed stack `[num_units, ...]` in model order.

    A pipeline's stack is its own arrays (stored stage by stage: model order unless the
    pipeline is circular, whose layers are then reordered, each device keeping its
    share): no copy of every layer on every stage, as stacking the layers one by one
    would make.
    """
    units = model.units
    unwrap = lambda u: es_unbox(u.module if isinstance(u, FSDP) else u)  # noqa: E731
    if not isinstance(units, PipelineModule):
        return unwrap(units)
    stacked = unwrap(es_unbox(units.layers).unit)  # [L, ...] in stored order
    order = pipeline_layer_order(units.num_layers, units.num_stages, units.repeats)
    position = {layer: p for p, layer in enumerate(order)}
    take = np.asarray([position[layer] for layer in range(units.num_layers)])
    if np.array_equal(take, np.arange(units.num_layers)):
        return stacked

    def reorder(a: Any) -> Any:
        if not eqx.is_array(a):
            return a
        if isinstance(a, jax.Array) and not isinstance(a, Tracer):
            # Each device keeps its share of the stack (eager indexing would replicate it).
            return jax.jit(lambda x: x[take], out_shardings=a.sharding)(a)
        return a[take]

    return jax.tree.map(reorder, stacked)


def to_single_device(model: GPT) -> GPT:
    """The same network as a one-device `GPT` (no FSDP wrappers, no pipeline stages).

    Call it outside `shard_map` on a model whose arrays are global (e.g. `gather(model)`):
    the units are brought to the scan layout of `Parallelism()` and the boxes' specs
    to replicated. The result runs in the global view on one device, and is what
    `export_model` writes for use without equishard's parallel machinery.

    **Arguments:**

    - `model`: a `GPT` built under any layout.

    **Returns:**

    A `GPT` with `Parallelism()` and the same parameter values; its config's
    `batch_chunks` is 1 (it runs a batch of any size, one example too).
    """
    config = dataclasses.replace(model.config, batch_chunks=1)
    lora = lora_of(model)
    template = eqx.filter_eval_shape(lambda: GPT(config, Parallelism(), key=jax.random.key(0), lora=lora))
    leaves = [
        *jax.tree.leaves(es_unbox(model.embed)),
        *jax.tree.leaves(_canonical_units(model)),
        *jax.tree.leaves(es_unbox(model.norm)),
        *jax.tree.leaves(es_unbox(model.head)),
    ]
    shapes, treedef = jax.tree.flatten(template)  # every leaf is an array's shape
    if [s.shape for s in shapes] != [x.shape for x in leaves]:
        raise LayerConfigError("to_single_device: the model's parameters do not match its config.")
    return jax.tree.unflatten(treedef, leaves)
