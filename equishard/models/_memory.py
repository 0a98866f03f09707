"""Analytical per-device memory of the reference GPT's train step, by category.

`gpt_memory` derives, from the model's shapes and the layout alone, what one device
holds: the parameters and the optimizer state (by their specs), the gradients (split
like the parameters), and the activations the backward pass needs, which the
rematerialisation policy decides. Formulas (bytes per device; `t` the tokens of one
data shard, `n` the tensor axis, `L` the layers, `x` one residual-stream activation
`[t(/n with sequence parallelism), D]`, `g` a gathered block input `[t, D]` under
sequence parallelism, floats of 4 bytes unless the model's dtype says otherwise):

- **saved per layer** beyond `full` (which keeps each layer's input `x` only):
  `minimal` keeps the fused QKV output `[t, (D + 2 H_kv hd)/n]`, the attention output
  projection `x`, the MLP up projection `[t, 2F/n]` (SwiGLU) and, under sequence
  parallelism, the two gathered block inputs `2 g` (the collectives' outputs, so nothing
  is sent twice); `minimal_with_context` adds the context `[t, D/n]`; `dots` keeps
  the QKV, the output projection before its reduction `[t, D]` and the up projection;
  `none` keeps everything a layer's backward pass reads (`w` below).
- **saved activations** (what the compiler's temporaries under a policy exceed those
  under `full` by): `(L − 1)` layers' saved sets — the layer being differentiated holds
  its set under `full` too, recomputed.
- **working set** of the backward pass: the `L` layer inputs, one layer's full set `w`
  (norm inputs and outputs, QKV, rotary queries and keys, attention scores and
  probabilities `[t, T, H/n]` each — from `BLOCKWISE_THRESHOLD` keys on, and always
  with ring attention, one `DEFAULT_BLOCK_SIZE` square block of them per sequence,
  as the blockwise kernel holds —, context, projections, MLP activations) and the
  logits with their softmax and gradient (`3 [t, V/n]`; with the fused loss,
  `GPTConfig.fused_loss`, those of one chunk of tokens, `3 [min(t, chunk), V/n]`).
- **the update**: the gradients, and the new optimizer state built beside the old one.
  Under ZeRO (`Layout(zero=True)`) the optimizer state (read off its specs) is 1/dp
  per device and so is the new one; the gradients still count whole: each device
  sums its own unreduced gradients through the backward pass and reduce-scatters them
  after it (measured on the 5.25 M-parameter GPT, `dp=8 --zero`: total 70.8 MiB
  estimated, 71.8 MiB compiled).

The temporaries are the gradients plus the larger of the backward pass's activations
and the update's new optimizer state. Under FSDP each unit gathers its parameters
again in the backward pass and recomputes its forward there, keeping only its input
and its other collectives' outputs whatever the policy other than `full` (`full`'s set
plus, with a tensor axis, the reduced outputs `2 x` and under sequence parallelism the
gathers `2 g`), and one unit's parameters are whole at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._names import RING
from ..core import BLOCKWISE_THRESHOLD, DEFAULT_BLOCK_SIZE
from ..core._internal import default_chunk_size
from ..nn import REMAT_POLICIES
from ..report import MemoryEstimate
from ..sharding import Layout, Parallelism, ParamRow
from ..sharding._internal import resolve_layout
from ._gpt import GPTConfig
from ._minimum import _is_unit, _setting

__all__ = ["gpt_memory"]


def _scores(config: GPTConfig, t: float, tp: int, seq_len: int, cp: int, context_impl: str) -> float:
    """Elements of one layer's attention scores `[t, keys, H/n]` that exist at once.

    The whole matrix below `BLOCKWISE_THRESHOLD` keys, where `equishard.core.attention`
    runs the dense kernel (no context axis, or all-to-all, which attends over the whole
    sequence for `H/(n cp)` heads: the same count); one query block by one key block of
    `DEFAULT_BLOCK_SIZE` for each of the device's sequences otherwise, and always for
    ring attention, whose kernel is blockwise.
    """
    heads = config.n_heads / tp
    ring = cp > 1 and context_impl == RING
    if not ring and seq_len < BLOCKWISE_THRESHOLD:
        return t * seq_len * heads
    local = seq_len // cp if ring else seq_len
    block = min(DEFAULT_BLOCK_SIZE, local)
    return t / local * heads * block * block


def _per_layer(config: GPTConfig, t: float, tp: int, sp: bool, scores: float, itemsize: int) -> dict[str, float]:
    """Bytes of one layer's activations, per device (`scores`: see `_scores`)."""
    d, f = config.d_model, config.d_ff
    hd = d // config.n_heads
    kv_heads = config.n_kv_heads or config.n_heads
    kv_local = max(kv_heads // tp, 1)
    x = t * d / (tp if sp else 1)
    g = t * d if sp else 0.0
    qkv = t * (d / tp + 2 * kv_local * hd)
    context = t * d / tp
    mlp_in = t * 2 * f / tp
    rotary = t * (d / tp + kv_local * hd)
    everything = (
        4 * x + 2 * g + qkv + rotary + 2 * scores + context + x + mlp_in + t * 2 * f / tp + x
    )
    values = {
        "x": x,
        "full": 0.0,
        "minimal": qkv + x + mlp_in + 2 * g,
        "minimal_with_context": qkv + x + mlp_in + 2 * g + context,
        "dots": qkv + t * d + mlp_in,
        "none": everything,
        "fsdp": (2 * x if tp > 1 else 0.0) + 2 * g,
    }
    return {k: v * itemsize for k, v in values.items()}


def gpt_memory(
    config: GPTConfig,
    layout: Layout | Parallelism,
    *,
    batch_size: int,
    seq_len: int,
    params: Sequence[ParamRow],
    optimizer_state: Sequence[ParamRow],
    num_devices: int | None = None,
    other_arguments: int = 0,
) -> MemoryEstimate:
    """The analytical per-device memory of the reference GPT's train step.

    See the module's documentation for every formula; `equishard inspect` prints it
    beside the compiler's figure (see the "Inspect and plan" guide).

    **Arguments:**

    - `config`, `layout`: the model (its `remat` is the policy the step runs with) and
      the `Layout` (or one already resolved).
    - `batch_size`, `seq_len`: the global batch in sequences and their length.
    - `params`, `optimizer_state`: the per-array tables (`equishard.sharding.param_table`)
      of the model and of the optimizer state.
    - `num_devices`: the devices (default: the layout's own size).
    - `other_arguments`: bytes of the step's other arguments (batch shard, counters).

    **Returns:**

    A `MemoryEstimate`.
    """
    layout = resolve_layout(layout, num_devices).conventional()  # read in the conventional axis names
    s = _setting(config, layout, batch_size, seq_len)
    itemsize = params[0].total_bytes // max(math.prod(params[0].shape), 1) if params else 4
    t = s.tokens / s.microbatches
    scores = _scores(config, t, s.tp, seq_len, s.cp, s.context_impl)
    layer = _per_layer(config, t, s.tp, s.sequence_parallel, scores, itemsize)
    layers = config.n_layers // max(s.stages, 1)
    fsdp = s.sizes.get("fsdp", 1) > 1
    parameters = sum(r.bytes_per_device for r in params)
    saved = {
        name: int((layers - 1) * (layer["fsdp"] if fsdp and name != "full" else layer[name]))
        for name in REMAT_POLICIES
    }
    vocab_local = config.vocab_size // s.tp
    # The fused loss holds one chunk's logits, softmax and gradient at a time.
    chunk = config.loss_chunk_size or default_chunk_size(vocab_local)
    logits = 3 * (min(t, chunk) if config.fused_loss else t) * vocab_local * 4
    working = layers * layer["x"] + layer["none"] + logits
    if fsdp:  # one unit's parameters whole
        unit = sum(r.bytes_per_device for r in params if _is_unit(r.path)) / max(layers, 1)
        working += unit * s.sizes["fsdp"]
    return MemoryEstimate(
        parameters=parameters,
        optimizer_state=sum(r.bytes_per_device for r in optimizer_state),
        gradients=parameters,
        remat=config.remat,
        saved_activations=saved,
        working_set=int(working),
        update=sum(r.bytes_per_device for r in optimizer_state),
        other_arguments=other_arguments,
    )
