"""`sync_gradients`: the gradient reduction of xLSTM-JAX's local-loss convention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from .._axes import check_local_loss_convention
from ._box import is_sharded
from ._specs import is_array_like, spec_axes


def sync_gradients(grads: PyTree, axis_names: str | Sequence[str]) -> PyTree:
    """Average gradients over the axes their parameters are replicated on.

    For xLSTM-JAX's *local-loss* convention only, inside
    `shard_map(..., check_vma=False)`: each device differentiated its own local loss, so a parameter replicated over an axis
    has a different gradient on each device of it, and the mean over the axis is the
    gradient of the mean loss. A parameter partitioned over an axis is left alone
    there (its all-gather, `gather_array_with_mean_grads`, already averaged it). Under
    equishard's own convention — differentiating the global loss with the varying-axes
    check on — gradients need no synchronisation, and this function raises
    `ConventionError` there rather than returning gradients `n` times too large.

    Call inside `shard_map`. One call serves every axis, e.g. a (dp=2, fsdp=2, tp=2)
    mesh: `sync_gradients(grads, ("dp", "fsdp", "tp"))`.

    **Arguments:**

    - `grads`: the gradients, with the boxes (specs) of the parameters.
    - `axis_names`: the mesh axes to synchronise over.

    **Returns:**

    `grads` with each array averaged over the axes of `axis_names` its spec does not
    name.

    **Raises:**

    `ConventionError` if called with the varying-axes check on.
    """
    axes = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if axes:
        check_local_loss_convention("sync_gradients", axes)

    def sync(leaf: Any) -> Any:
        boxed = is_sharded(leaf)
        value = leaf.value if boxed else leaf
        if not is_array_like(value):
            return leaf
        split = set(spec_axes(leaf.spec)) if boxed else set()
        replicated = tuple(a for a in axes if a not in split)
        if replicated:
            value = jax.lax.pmean(value, replicated)
        return leaf.with_value(value) if boxed else value

    return jax.tree.map(sync, grads, is_leaf=is_sharded)
