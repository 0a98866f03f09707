"""The train step's first phase: the gradients, in the local or the global view.

- `value_and_grad`: one micro-batch's loss, metrics and gradients, through the loss
  adapter and the precision policy.
- `accumulate`: the micro-steps in order, a model state carried through them, and the
  mean of their losses, metrics and gradients.
- `local_gradients`: inside `shard_map`; the gradients of replicated parameters summed
  once, after the last micro-step (or by the optimizer-state layout, under ZeRO).
- `global_gradients`: under `jit` on the global arrays, XLA inserting the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import cast_varying, mesh_ordered, varying_axes, vma_checked
from .._errors import ConventionError
from ..core._internal import split_microbatches
from ..sharding import is_sharded, shard, specs_of
from ..sharding._internal import is_spec, spec_axes
from ._loss import STATE_DIVERGED, LossAdapter
from ._opt_sharding import OptStateSharding
from ._precision import Precision
from ._trainable import TrainableMask, merge

Gradients = tuple[Any, dict[str, Any], PyTree]  # (loss, metrics, grads)


def global_norm(tree: PyTree) -> Array:
    """The L2 norm of all arrays of `tree`, inside `shard_map`, across their shards.

    Each box's local sum of squares is summed over the mesh axes its spec splits it
    over; replicated arrays count once.

    **Arguments:**

    - `tree`: local blocks with their boxes (e.g. gradients).

    **Returns:**

    `f32[]`, the same on every device.
    """
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(tree, is_leaf=is_sharded):
        value = leaf.value if is_sharded(leaf) else leaf
        if not eqx.is_inexact_array(value):
            continue
        local = jnp.sum(jnp.square(value.astype(jnp.float32)))
        axes = spec_axes(leaf.spec) if is_sharded(leaf) else []
        total = total + (jax.lax.psum(local, tuple(axes)) if axes else local)
    return jnp.sqrt(total)


def value_and_grad(
    adapter: LossAdapter, precision: Precision, model: PyTree, batch: PyTree,
    key: PRNGKeyArray, index: Any, model_state: Any = None, frozen: PyTree = None,
) -> tuple[Any, Gradients]:
    """`(model_state, (loss, metrics, grads))` of one batch, `grads` of `model`'s floats.

    `model`: the trainable part (`None` in place of the frozen arrays), `frozen` the
    rest (`None`: nothing frozen): constants of the differentiated function, so that no
    gradient is computed for them (`TrainableMask.split`).
    """

    def loss(model: PyTree, batch: PyTree, key: PRNGKeyArray, index: Any) -> Any:
        model = model if frozen is None else merge(model, frozen)
        return adapter(precision.compute(model), precision.batch(batch), key, index, model_state)

    grad_fn = eqx.filter_value_and_grad(loss, has_aux=True)
    (value, (metrics, model_state)), grads = grad_fn(model, batch, key, index)
    return model_state, (value, metrics, precision.gradients(grads))


def accumulate(
    one: Callable[[Any, PyTree, Any], tuple[Any, Gradients]],
    micro: PyTree,
    k: int,
    model_state: Any = None,
    *,
    accept: Callable[[Gradients], bool] | None = None,
) -> tuple[Any, Gradients] | None:
    """The mean of `one` over `k` micro-batches, in order, a model state carried through.

    **Arguments:**

    - `one`: `one(i, micro_batch, model_state) -> (model_state, (loss, metrics, grads))`.
    - `micro`: every array `[k, ...]`, micro-batch `i` its `i`-th slice.
    - `k`: the number of micro-batches.
    - `model_state`: the state the first micro-step gets (`None`: none).
    - `accept`: a test of the first micro-step's result; `None` is returned if it fails.

    **Returns:**

    `(model_state, mean)`: the last micro-step's state and the mean of the results.
    """
    # The first micro-step outside the scan gives the carry its types (including how
    # each value varies).
    head = jax.tree.map(lambda x: x[0], micro)
    model_state, first = one(0, head, model_state)
    if accept is not None and not accept(first):
        return None
    first = jax.tree.map(lambda a: a / k, first)
    if k == 1:
        return model_state, first

    def step(carry: Any, xs: Any) -> Any:
        (model_state, total), (i, micro_batch) = carry, xs
        model_state, out = one(i, micro_batch, model_state)
        return (model_state, jax.tree.map(lambda c, a: c + a / k, total, out)), None

    rest = (jnp.arange(1, k), jax.tree.map(lambda x: x[1:], micro))
    return jax.lax.scan(step, (model_state, first), rest)[0]


def _bits(x: Array) -> Array:
    """`x` as unsigned integers of its width (a NaN equals the same NaN, bit for bit)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact) or x.dtype.itemsize not in (2, 4, 8):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def settle_state(model_state: Any, data_axes: tuple[str, ...], per_device: bool) -> tuple[Any, Array | None]:
    """Inside `shard_map`: a model state the same on every device along `data_axes`, and
    whether the loss function returned one that differed between them.

    Each array of the state a loss function returned is typed as varying over the data
    axes (the step hands the state to it so). With per-device statistics the floating
    arrays are averaged over the data axes (each device's running statistics differ);
    otherwise every device should hold the same values: the first device's are taken,
    bit for bit, and `int32[]` 1 says that some device's differed (statistics the loss
    function took per device where the step expects them over the global batch), else 0
    (`None` without a state to settle).
    """
    if model_state is None or not data_axes or not vma_checked(data_axes):
        return model_state, None
    axes = mesh_ordered(data_axes)
    first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
    differs: list[Array] = []

    def settle(x: Any) -> Any:
        if not set(axes) & varying_axes(x):
            return x
        x = cast_varying(x, axes)
        if per_device and eqx.is_inexact_array(x):
            return jax.lax.pmean(x, axes)
        zero = jnp.zeros_like(x)
        chosen = jax.lax.psum(jnp.where(first, x, zero), axes).astype(x.dtype)
        differs.append(jnp.any(_bits(x) != _bits(chosen)))
        return chosen

    settled = jax.tree.map(settle, model_state)
    if not differs:
        return settled, None
    # One scalar all-reduce for the whole state.
    return settled, jax.lax.pmax(jnp.any(jnp.stack(differs)).astype(jnp.int32), axes)


def data_axes_of(spec_tree: P | PyTree) -> tuple[str, ...]:
    """The mesh axes a spec or spec tree uses (for a batch: the data axes), in order."""
    axes: list[str] = []
    for spec in jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P)):
        axes += [a for a in spec_axes(spec) if a not in axes]
    return tuple(axes)


def _vary_over(model: PyTree, axes: tuple[str, ...]) -> tuple[PyTree, PyTree | None]:
    """`model` with each floating array cast to vary over `axes`, and the axes added.

    **Returns:**

    `(varying_model, added)`: `added` holds, per array (`None` elsewhere), the tuple of
    axes its gradient must be summed over afterwards; `(model, None)` when the
    varying-axes check is off (nothing is typed, nothing can be deferred).
    """
    if not axes or not vma_checked(axes):
        return model, None
    arrays, static = eqx.partition(model, eqx.is_inexact_array)
    added = jax.tree.map(
        lambda x: tuple(a for a in mesh_ordered(axes) if a not in varying_axes(x)), arrays
    )
    varying = jax.tree.map(cast_varying, arrays, added)
    pending = eqx.combine(added, static, is_leaf=lambda x: isinstance(x, tuple))
    return eqx.combine(varying, static), pending


def _invariant_over(tree: PyTree, axes: tuple[str, ...]) -> bool:
    """Whether no array of `tree` varies over any of `axes`."""
    return not any(set(axes) & varying_axes(x) for x in jax.tree.leaves(tree) if eqx.is_array(x))


def check_no_mean_grads(model: PyTree) -> None:
    """Raise if `model` holds an FSDP unit of the local-loss convention (`mean_grads=True`).

    Its gradients are averaged over the FSDP axis: `n` times too small for the global
    loss this step differentiates.
    """
    mean = lambda m: getattr(m, "mean_grads", False) is True  # noqa: E731
    if any(mean(m) for m in jax.tree.leaves(model, is_leaf=mean)):
        raise ConventionError(
            "make_train_step: the model holds an FSDP unit with mean_grads=True (from "
            "shard_module_params, xLSTM-JAX's local-loss convention), whose gradients are "
            "averaged over the FSDP axis: n times too small for the global loss this step "
            "differentiates. Wrap the module with equishard.nn.FSDP (mean_grads=False)."
        )


def gradient_specs(model: PyTree) -> PyTree:
    """The out_specs of the gradients of `model`: the parameters' own specs.

    A parameter without a gradient (an integer array, a non-array) is an empty subtree
    of the gradients; its entry `P()` is a prefix of nothing.
    """
    specs = specs_of(eqx.filter(model, eqx.is_inexact_array))
    return jax.tree.map(
        lambda s: P() if s is None else s, specs, is_leaf=lambda x: x is None or is_spec(x)
    )


def _reduce_pending(
    layout: OptStateSharding, grads: PyTree, pending: PyTree | None, dtype: Any = None
) -> PyTree:
    """Each local gradient summed over its pending data axes, in `layout`'s view, in
    `dtype` (`None`: the gradient's own)."""
    if pending is None:  # already summed by each micro-step
        pending = jax.tree.map(lambda g: None, grads)

    def reduce(g: Any, axes: Any, like: Any) -> Any:
        axes = axes.value if is_sharded(axes) else axes
        value = g.value if is_sharded(g) else g
        if not axes or dtype is None or value.dtype == dtype:
            return layout.reduce(g, axes, like)
        cast = lambda v, d: g.with_value(v.astype(d)) if is_sharded(g) else v.astype(d)  # noqa: E731
        out = layout.reduce(cast(value, dtype), axes, like)
        return out.with_value(out.value.astype(value.dtype)) if is_sharded(out) else out.astype(value.dtype)

    return jax.tree.map(
        lambda g, axes, like: g if g is None else reduce(g, axes, like),
        grads,
        pending,
        layout.view(grads),
        is_leaf=lambda g: g is None or is_sharded(g) or eqx.is_array(g),
    )


def local_gradients(
    model: PyTree, batch: PyTree, key: PRNGKeyArray, model_state: Any = None, *,
    adapter: LossAdapter, precision: Precision, layout: OptStateSharding, grad_accum: int,
    data_axes: tuple[str, ...], mask: TrainableMask,
) -> tuple[Array, dict[str, Any], Array, PyTree, Any]:
    """Inside `shard_map`: `(loss, metrics, grad_norm, grads, model_state)` of this
    device's batch, the model state after the last micro-step (the same on every device).

    Each micro-step would all-reduce the gradients of the parameters that are
    replicated over the data axes. Differentiating a copy cast to vary over them
    instead leaves each device's gradient unreduced; they are summed once, after the
    last micro-step (k times fewer bytes), or under ZeRO reduce-scattered once. That is
    exact whenever the loss is one global value (invariant over the data axes): the
    gradient of a function of n equal copies is the sum of the partial gradients.

    Only `mask`'s trainable arrays are differentiated (and reduced); the gradients hold
    `None` in place of the frozen ones.
    """
    check_no_mean_grads(model)
    model, frozen = mask.split(model)
    # int32[B/data]: where this device's examples sit in the global batch.
    index = adapter.local_index(jax.tree.leaves(batch)[0].shape[0])
    if model_state is not None and data_axes and vma_checked(data_axes):
        # The loss function gets the state typed as varying over the data axes: with
        # per-device statistics its new values differ from device to device.
        model_state = cast_varying(model_state, data_axes)
    initial_state = model_state
    # Under mixed precision the replicated parameters' gradients are summed after the
    # cast's transpose, in `reduce_dtype`: the deferred route, even for one micro-step.
    if grad_accum == 1 and not layout.reduces_gradients and precision.reduce_dtype is None:
        model_state, (loss, metrics, grads) = value_and_grad(
            adapter, precision, model, batch, key, index, model_state, frozen
        )
    else:
        # [B_local, ...] -> [k, B_local/k, ...]
        micro = split_microbatches((batch, index), grad_accum, what="make_train_step", name="grad_accum")

        def accumulated(model: PyTree) -> Any:
            def one(i: Any, part: Any, model_state: Any) -> Any:
                part_batch, part_index = part
                part_key = adapter.micro_key(key, i)
                return value_and_grad(
                    adapter, precision, model, part_batch, part_key, part_index, model_state, frozen
                )

            accept = lambda out: _invariant_over((out[0], out[1]), data_axes)  # noqa: E731
            return accumulate(one, micro, grad_accum, initial_state, accept=accept)

        varying, pending = _vary_over(model, data_axes)
        result = accumulated(varying)
        if result is None:  # the loss varies with the copies: reduce every micro-step
            result = accumulated(model)
            pending = None
        model_state, (loss, metrics, grads) = result
        grads = _reduce_pending(layout, grads, pending, precision.reduce_dtype)
    model_state, diverged = settle_state(model_state, data_axes, adapter.batch_norm_axes == ())
    if diverged is not None:
        metrics = {**metrics, STATE_DIVERGED: diverged}
    return loss, metrics, global_norm(grads), grads, model_state


def global_gradients(
    model: PyTree, batch: PyTree, key: PRNGKeyArray, model_state: Any = None, *,
    adapter: LossAdapter, precision: Precision, grad_accum: int, mesh: Mesh,
    batch_spec: P | PyTree, data_axes: tuple[str, ...], mask: TrainableMask,
) -> tuple[Array, dict[str, Any], Array, PyTree, Any]:
    """Under `jit`, on the global arrays: `(loss, metrics, grad_norm, grads, model_state)`,
    the gradients of `mask`'s trainable arrays (`None` in place of the frozen ones)."""
    model, frozen = mask.split(model)
    batch = shard(batch, mesh, batch_spec)
    index = jnp.arange(jax.tree.leaves(batch)[0].shape[0], dtype=jnp.int32)  # int32[B]
    if grad_accum == 1:
        model_state, (loss, metrics, grads) = value_and_grad(
            adapter, precision, model, batch, key, index, model_state, frozen
        )
    else:
        # [B, ...] -> [k, B/k, ...], micro-batch m taking the m-th slice of every data
        # shard's rows (as the local view does).
        shards = math.prod(mesh.shape[a] for a in data_axes)
        hint = "the global batch must be divisible by the data shards times {name}."
        micro = split_microbatches(
            (batch, index), grad_accum, what="make_train_step", name="grad_accum", shards=shards, hint=hint
        )

        def one(i: Any, part: Any, model_state: Any) -> Any:
            part_batch, part_index = part
            part_key = adapter.micro_key(key, i)
            return value_and_grad(
                adapter, precision, model, part_batch, part_key, part_index, model_state, frozen
            )

        model_state, (loss, metrics, grads) = accumulate(one, micro, grad_accum, model_state)  # type: ignore[misc]
    squares = (
        jnp.sum(jnp.square(g.astype(jnp.float32)))
        for g in jax.tree.leaves(grads)
        if eqx.is_inexact_array(g)
    )
    return loss, metrics, jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32))), grads, model_state
