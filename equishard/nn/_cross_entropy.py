"""Cross-entropy of logits split over the vocabulary, without gathering them, and the
fused linear cross-entropy from hidden states (no `[tokens, V]` array at all)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._axes import AxisName, axis_tuple, is_bound
from .._errors import LayerConfigError
from ..core import CrossEntropySums, fused_linear_cross_entropy, mp_reduce
from ..sharding import filter_shard_map
from ._initializers import value_of


def vocab_parallel_cross_entropy(
    logits_local: Float[Array, "*batch vocab_local"],
    labels: Int[Array, "*batch"],
    axis_name: str,
    ignore_index: int | None = None,
) -> Float[Array, "*batch"]:
    """Per-token cross-entropy when the logits are split over the vocabulary.

    Device `r` of `axis_name` holds vocabulary entries `[r V/n, (r+1) V/n)`. The full
    logits are never formed: the maximum, the sum of exponentials and the target logit
    are each reduced over the axis as one number per token, so the program holds
    no array with the full vocabulary dimension. The gradient equals that of the
    unsharded cross-entropy. Outside any `shard_map` (the axis not bound) this is the
    plain cross-entropy of `logits_local`.

    **Arguments:**

    - `logits_local`: this device's logits `[..., V/n]` (the output of a
      `ColumnParallelLinear(gather_output=False)` head, for instance).
    - `labels`: the global target ids `[...]`, replicated over the axis.
    - `axis_name`: the mesh axis the vocabulary is split over.
    - `ignore_index`: a label whose tokens get loss 0 (and no gradient).

    **Returns:**

    The losses `[...]` (`logsumexp(logits) - logits[label]`), replicated over the
    axis. Average them (over the tokens that are not ignored) for the mean loss.
    """
    bound = is_bound(axis_name)
    vocab_local = logits_local.shape[-1]
    start = jax.lax.axis_index(axis_name) * vocab_local if bound else 0
    # The shift only stabilises exp; it carries no gradient (the terms cancel).
    shift = jax.lax.stop_gradient(jnp.max(logits_local, axis=-1))
    if bound:
        # f32[...] -> f32[...]: the global maximum
        shift = jax.lax.pmax(shift, axis_name)
    shifted = logits_local - jax.lax.stop_gradient(shift)[..., None]
    # f32[..., V/n] -> f32[...] (local) -> f32[...] (global)
    sum_exp = jnp.sum(jnp.exp(shifted), axis=-1)
    local = labels - start
    mine = (local >= 0) & (local < vocab_local)
    # The clipped index is in bounds: promised so, the gather needs no mask of its own.
    index = jnp.clip(local, 0, vocab_local - 1)[..., None]
    picked = jnp.take_along_axis(shifted, index, axis=-1, mode="promise_in_bounds")[..., 0]
    # The target logit, on the device that holds it; zero elsewhere.
    target = jnp.where(mine, picked, jnp.zeros((), picked.dtype))
    if bound:
        sum_exp = mp_reduce(sum_exp, axis_name=axis_name)
        target = mp_reduce(target, axis_name=axis_name)
    loss = jnp.log(sum_exp) - target
    # A label outside the global vocabulary (its ids are global: no collective) gives a
    # NaN loss, never a loss scored as if its target logit were 0; ignored labels are exempt.
    vocab = vocab_local * (jax.lax.axis_size(axis_name) if bound else 1)
    loss = jnp.where((labels < 0) | (labels >= vocab), jnp.nan, loss)
    if ignore_index is not None:
        loss = jnp.where(labels == ignore_index, jnp.zeros((), loss.dtype), loss)
    return loss


def fused_cross_entropy(
    hidden: Float[Array, "*batch dim"],
    weight: Any,
    labels: Int[Array, "*batch"],
    axis_name: AxisName | None = "tp",
    *,
    mesh: jax.sharding.Mesh | None = None,
    batch_axes: AxisName | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
) -> CrossEntropySums:
    """The loss of a language model's head, from its hidden states, in chunks of tokens.

    `fused_linear_cross_entropy` for a model's output weight (an untied head's
    `ColumnParallelLinear.weight`, or a tied `ParallelEmbedding.weight`, split over the
    vocabulary on `axis_name`): the `[tokens, V]` logits, their softmax and their
    gradient are never formed whole, in any dtype, on any layout; values and gradients
    are those of the plain cross-entropy. See the "Your own model" guide.

    In the local view (inside `filter_shard_map`, `mesh=None`) it works on this
    device's tokens and vocabulary rows. In the global view (a plain `jax.jit` program,
    `mesh` given) it wraps its own `shard_map`: `hidden` and `labels` are split over
    `batch_axes` along their first dimension and the weight over `axis_name` along the
    vocabulary, so the compiler never gathers the vocabulary; the sums come back over
    the whole batch.

    **Arguments:**

    - `hidden`: the final hidden states `[..., D]` (after the final norm).
    - `weight`: the output weight `[V/n, D]` (a `Sharded` box or an array; a strided
      column-parallel weight `[V/n/s, s, D]` is read as its rows).
    - `labels`: the target ids `[...]`.
    - `axis_name`: the mesh axis the vocabulary is split over (ignored where it is not
      bound), or `None`.
    - `mesh`: the mesh, for the global view only.
    - `batch_axes`: the global view's axes `hidden`'s first dimension is split over
      (default: every mesh axis but `axis_name`).
    - `chunk_size`, `ignore_index`, `z_loss`, `label_smoothing`, `softcap`,
      `vocab_size` (a padded vocabulary's real size): see
      `equishard.core.fused_linear_cross_entropy`.

    **Returns:**

    A `CrossEntropySums` (`loss`, `cross_entropy`, `tokens`, `correct`): sums over the
    local tokens (global view: over the batch). For the mean of the global batch in the
    local view, `psum` `loss` and `tokens` over the data axes and divide; with the same
    number of tokens on every device (no `ignore_index`), `pmean` `loss / tokens`.
    """
    def local(hidden: Array, weight: Any, labels: Array) -> CrossEntropySums:
        w = value_of(weight)
        w = jnp.reshape(w, (-1, w.shape[-1]))  # [V/n, D]
        return fused_linear_cross_entropy(
            hidden, w, labels, axis_name, chunk_size=chunk_size, ignore_index=ignore_index,
            z_loss=z_loss, label_smoothing=label_smoothing, softcap=softcap, vocab_size=vocab_size,
        )  # fmt: skip

    if mesh is None:
        return local(hidden, weight, labels)
    return _global(local, hidden, value_of(weight), labels, mesh, axis_name, batch_axes)


def _global(
    local: Any, hidden: Array, weight: Array, labels: Array, mesh: Any,
    axis_name: AxisName | None, batch_axes: AxisName | None,
) -> CrossEntropySums:  # fmt: skip
    """`local` under a `shard_map` of its own: tokens over `batch_axes`, vocabulary over `axis_name`."""
    vocab = axis_tuple(axis_name) if axis_name is not None else ()
    missing = [a for a in vocab if a not in mesh.axis_names]
    if missing:
        raise LayerConfigError(
            f"fused_cross_entropy: axis_name={axis_name!r} is not an axis of the mesh "
            f"{dict(mesh.shape)}."
        )
    if batch_axes is None:
        batch = tuple(a for a in mesh.axis_names if a not in vocab)
    else:
        batch = axis_tuple(batch_axes)
    # Size-1 entries are dropped: an empty tuple entry is not a spec.
    batch_entry = batch if batch else None
    vocab_entry = vocab if vocab else None

    def body(hidden: Array, weight: Array, labels: Array) -> CrossEntropySums:
        sums = local(hidden, weight, labels)
        return jax.tree.map(lambda x: jax.lax.psum(x, batch), sums) if batch else sums

    mapped = filter_shard_map(
        body, mesh=mesh, in_specs=(P(batch_entry), P(vocab_entry, None), P(batch_entry)),
        out_specs=P(),
    )  # fmt: skip
    return mapped(hidden, jnp.reshape(weight, (-1, weight.shape[-1])), labels)
