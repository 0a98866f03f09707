"""`sync_gradients`: the gradient reduction of xLSTM-JAX's local-loss convention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from .._axes import invariant_along, vma_checked
from .._errors import ConventionError
from ._box import is_sharded
from ._specs import is_array_like, path_str, spec_axes


def sync_gradients(grads: PyTree, axis_names: str | Sequence[str]) -> PyTree:
    """Average gradients over the axes their parameters are replicated on.

    For xLSTM-JAX's *local-loss* convention, inside `shard_map`: each device
    differentiated its own local loss, so a parameter replicated over an axis has a
    different gradient on each device of it, and the mean over the axis is the gradient
    of the mean loss. A parameter partitioned over an axis is left alone there (its
    all-gather, `gather_array_with_mean_grads`, already averaged it). Under equishard's
    own convention — differentiating the global loss with the varying-axes check on —
    gradients need no synchronisation.

    With the varying-axes check on, a gradient typed *varying* along an axis (each
    device its own, as in the reference) is averaged as the reference does. One typed
    *invariant* along an axis it must be averaged over is refused: JAX's transposes
    have already summed the devices' gradients if the loss differs between them, or
    they were equal if not, and the reference's mean cannot be told from here. Cast
    the parameters to vary along those axes before differentiating
    (`jax.lax.pcast(params, axes, to="varying")`), or run `check_vma=False` as the
    reference does.

    Call inside `shard_map`. One call serves every axis, e.g. a (dp=2, fsdp=2, tp=2)
    mesh: `sync_gradients(grads, ("dp", "fsdp", "tp"))`.

    **Arguments:**

    - `grads`: the gradients, with the boxes (specs) of the parameters.
    - `axis_names`: the mesh axes to synchronise over.

    **Returns:**

    `grads` with each array averaged over the axes of `axis_names` its spec does not
    name.

    **Raises:**

    `ConventionError` naming the gradient's path and the axis, if with the varying-axes
    check on a gradient to average is invariant along that axis.
    """
    axes = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    checked = bool(axes) and vma_checked(axes)

    def sync(path: Any, leaf: Any) -> Any:
        boxed = is_sharded(leaf)
        value = leaf.value if boxed else leaf
        if not is_array_like(value):
            return leaf
        split = set(spec_axes(leaf.spec)) if boxed else set()
        replicated = tuple(a for a in axes if a not in split)
        if checked:
            _check_varying(path_str(path), value, replicated)
        if replicated:
            value = jax.lax.pmean(value, replicated)
        return leaf.with_value(value) if boxed else value

    return jax.tree_util.tree_map_with_path(sync, grads, is_leaf=is_sharded)


def _check_varying(path: str, value: Any, replicated: tuple[str, ...]) -> None:
    """Refuse a gradient typed invariant along an axis it is to be averaged over."""
    names = invariant_along(value, replicated)
    if names is None:
        return
    raise ConventionError(
        f"sync_gradients: the gradient `{path or '<root>'}` (shape {tuple(value.shape)}) is "
        f"invariant along {names!r} under the varying-axes check, so there is no per-device "
        f"gradient to average as the reference (xLSTM-JAX's local-loss convention) does: "
        f"JAX's transposes already summed the devices' gradients over {names!r} if the "
        f"differentiated loss differs between them, or they were equal if it does not, and "
        f"the reference's mean cannot be told from here. Cast the parameters to vary along "
        f"{names!r} before differentiating (jax.lax.pcast(params, {names!r}, "
        f"to='varying')), run shard_map with check_vma=False as the reference does, or use "
        f"equishard's convention (differentiate the pmean-ed loss; no sync needed). See "
        f"the guide 'Coming from xLSTM-JAX or PyTorch'."
    )
