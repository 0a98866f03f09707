"""The loss function's contract: one adapter calls it and normalises what it returns.

A loss function is written `loss_fn(model, batch, key) -> (loss, metrics)`, or with the
keyword `index` (the global indices of its examples). `LossAdapter` is the one place
that knows these forms: it calls the function the way it is written, hands it the
key its form expects, and checks what comes back (a floating scalar and a dict) before
JAX differentiates it, naming what was expected and what was given. A model state
(`eqx.nn.State`) travels through it beside the model: returned unchanged today, the
place of a stateful form.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._errors import LayerConfigError, TrainStepError
from ..core import global_index
from ..sharding._internal import is_spec

LossFn = Callable[..., tuple[Array, dict[str, Array]]]

_CONTRACT = (
    "loss_fn(model, batch, key) must return (loss, metrics): loss the global mean "
    "loss, a floating scalar (shape ()), and metrics a dict of global scalars (empty if "
    "there are none)"
)


def describe(x: Any) -> str:
    """A value as a message names it: `float32[4, 2]`, `a tuple of 3`, `a list`, ..."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe(v) for v in x)
        return f"a {type(x).__name__} of {len(x)} ({inner})"
    if isinstance(x, (bool, int, float, complex)):
        return f"a Python {type(x).__name__} ({x!r})"
    return f"a {type(x).__name__}"


def check_loss_output(out: Any) -> tuple[Any, dict[str, Any]]:
    """`(loss, metrics)` from what a loss function returned, or a `TrainStepError`.

    Refuses a bare loss (no metrics), a tuple of another length, metrics that are not a
    dict, and a loss that is not a floating scalar, each naming what it was given.
    """
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TrainStepError(f"make_train_step: {_CONTRACT}; it returned {describe(out)}.")
    loss, metrics = out
    if not isinstance(metrics, dict):
        raise TrainStepError(
            f"make_train_step: {_CONTRACT}; its metrics are {describe(metrics)}, not a dict."
        )
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != ():
        raise TrainStepError(
            f"make_train_step: {_CONTRACT}; its loss has shape {shape} ({describe(loss)}): "
            f"reduce it to the global mean (e.g. `jax.lax.pmean(jnp.mean(losses), data_axes)`)."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TrainStepError(
            f"make_train_step: {_CONTRACT}; its loss is {describe(loss)}, of dtype "
            f"{jnp.dtype(dtype).name}, not floating: an integer loss has no gradient. Compute "
            f"it in floating point (e.g. `count.astype(jnp.float32)`)."
        )
    return loss, metrics


def takes_index(loss_fn: Callable) -> bool:
    """Whether `loss_fn` accepts the keyword `index` (the global example indices)."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return False
    param = params.get("index")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return param is not None and param.kind in kinds


def batch_axis(batch_spec: P | PyTree) -> str | tuple[str, ...] | None:
    """The mesh axes the batch's leading dimension is split over (one for every array)."""
    entries = {
        (tuple(spec)[0] if len(spec) else None)
        for spec in jax.tree.leaves(batch_spec, is_leaf=is_spec)
    }
    if len(entries) > 1:
        raise LayerConfigError(
            f"make_train_step: a loss function that takes `index` needs every array of the "
            f"batch split the same way along its first dimension; batch_spec splits them "
            f"over {sorted(map(str, entries))}."
        )
    return entries.pop() if entries else None


class LossAdapter:
    """Calls a loss function in the form it is written; checks what it returns.

    **Arguments:**

    - `loss_fn`: the user's loss function.
    - `batch_spec`: the batch's spec (for the axes of `index` in the local view).
    """

    def __init__(self, loss_fn: LossFn, batch_spec: P | PyTree):
        self.loss_fn = loss_fn
        self.with_index = takes_index(loss_fn)
        self.batch_axis = batch_axis(batch_spec) if self.with_index else None

    def local_index(self, size: int) -> Array | None:
        """Inside `shard_map`: `int32[B/data]`, where this device's examples sit in the
        global batch (`None` for a loss function without `index`)."""
        return global_index(size, self.batch_axis) if self.with_index else None

    def micro_key(self, key: PRNGKeyArray, i: Any) -> PRNGKeyArray:
        """The key of micro-step `i`: per-example keys come from `index`; the plain form
        gets the step's key folded with the micro-step."""
        return key if self.with_index else jax.random.fold_in(key, i)

    def __call__(
        self, model: PyTree, batch: PyTree, key: PRNGKeyArray, index: Any, model_state: Any = None
    ) -> tuple[Array, tuple[dict[str, Any], Any]]:
        """`(loss, (metrics, model_state))`: the shape `value_and_grad(has_aux=True)` takes."""
        if self.with_index:
            out = self.loss_fn(model, batch, key, index=index)
        else:
            out = self.loss_fn(model, batch, key)
        loss, metrics = check_loss_output(out)
        return loss, (metrics, model_state)
