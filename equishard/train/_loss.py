"""The loss function's contract: one adapter calls it and normalises what it returns.

A loss function is written `loss_fn(model, batch, key) -> (loss, metrics)`, or with the
keyword `index` (the global indices of its examples). A model with a state
(`eqx.nn.State`, e.g. batch norms' running statistics) has the stateful form
`loss_fn(model, state, batch, key) -> (loss, (metrics, new_state))`, `index` again
optional. `LossAdapter` is the one place that knows these forms: it calls the function
the way it is written, hands it the key its form expects, and checks what comes back (a
floating scalar, a dict of scalars, a state like the one given) before JAX
differentiates it, naming what was expected and what was given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import cast_varying, varying_axes
from .._errors import LayerConfigError, TrainStepError
from ..core import global_index
from ..nn import sync_batch_norms
from ..sharding._internal import is_spec

LossFn = Callable[..., tuple[Array, dict[str, Array]] | tuple[Array, tuple[dict[str, Array], Any]]]
"""`(loss, metrics)`, or for a model with a state `(loss, (metrics, new_state))`."""

_CONTRACT = (
    "loss_fn(model, batch, key) must return (loss, metrics): loss the global mean "
    "loss, a floating scalar (shape ()), and metrics a dict of global scalars (empty if "
    "there are none)"
)
_STATEFUL = (
    "a model with a state (built by eqx.nn.make_with_state) is trained with "
    "loss_fn(model, state, batch, key) -> (loss, (metrics, new_state)), new_state the "
    "eqx.nn.State its layers returned"
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
    check_metric_names(metrics)
    for name, value in metrics.items():
        if not isinstance(value, (bool, int, float)) and jnp.shape(value) != ():
            raise TrainStepError(
                f"make_train_step: {_CONTRACT}; its metric {name!r} is {describe(value)}, not "
                f"a scalar. Reduce it to one global value (e.g. its mean), or keep it out of "
                f"the metrics."
            )
    return loss, metrics


STATE_DIVERGED = "state_diverged"
"""The metric that is 1 when a loss function returned a model state that differed across
the data axes (the step kept the first device's), else 0; reported with a model state."""

RESERVED_METRICS = ("loss", "grad_norm", "skipped", STATE_DIVERGED)
"""The metrics the train step reports itself; a loss function's metrics may not reuse them."""


def check_metric_names(metrics: dict[str, Any]) -> None:
    """Refuse a loss function's metric that would replace one the step reports (a
    `loss` shown for the real loss, a `skipped` hiding a skipped step).

    **Raises:**

    `TrainStepError` naming the metric.
    """
    taken = [name for name in metrics if name in RESERVED_METRICS]
    if taken:
        raise TrainStepError(
            f"make_train_step: the loss function's metric(s) {', '.join(map(repr, taken))} "
            f"would replace the step's own ({', '.join(RESERVED_METRICS)} are reserved: the "
            f"step reports the loss it differentiates, the gradient norm and whether the "
            f"update was skipped); rename them (e.g. 'my_{taken[0]}')."
        )


def check_loss_form(loss_fn: Callable, stateful: bool) -> None:
    """Refuse a loss function whose positional parameters do not fit the form the step
    calls it in: `loss_fn(model, batch, key)`, or with a model state
    `loss_fn(model, state, batch, key)` (`index` aside). A signature that cannot be read
    (`*args`, a builtin) is let through.

    **Raises:**

    `TrainStepError` naming the form, the parameters and the fix.
    """
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    names = [p.name for p in params if p.kind in kinds and p.name != "index"]
    required = [p.name for p in params if p.kind in kinds and p.name != "index" and p.default is p.empty]
    want = 4 if stateful else 3
    if len(required) <= want <= len(names):
        return
    if stateful:
        raise TrainStepError(
            f"make_train_step: the train state carries a model state (eqx.nn.State), so the "
            f"loss is called as loss_fn(model, state, batch, key) -> (loss, (metrics, "
            f"new_state)); this loss function takes ({', '.join(names)}). "
            f"Write it as loss_fn(model, state, batch, key), or build the state from a model "
            f"without a state."
        )
    raise TrainStepError(
        f"make_train_step: the train state carries no model state, so the loss is called as "
        f"loss_fn(model, batch, key) -> (loss, metrics); this loss function takes "
        f"({', '.join(names)}). Write it as "
        f"loss_fn(model, batch, key), or build the state with `eqx.nn.make_with_state`."
    )


def check_stateful_output(out: Any, old_state: eqx.nn.State) -> tuple[Any, dict[str, Any], eqx.nn.State]:
    """`(loss, metrics, new_state)` from what a stateful loss function returned, or a
    `TrainStepError`; `new_state`'s arrays in the dtypes of `old_state`'s."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], (tuple, list)) and len(out[1]) == 2):
        raise TrainStepError(f"make_train_step: {_STATEFUL}; it returned {describe(out)}.")
    loss, (metrics, new_state) = out
    if not isinstance(new_state, eqx.nn.State):
        raise TrainStepError(
            f"make_train_step: {_STATEFUL}; its new_state is {describe(new_state)}, not an "
            f"eqx.nn.State."
        )
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old_state)
    new_leaves, new_def = jax.tree.flatten(new_state)
    if old_def != new_def:
        raise TrainStepError(
            f"make_train_step: {_STATEFUL}; its new_state holds other entries than the state "
            f"it was given: expected {old_def}, got {new_def}."
        )
    for (path, old), new in zip(old_leaves, new_leaves):
        if jnp.shape(old) != jnp.shape(new):
            raise TrainStepError(
                f"make_train_step: {_STATEFUL}; its new_state's `state{jax.tree_util.keystr(path)}` "
                f"is {describe(new)}, where the state it was given holds {describe(old)}."
            )
    # In the old dtypes, not weakly typed: the next step gets the types this one got.
    new_state = jax.tree.unflatten(new_def, [
        jax.lax.convert_element_type(new, jnp.result_type(old)) for (_, old), new in zip(old_leaves, new_leaves)
    ])  # fmt: skip
    loss, metrics = check_loss_output((loss, metrics))
    return loss, metrics, new_state


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


def data_mean(x: PyTree, data_axes: tuple[str, ...]) -> PyTree:
    """Each floating array of `x` averaged over the data axes it varies over (inside
    `shard_map`, under the varying-axes check): a loss written as on one device, the mean
    over its own batch, becomes the mean over the devices' equal shards, the global loss.
    A value already global (invariant over them) is returned as it is."""

    def mean(leaf: Any) -> Any:
        if not eqx.is_inexact_array(leaf):
            return leaf
        axes = tuple(a for a in data_axes if a in varying_axes(leaf))
        return jax.lax.pmean(leaf, axes) if axes else leaf

    return jax.tree.map(mean, x)


def _clone(state: eqx.nn.State) -> eqx.nn.State:
    """A new `eqx.nn.State` object of the same arrays (`State.set` invalidates the old one,
    and the step may call the loss function more than once with the state it holds)."""
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)


class LossAdapter:
    """Calls a loss function in the form it is written; checks what it returns.

    **Arguments:**

    - `loss_fn`: the user's loss function.
    - `batch_spec`: the batch's spec (for the axes of `index` in the local view).
    - `batch_norm_axes`: the mesh axes that batch statistics span beyond the `vmap`
      over the batch, inside `shard_map` (every `eqx.nn.BatchNorm` is called as a
      `SyncBatchNorm` over them; `()`: each device's examples); `None` (the global
      view): the model's layers as they are.
    - `data_axes`: inside `shard_map`, the batch's axes: a loss and metrics that vary
      over them (written as on one device) are averaged over them (`data_mean`); `()`
      in the global view.
    """

    def __init__(
        self, loss_fn: LossFn, batch_spec: P | PyTree, batch_norm_axes: tuple[str, ...] | None = None,
        data_axes: tuple[str, ...] = (),
    ):
        self.loss_fn = loss_fn
        self.data_axes = data_axes
        self.with_index = takes_index(loss_fn)
        self.batch_axis = batch_axis(batch_spec) if self.with_index else None
        self.batch_norm_axes = batch_norm_axes

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
        """`(loss, (metrics, model_state))`: the shape `value_and_grad(has_aux=True)` takes.

        With a `model_state`, the stateful form is called and its new state returned.
        """
        kwargs = {"index": index} if self.with_index else {}
        check_loss_form(self.loss_fn, stateful=model_state is not None)
        if model_state is None:
            loss, metrics = check_loss_output(self.loss_fn(model, batch, key, **kwargs))
            return data_mean(loss, self.data_axes), (data_mean(metrics, self.data_axes), None)
        if self.batch_norm_axes is not None:
            model = sync_batch_norms(model, self.batch_norm_axes)
        out = self.loss_fn(model, _clone(model_state), batch, key, **kwargs)
        loss, metrics, new_state = check_stateful_output(out, model_state)
        loss, metrics = data_mean((loss, metrics), self.data_axes)
        # Each array typed as the state given (varying over the same axes), so that the
        # micro-steps' carry keeps its type.
        new_state = jax.tree.map(lambda new, old: cast_varying(new, varying_axes(old)), new_state, model_state)
        return loss, (metrics, new_state)
