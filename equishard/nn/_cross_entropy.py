"""Cross-entropy of logits split over the vocabulary, without gathering them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._axes import is_bound
from ..core import mp_reduce


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
    if ignore_index is not None:
        loss = jnp.where(labels == ignore_index, jnp.zeros((), loss.dtype), loss)
    return loss
