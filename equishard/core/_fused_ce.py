"""A fused linear cross-entropy: from hidden states and the output weight to the loss, in
chunks of tokens, never forming the `[tokens, vocabulary]` logits whole.

The logits of one chunk of tokens are formed (in the inputs' dtype), their softmax
statistics taken in float32 (over a tensor axis when the vocabulary is split over it),
and, when the loss is differentiated, the gradients of the hidden states and of the
weight are produced in the same pass over the chunk (a `jax.custom_vjp` whose forward
rule computes the loss and the gradients for a unit cotangent, as Liger Kernel's fused
linear cross-entropy does; the backward rule only scales them). The program holds one
chunk's logits at a time: `chunk × V/n` elements.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._axes import (
    AxisName,
    axis_tuple,
    cast_varying,
    combined_axis_size,
    is_bound,
    varying_axes,
    vma_checked,
)
from .._errors import LayerConfigError

CHUNK_ELEMENTS = 2**27
"""The default budget of one chunk's logits, in elements (512 MiB in float32): the chunk
holds `CHUNK_ELEMENTS // (V/n)` tokens rounded down to a power of two (at least 8), so
that it divides the usual token counts. On an H100 the 124 M GPT (V = 50304) ran its bf16
step at 16 x 1024 tokens 1.30x faster with 4096-token chunks than with 256-token ones
(2²⁴'s): every chunk reads and writes the float32 weight gradient once. 2048-token
chunks (this budget's) ran as fast as 4096 (439,990 against 439,122 tokens/s) at a peak
of 6.7 GiB against 7.1 (`benchmarks/RESULTS.md`), and no chunk is then larger than an
eighth of the logits at 16 x 1024."""


class CrossEntropySums(NamedTuple):
    """The sums a fused cross-entropy returns over this device's tokens (see
    `fused_linear_cross_entropy`): divide `loss` by `tokens` for the mean.

    - `loss`: the training objective summed over the tokens not ignored (cross-entropy,
      with label smoothing and the z-loss when asked); the only differentiable field.
    - `cross_entropy`: the plain cross-entropy summed over the same tokens (a metric).
    - `tokens`: how many tokens are not ignored (`int32`).
    - `correct`: how many of them have their label as the logits' argmax (`int32`).
    """

    loss: Float[Array, ""]
    cross_entropy: Float[Array, ""]
    tokens: Int[Array, ""]
    correct: Int[Array, ""]


class _Options(NamedTuple):
    """The static options of one call (hashable: a `custom_vjp` non-differentiable argument)."""

    axes: tuple[str, ...]  # the bound vocabulary axes, () for none
    chunk: int
    vocab: int  # the global vocabulary
    real: int  # the ids below it are real; the weight's rows from it on are padding
    ignore_index: int | None
    z_loss: float
    smoothing: float
    softcap: float | None
    weight_dtype: Any  # the weight's gradient leaves in it (accumulated in float32)


def default_chunk_size(vocab_local: int) -> int:
    """The tokens of a chunk whose logits `[chunk, vocab_local]` hold about `CHUNK_ELEMENTS`."""
    size = CHUNK_ELEMENTS // max(vocab_local, 1)
    return max(8, 1 << (size.bit_length() - 1)) if size else 8


def _reduce(x: Array, op: str, opts: _Options) -> Array:
    """`x` reduced over the vocabulary axes (`op`: "sum", "max" or "min"), or `x` itself."""
    if not opts.axes:
        return x
    return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op](x, opts.axes)


def _chunk(h: Array, w: Array, labels: Array, valid: Array, start: Array, opts: _Options):
    """One chunk's logits and per-token results (all float32).

    `h`: `[C, D]`, `w`: `[V/n, D]`, `labels`/`valid`: `[C]`, `start`: the first vocabulary
    id this device holds. Returns `(z, lse, loss, ce, correct, mine, index)`: `z` the
    (capped) logits `f32[C, V/n]`, the per-token `[C]` results, and where the label is
    among this device's rows (`mine`, `index` `[C, 1]`).
    """
    vocab_local = w.shape[0]
    # bf16[C, D] @ bf16[D, V/n] -> bf16[C, V/n] (the inputs' dtype), then float32
    z = jnp.tensordot(h, w, axes=((1,), (1,))).astype(jnp.float32)
    if opts.softcap is not None:
        z = opts.softcap * jnp.tanh(z / opts.softcap)
    if opts.real < opts.vocab:
        # Padding ids: -inf, outside the maximum, the exponentials' sum and the argmax.
        z = jnp.where(_real_ids(vocab_local, start, opts), z, -jnp.inf)
    local_max = jnp.max(z, axis=-1)
    m = _reduce(local_max, "max", opts)  # f32[C]: the global maximum
    # The exponentials are summed where they are made (never stored: the gradient makes
    # the softmax again from `z` and `lse`).
    s = _reduce(jnp.sum(jnp.exp(z - m[:, None]), axis=-1), "sum", opts)
    lse = m + jnp.log(s)  # f32[C]
    local = labels - start
    mine = (local >= 0) & (local < vocab_local)
    index = jnp.clip(local, 0, vocab_local - 1)[:, None]
    picked = jnp.take_along_axis(z, index, axis=-1, mode="promise_in_bounds")[:, 0]
    target = _reduce(jnp.where(mine, picked, 0.0), "sum", opts)
    ce = lse - target
    loss = ce
    if opts.smoothing:
        real_z = z if opts.real == opts.vocab else jnp.where(_real_ids(vocab_local, start, opts), z, 0.0)
        mean_z = _reduce(jnp.sum(real_z, axis=-1), "sum", opts) / opts.real
        loss = (1.0 - opts.smoothing) * ce + opts.smoothing * (lse - mean_z)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse**2
    # The argmax (the first index of the maximum), over the axis: the smallest global id
    # holding the global maximum.
    first = jnp.argmax(z, axis=-1).astype(jnp.int32) + start
    candidate = jnp.where(local_max == m, first, jnp.int32(opts.vocab))
    correct = _reduce(candidate, "min", opts) == labels
    zero = jnp.zeros((), jnp.float32)
    loss, ce = jnp.where(valid, loss, zero), jnp.where(valid, ce, zero)
    return z, lse, loss, ce, correct & valid, mine, index


def _real_ids(vocab_local: int, start: Array, opts: _Options) -> Array:
    """`bool[1, V/n]`: which of this device's vocabulary rows are real ids (not padding)."""
    return (start + jnp.arange(vocab_local, dtype=jnp.int32))[None, :] < opts.real


def _grad_logits(z, lse, valid, mine, index, start, opts: _Options) -> Array:
    """The gradient of a chunk's summed loss with respect to its raw logits, `f32[C, V/n]`.

    The softmax is `exp(z - lse)`, made here in the same pass as the gradient: one
    `f32[C, V/n]` array (the logits) per chunk, not a second one of exponentials.
    """
    scale = 1.0 + 2.0 * opts.z_loss * lse if opts.z_loss else jnp.ones_like(lse)
    g = jnp.exp(z - lse[:, None]) * scale[:, None]
    if opts.smoothing:
        g = g - opts.smoothing / opts.real
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32)[None, :] == index
    g = g - jnp.where(onehot & mine[:, None], 1.0 - opts.smoothing, 0.0)
    if opts.softcap is not None:
        # d/dx c tanh(x / c) = 1 - tanh² = 1 - (z / c)²
        g = g * (1.0 - (z / opts.softcap) ** 2)
    keep = valid[:, None]
    if opts.real < opts.vocab:
        keep = keep & _real_ids(z.shape[-1], start, opts)  # the padding ids: no gradient
    return jnp.where(keep, g, 0.0)


def _scan(h: Array, w: Array, labels: Array, valid: Array, opts: _Options, grads: bool) -> Any:
    """Run the chunks; sums, and with `grads` `dh` `[n, C, D]` and `dw` `f32[V/n, D]`."""
    start = jax.lax.axis_index(opts.axes) * w.shape[0] if opts.axes else jnp.int32(0)

    def body(dw: Any, xs: tuple[Array, Array, Array]) -> tuple[Any, Any]:
        h_c, labels_c, valid_c = xs
        z, lse, loss, ce, correct, mine, index = _chunk(h_c, w, labels_c, valid_c, start, opts)
        # A label outside the (global) vocabulary, unless ignored, makes the loss and its
        # gradients NaN: such a batch is never trained on (the step skips it), never
        # scored as if its target logit were 0. Labels are global ids: no collective.
        outside = valid_c & ((labels_c < 0) | (labels_c >= opts.real))  # bool[C]
        loss, ce = (jnp.where(outside, jnp.nan, x) for x in (loss, ce))
        sums = (jnp.sum(loss), jnp.sum(ce), jnp.sum(correct.astype(jnp.int32)))
        if not grads:
            return dw, (sums, None)
        g = _grad_logits(z, lse, valid_c, mine, index, start, opts)
        g = jnp.where(outside[:, None], jnp.nan, g).astype(w.dtype)
        # bf16[C, V/n] @ bf16[V/n, D] -> [C, D]: this device's part of the input's gradient
        dh = jnp.dot(g, w, preferred_element_type=jnp.float32).astype(h.dtype)
        # bf16[V/n, C] @ bf16[C, D] -> f32[V/n, D], accumulated over the chunks
        dw = dw + jnp.tensordot(g, h_c, axes=((0,), (0,)), preferred_element_type=jnp.float32)
        return dw, (sums, dh)

    init = None
    if grads:
        init = cast_varying(jnp.zeros(w.shape, jnp.float32), varying_axes(w))
    dw, (sums, dh) = jax.lax.scan(body, init, (h, labels, valid))
    loss, ce, correct = (jnp.sum(s) for s in sums)
    return (loss, ce, correct), dh, dw


def _split(h: Array, labels: Array, opts: _Options) -> tuple[Array, Array, Array]:
    """`h` `[N, D]` and `labels` `[N]` padded to whole chunks: `[n, C, D]`, `[n, C]`, valid."""
    n = h.shape[0]
    chunks = -(-n // opts.chunk)
    pad = chunks * opts.chunk - n
    valid = jnp.arange(chunks * opts.chunk) < n
    if pad:
        h, labels = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(labels, (0, pad))
    if opts.ignore_index is not None:
        valid = valid & (labels != opts.ignore_index)
    shape = (chunks, opts.chunk)
    return h.reshape(*shape, h.shape[1]), labels.reshape(shape), valid.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(h: Array, w: Array, labels: Array, opts: _Options):
    hs, ls, valid = _split(h, labels, opts)
    (loss, ce, correct), _, _ = _scan(hs, w, ls, valid, opts, grads=False)
    return loss, ce, correct


def _fused_fwd(h: Array, w: Array, labels: Array, opts: _Options):
    hs, ls, valid = _split(h, labels, opts)
    (loss, ce, correct), dh, dw = _scan(hs, w, ls, valid, opts, grads=True)
    dh = dh.reshape(-1, h.shape[1])[: h.shape[0]]
    return (loss, ce, correct), (dh, dw)


def _fused_bwd(opts: _Options, res: tuple[Array, Array], ct: tuple[Array, Array, Any]):  # ct[2]: float0 (an int output)
    dh, dw = res
    g = ct[0]
    return (g * dh).astype(dh.dtype), (g * dw).astype(opts.weight_dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_linear_cross_entropy(
    hidden: Float[Array, "*batch dim"],
    weight: Float[Array, "vocab_local dim"],
    labels: Int[Array, "*batch"],
    axis_name: AxisName | None = None,
    *,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
) -> CrossEntropySums:
    """The cross-entropy of the logits `hidden @ weight.T`, chunk by chunk over the tokens.

    No `[tokens, V]` array is formed, in any dtype: each chunk's logits
    `[chunk_size, V/n]` are formed in the inputs' dtype, their maximum and
    log-sum-exp taken in float32, and, when differentiated, the gradients of `hidden`
    and `weight` accumulated chunk by chunk in the same pass (the backward pass only
    scales them). Values and gradients equal those of the plain cross-entropy of the
    full logits.

    Inside a `shard_map` over `axis_name`, device `r` holds the vocabulary rows
    `[r V/n, (r+1) V/n)` of the weight (a vocabulary-parallel head or tied embedding);
    the maximum, the sum of exponentials, the target logit and the argmax are reduced
    over the axis, one number per token. `hidden` is replicated over the axis, or typed
    as varying over it (after `gather_tokens`, for sequence parallelism): its gradient
    is this device's part, which the varying-axes check sums (or reduce-scatters) as
    for any replicated input. Outside any `shard_map` it is the plain cross-entropy.

    **Arguments:**

    - `hidden`: the final hidden states `[..., D]` (local tokens, all of them on every
      device of `axis_name`).
    - `weight`: the output weight `[V/n, D]` (this device's rows; `[V, D]` unsplit).
    - `labels`: the target ids `[...]` (global ids), replicated over the axis.
    - `axis_name`: the mesh axis (or axes) the vocabulary is split over, or `None`.
    - `chunk_size`: tokens per chunk (default: at most 2²⁷ logits per chunk, see
      `CHUNK_ELEMENTS`; at most the number of tokens); the last chunk is padded.
    - `ignore_index`: a label whose tokens count for nothing (no loss, no gradient, not
      in `tokens`).
    - `z_loss`: the coefficient of the z-loss `log(Z)²` added per token (PaLM's).
    - `label_smoothing`: `ε`: the target is `(1 − ε)` on the label and `ε / V` on every
      entry (optax's and PyTorch's smoothing).
    - `softcap`: cap the logits as `softcap · tanh(logits / softcap)` (Gemma 2's) first.
    - `vocab_size`: the real vocabulary, when the weight's rows are padded beyond it (to
      divide the axis): the ids from `vocab_size` on count for nothing (not in the
      log-sum-exp, the argmax or the smoothing; no gradient), and a label among them is
      out of range. Default: every row is an id.

    **Returns:**

    A `CrossEntropySums` of this device's tokens (the same on every device of
    `axis_name`): `loss.loss / loss.tokens` is the mean. Only `loss` is differentiable.
    """
    if hidden.shape[:-1] != labels.shape or weight.shape[-1] != hidden.shape[-1]:
        raise LayerConfigError(
            f"fused_linear_cross_entropy: hidden {hidden.shape}, weight {weight.shape} and "
            f"labels {labels.shape} do not fit (hidden [..., D], weight [V/n, D], labels [...])."
        )
    check_loss_options(labels, chunk_size, ignore_index, z_loss, label_smoothing, softcap)
    axes = axis_tuple(axis_name) if axis_name is not None and is_bound(axis_name) else ()
    n = combined_axis_size(axes) if axes else 1
    vocab = weight.shape[0] * n
    if vocab_size is not None and not (isinstance(vocab_size, (int, np.integer)) and 0 < vocab_size <= vocab):
        raise LayerConfigError(
            f"fused_linear_cross_entropy: vocab_size={vocab_size!r} must be a number of ids from 1 to "
            f"the weight's {vocab} rows."
        )
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    # No chunk larger than the tokens (nor padded beyond them).
    chunk = max(min(chunk_size or default_chunk_size(weight.shape[0]), h.shape[0]), 1)
    opts = _Options(
        axes, chunk, vocab, vocab if vocab_size is None else int(vocab_size),
        ignore_index, float(z_loss), float(label_smoothing), softcap, jnp.dtype(weight.dtype),
    )  # fmt: skip
    # Everything varies alike inside the rule: the casts' transposes sum the gradients
    # of a replicated `hidden` over the vocabulary axis (and of `weight` over the data
    # axes it is replicated on).
    union = varying_axes(h) | varying_axes(weight)
    if axes and vma_checked(axes):
        union = union | set(axes)
    if union:
        h, weight = cast_varying((h, weight), union)
    loss, ce, correct = cast(tuple[Array, Array, Array], _fused(h, weight, labels.reshape(-1), opts))
    tokens = jnp.sum(_valid_labels(labels, ignore_index).astype(jnp.int32))
    return CrossEntropySums(loss, jax.lax.stop_gradient(ce), tokens, correct)


def check_loss_options(
    labels: Any, chunk_size: Any, ignore_index: Any, z_loss: Any, label_smoothing: Any, softcap: Any
) -> None:
    """Refuse the cross-entropy's options out of range, each by name, before JAX sees them.

    **Raises:**

    `LayerConfigError` naming the option, its value and its range.
    """
    def bad(option: str, value: Any, want: str) -> LayerConfigError:
        return LayerConfigError(f"fused_linear_cross_entropy: {option}={value!r} {want}.")

    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise bad("labels of dtype", jnp.dtype(jnp.result_type(labels)).name, "is not an integer dtype: labels are token ids")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))):
        raise bad("chunk_size", chunk_size, "must be a whole number of tokens (or None)")
    if chunk_size is not None and chunk_size < 1:
        raise bad("chunk_size", chunk_size, "must be positive")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer))):
        raise bad("ignore_index", ignore_index, "must be a token id (an int) or None")
    if not (isinstance(z_loss, (int, float, np.number)) and math.isfinite(z_loss) and z_loss >= 0):
        raise bad("z_loss", z_loss, "must be a finite number, 0 or more (a negative z-loss rewards large logits)")
    if not (isinstance(label_smoothing, (int, float, np.number)) and 0 <= label_smoothing <= 1):
        raise bad("label_smoothing", label_smoothing, "must be a number from 0 to 1")
    if softcap is not None and not (isinstance(softcap, (int, float, np.number)) and math.isfinite(softcap) and softcap > 0):
        raise bad("softcap", softcap, "must be a finite number above 0, or None (no cap)")


def _valid_labels(labels: Array, ignore_index: int | None) -> Array:
    return jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
