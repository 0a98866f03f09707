"""The functional train step: `TrainState` and `make_train_step`.

The step has two phases under one `jax.jit`:

- **Gradients, in the local view.** Forward and backward run inside one
  `filter_shard_map`; the loss function returns the *global* loss, so the gradients
  JAX's transposes produce are the one-device gradients, split like their parameters,
  with no synchronisation added. They leave `shard_map` carrying the parameters' specs.
- **The update, in the global view.** Clipping, the optax update and the non-finite
  guard run on the global arrays: every optax transform (global-norm clipping, LAMB,
  adafactor, `masked`, `multi_transform`, schedules) computes what it computes on one
  device, and XLA inserts the few scalar reductions a global quantity needs.
  Elementwise transforms (adam, adamw, sgd) add no communication.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._axes import cast_varying, combined_axis_size, mesh_ordered, varying_axes, vma_checked
from .._errors import ConventionError, LayerConfigError
from ..core import global_index
from ..sharding import filter_shard_map, is_sharded, shard, sharded_init, specs_of, zero_split
from ..sharding._internal import (
    DEFAULT_MIN_WEIGHT_SIZE,
    ZeroAxes,
    is_spec,
    spec_axes,
    with_spec,
    zero_axes,
)

LossFn = Callable[..., tuple[Array, dict[str, Array]]]


class TrainState(eqx.Module):
    """Everything a training run carries from one step to the next.

    Its specs come from its contents: the model's boxes, the optimizer state's
    (inherited by structure), and replicated scalars.

    **Fields:**

    - `step`: `int32[]`, steps taken (skipped ones included).
    - `model`: the model (arrays in `Sharded` boxes).
    - `opt_state`: the optax state.
    - `key`: the run's PRNG key; step `s` uses `fold_in(key, s)`.
    - `data_position`: `int32[]`, the global number of samples consumed.
    - `skipped`: `int32[]`, steps whose loss or gradient was not finite (not applied).
    """

    step: Int[Array, ""]
    model: PyTree
    opt_state: PyTree
    key: PRNGKeyArray
    data_position: Int[Array, ""]
    skipped: Int[Array, ""]


def init_train_state(
    make_model: Callable[[PRNGKeyArray], PyTree],
    optimizer: optax.GradientTransformation,
    key: PRNGKeyArray,
    *,
    mesh: Mesh,
    zero: ZeroAxes | None = None,
    zero_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
) -> TrainState:
    """Build a `TrainState` directly sharded on `mesh` (mesh-invariant).

    **Arguments:**

    - `make_model`: `make_model(key) -> model`, e.g. `lambda k: GPT(config, key=k)`.
    - `optimizer`: an optax optimizer; its state inherits the parameters' specs.
    - `key`: the run's key; the model is built from `fold_in(key, 0)`.
    - `mesh`: the mesh.
    - `zero`: optimizer-state sharding (ZeRO-1): the mesh axis or axes (e.g. `"dp"`)
      the optimizer state's arrays are split over, beyond their parameters' specs
      (`equishard.sharding.zero_split`); the state then trains with
      `make_train_step(..., zero=...)` of the same axes. `None`: the state mirrors the
      parameters' specs. See the training guide.
    - `zero_min_weight_size`: with `zero`, optimizer-state arrays of fewer elements stay
      as their parameters are.

    **Returns:**

    The initial state, every array placed by its spec.
    """

    zero_axes(zero, mesh, "init_train_state")  # checked before tracing

    def make(key: PRNGKeyArray) -> TrainState:
        model = make_model(jax.random.fold_in(key, 0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            model=model,
            opt_state=zero_split(
                opt_state, zero, mesh=mesh, min_weight_size=zero_min_weight_size
            ),
            key=key,
            data_position=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )

    return sharded_init(make, key, mesh=mesh)


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


class _Static:
    """The non-array part of a pytree, hashable (by structure and leaves) for `jax.jit`."""

    def __init__(self, tree: PyTree):
        self.leaves, self.treedef = jax.tree.flatten(tree)
        self._key = (self.treedef, tuple(self.leaves))

    def tree(self) -> PyTree:
        return jax.tree.unflatten(self.treedef, self.leaves)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key


def _split_microbatches(batch: PyTree, k: int) -> PyTree:
    def split(x: Array) -> Array:
        if x.shape[0] % k:
            raise LayerConfigError(
                f"make_train_step: the local batch of {x.shape[0]} examples (shape "
                f"{tuple(x.shape)}) does not divide into grad_accum={k} micro-batches."
            )
        # [B_local, ...] -> [k, B_local/k, ...]
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])

    return jax.tree.map(split, batch)


def _spec_tree_axes(spec_tree: P | PyTree) -> tuple[str, ...]:
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
    varying = jax.tree.map(
        cast_varying,
        arrays,
        added,
    )
    pending = eqx.combine(added, static, is_leaf=lambda x: isinstance(x, tuple))
    return eqx.combine(varying, static), pending


def _invariant_over(tree: PyTree, axes: tuple[str, ...]) -> bool:
    """Whether no array of `tree` varies over any of `axes`."""
    return not any(set(axes) & varying_axes(x) for x in jax.tree.leaves(tree) if eqx.is_array(x))


def _apply_if(
    ok: Array, update: Callable[..., Any], grads: PyTree, opt_state: PyTree, model: PyTree
) -> tuple[PyTree, PyTree]:
    """`(model, opt_state)` after the optimizer's `update` if `ok`, else both unchanged.

    A `lax.cond`, not a select of new and old: the update reads each old moment once,
    for its new value, and writes it in place. Selected, the moment would be read by two
    fusions (its select and the parameter's update, which recomputes the new moment)
    while one of them overwrites it, so XLA keeps a copy of the whole optimizer state
    for the whole step (measured: 40 MiB per device on the 5.25 M-parameter GPT at dp=8).
    """
    arrays, static = eqx.partition(model, eqx.is_array)
    # The branches take and return flat lists: the trees are flattened once here, not
    # by `cond` for each branch's trace.
    leaves, treedef = jax.tree.flatten((grads, opt_state, arrays))
    out_def = jax.tree.structure((arrays, opt_state))

    def apply(leaves: list[Any]) -> list[Any]:
        grads, opt_state, arrays = jax.tree.unflatten(treedef, leaves)
        updates, opt_state = update(grads, opt_state, arrays)
        return jax.tree.leaves((eqx.apply_updates(arrays, updates), opt_state))

    def keep(leaves: list[Any]) -> list[Any]:
        _, opt_state, arrays = jax.tree.unflatten(treedef, leaves)
        return jax.tree.leaves((arrays, opt_state))

    arrays, opt_state = jax.tree.unflatten(out_def, jax.lax.cond(ok, apply, keep, leaves))
    return eqx.combine(arrays, static), opt_state


def _all_finite(mesh: Mesh) -> Callable[[PyTree], Array]:
    """`all_finite(tree) -> bool[]` on global arrays: whether every float is finite.

    Each device checks its blocks; one 4-byte all-reduce over the axes some array is
    split over combines the verdicts (a reduction per array, as XLA would insert for
    `jnp.isfinite` on the global arrays, costs a scalar per array). An axis no array
    is split over needs none: its devices hold the same blocks and reach the same
    verdict, so a data-parallel step checks without communicating.
    """
    axes = tuple(mesh.axis_names)

    def local(tree: PyTree) -> Array:
        leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
        finite = jnp.ones((), jnp.bool_)
        for x in leaves:
            finite = finite & jnp.all(jnp.isfinite(x))
        bad = (~finite).astype(jnp.int32)
        if vma_checked(axes):  # the blocks' types say which axes they are split over
            split = mesh_ordered(frozenset().union(*(varying_axes(x) for x in leaves)))
            if not split:
                return bad == 0
            bad = cast_varying(bad, split)
        else:
            split = axes
        return jax.lax.psum(bad, split) == 0

    return filter_shard_map(local, mesh=mesh, out_specs=P())


def _takes_index(loss_fn: Callable) -> bool:
    """Whether `loss_fn` accepts the keyword `index` (the global example indices)."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return False
    param = params.get("index")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return param is not None and param.kind in kinds


def _batch_axis(batch_spec: P | PyTree) -> str | tuple[str, ...] | None:
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


def _gradient_specs(model: PyTree) -> PyTree:
    """The out_specs of the gradients of `model`: the parameters' own specs.

    A parameter without a gradient (an integer array, a non-array) is an empty subtree
    of the gradients; its entry `P()` is a prefix of nothing.
    """
    specs = specs_of(eqx.filter(model, eqx.is_inexact_array))
    return jax.tree.map(
        lambda s: P() if s is None else s, specs, is_leaf=lambda x: x is None or is_spec(x)
    )


def _with_specs_of(tree: PyTree, like: PyTree) -> PyTree:
    """`tree`'s arrays in `like`'s boxes (the same structure but for the boxes' specs)."""
    return jax.tree.map(
        lambda new, old: old.with_value(new.value) if is_sharded(old) and is_sharded(new)
        else new.value if is_sharded(new) else new,
        tree,
        like,
        is_leaf=is_sharded,
    )


def _check_global_loss(loss: Array, data_axes: tuple[str, ...]) -> None:
    """Raise if the loss varies over the data axes: a local loss where the global one is due.

    Differentiating each device's own loss would give replicated parameters a gradient
    summed over the data axes instead of the single-device one.
    """
    varying: list[str] = [a for a in data_axes if a in varying_axes(loss)]
    if varying:
        names: str | tuple[str, ...] = tuple(varying) if len(varying) > 1 else varying[0]
        raise ConventionError(
            f"make_train_step: loss_fn returned a loss that varies over the data axes "
            f"{names!r}: each device's own loss, not the global one. Return the global "
            f"loss, the local mean averaged over the data axes "
            f"(`jax.lax.pmean(loss, {names!r})`), so that the gradients equal the "
            f"single-device gradients (see the training guide)."
        )


def _check_no_mean_grads(model: PyTree) -> None:
    """Raise if `model` holds an FSDP unit of the local-loss convention (`mean_grads=True`).

    Its gradients are averaged over the FSDP axis: `n` times too small for the global
    loss this step differentiates.
    """
    mean = lambda m: getattr(m, "mean_grads", False) is True
    if any(mean(m) for m in jax.tree.leaves(model, is_leaf=mean)):
        raise ConventionError(
            "make_train_step: the model holds an FSDP unit with mean_grads=True (from "
            "shard_module_params, xLSTM-JAX's local-loss convention), whose gradients are "
            "averaged over the FSDP axis: n times too small for the global loss this step "
            "differentiates. Wrap the module with equishard.nn.FSDP (mean_grads=False)."
        )


def _zero_gradient(grad: Any, pending: Any, zero: PyTree, zaxes: tuple[str, ...]) -> Any:
    """One local gradient, reduced over its pending data axes `axes`, as the box `zero` says.

    Inside `shard_map`. `pending`: the data axes the gradient still has to be summed
    over (in the gradient's box, or `None`: it is already summed). `zero`: the gradient's box under the ZeRO rule (its
    spec maybe split over `zaxes` on one more dimension); a gradient the rule splits is
    reduce-scattered over the ZeRO axes (the rest of `axes` all-reduced), or, if it is
    already summed, sliced to this device's block.
    """
    value = grad.value if is_sharded(grad) else grad
    axes: tuple[str, ...] | None = pending.value if is_sharded(pending) else pending
    old = grad.spec if is_sharded(grad) else P(*((None,) * value.ndim))
    new = zero.spec if is_sharded(zero) else old
    dims = [d for d, (a, b) in enumerate(zip(old, new)) if a != b]
    if not dims:  # kept as the parameter is: all-reduced over its pending axes
        value = jax.lax.psum(value, axes) if axes else value
    else:
        dim, split = dims[0], tuple(a for a in zaxes if a in spec_axes(new) and a not in spec_axes(old))
        if axes is not None and set(split) <= set(axes):
            # f32[..., D, ...] -> f32[..., D/zero, ...]: reduce-scatter over the ZeRO axes,
            # then the shard summed over the other pending axes (on 1/zero of the bytes).
            value = jax.lax.psum_scatter(value, split, scatter_dimension=dim, tiled=True)
            rest = tuple(a for a in axes if a not in split)
            value = jax.lax.psum(value, rest) if rest else value
        else:
            value = jax.lax.psum(value, axes) if axes else value
            block = value.shape[dim] // combined_axis_size(split)
            start = jax.lax.axis_index(split) * block
            value = jax.lax.dynamic_slice_in_dim(value, start, block, axis=dim)
    if is_sharded(zero):
        return with_spec(zero.with_value(value), zero.spec)
    return value


def _traced_once(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` under `jax.jit`, so that the step's two calls of it trace it once.

    The step calls the optimizer's update twice on arguments of the same shapes (see
    `train_step`): under one `jax.jit` the second call reuses the first one's jaxpr and
    its lowering (two calls of one function in the StableHLO, which XLA inlines; the
    compiled step is the same), where two plain calls would trace and lower the optax
    transforms twice. optax's updates are pure functions of arrays, as `jax.jit` needs.
    """
    return jax.jit(update)


def _first_update(
    optimizer: optax.GradientTransformation, update: Callable[..., Any], grads: PyTree,
    opt_state: PyTree, params: PyTree, zaxes: tuple[str, ...],
) -> PyTree:
    """`update(...)`'s updates (`optimizer`'s, traced once). If optax fails and the state's tree (its boxes'
    specs included) is not the one `optimizer.init` builds for the parameters as the
    update sees them, the error names the likely cause (ZeRO on one side only)."""
    try:
        return update(grads, opt_state, params)[0]
    except (ValueError, TypeError) as err:
        expected = jax.eval_shape(optimizer.init, params)
        if jax.tree.structure(expected) == jax.tree.structure(opt_state):
            raise  # the state is as the optimizer builds it: another error
        raise LayerConfigError(
            f"make_train_step(zero={zaxes or None!r}): optimizer.update cannot map the "
            f"state's optimizer state over the gradients: their trees differ (a box's spec is "
            f"part of the tree). A state built by init_train_state(..., zero=...) trains with "
            f"make_train_step(..., zero=...) of the same axes and zero_min_weight_size, and a "
            f"state built without it with zero=None (see the training guide). optax said: "
            f"{str(err).splitlines()[0]}"
        ) from err


def _check_zero_state(opt_state: PyTree, zaxes: tuple[str, ...], mesh: Mesh, min_size: int) -> None:
    """Raise unless the optimizer state was built for ZeRO over `zaxes` (or without it)."""
    split = zero_split(opt_state, zaxes or None, mesh=mesh, min_weight_size=min_size)
    if jax.tree.structure(split) != jax.tree.structure(opt_state):
        raise LayerConfigError(
            f"make_train_step(zero={zaxes or None!r}): the optimizer state is not split over "
            f"{zaxes!r} as the step updates it; build the state with "
            f"init_train_state(..., zero={zaxes!r}) (the same zero_min_weight_size), or "
            f"restore a checkpoint into such a state (see the training guide)."
        )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    batch_spec: P | PyTree,
    grad_accum: int = 1,
    clip_norm: float | None = None,
    donate: bool = True,
    view: str = "local",
    zero: ZeroAxes | None = None,
    zero_min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, Array]]]:
    """Make a pure, jitted `train_step(state, batch) -> (state, metrics)`.

    One `jax.jit` runs two phases (see the "Your own model" guide):

    1. **Gradients, local view**, inside one `filter_shard_map` over `mesh`:
       `grad_accum` micro-steps over equal slices of the local batch, each
       differentiating `loss_fn` (the global loss); gradients and metrics averaged.
       The gradients of parameters replicated over the data axes (those of
       `batch_spec`) are accumulated unreduced and all-reduced once, after the last
       micro-step — unless the loss depends on the parameters other than through the
       data (then it is not one value per copy), when each micro-step reduces them.
       The gradients leave `shard_map` carrying their parameters' specs.
    2. **Update, global view**: the gradient norm, clipping to `clip_norm`, and
       `optimizer.update` on the global arrays, so any optax transform behaves as on
       one device. The update is applied only if the loss, the gradient norm and the
       update are all finite; otherwise the state is kept, and the step counted in
       `state.skipped` and in the metrics' `skipped`.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch, key) -> (loss, metrics)`, called in the local
      view. `loss` must be the global loss (the local mean `pmean`-ed over the data
      axes); `metrics` a dict of global scalars (aux losses, dropped tokens, ...).
      A loss function with a keyword `index`, `loss_fn(model, batch, key, *, index)`,
      is also given `int32[B_local]`, the global indices of its local examples (in the
      step's whole batch, whatever the micro-batch), and always the step's key: per-
      example keys `equishard.core.example_keys(key, index)` make dropout independent
      of the layout and of `grad_accum`. The plain form gets the step's key, folded
      with the micro-step under `grad_accum` (layout-dependent if split per example).
    - `optimizer`: an optax optimizer (its `update` is given the parameters).
    - `mesh`: the mesh.
    - `batch_spec`: the spec (or spec tree) of the global batch, e.g. `P(("dp", "fsdp"))`.
    - `grad_accum`: micro-steps per step.
    - `clip_norm`: clip the gradient to this global norm (`None`: no clipping).
    - `donate`: donate the old state's buffers to the new state.
    - `view`: `"local"` (default): phase 1 as above, inside `shard_map`, for models
      whose layers communicate (equishard's layers, `FSDP`). `"global"`: phase 1 on
      the global arrays under `jit`, each array laid out by its spec and XLA (GSPMD)
      inserting the collectives — the shortest route to tensor parallelism for a model
      given specs by path rules that has no collectives of its own. `loss_fn` then sees
      the global batch and returns its mean (a `pmean` over no axes, `()`, is a no-op);
      `index` is `0, ..., B - 1`. The mesh's axes must be `Auto` (what `make_mesh`
      builds). See the "Your own model" guide for what each view costs.
    - `zero`: optimizer-state sharding (ZeRO-1) over these data axes (e.g. `"dp"`), for
      a state built by `init_train_state(..., zero=...)` with the same axes: the
      parameters stay replicated over them, each gradient that the ZeRO rule splits
      (`equishard.sharding.zero_split`) is reduce-scattered over them once per step
      (after the last micro-step) instead of all-reduced, the update runs on the
      optimizer state's shards, and the updated parameters are all-gathered once: the
      same bytes as the all-reduce, and 1/n of the optimizer state per device. See the
      training guide.
    - `zero_min_weight_size`: with `zero`, the arrays of fewer elements that stay
      replicated (as in `init_train_state`).
    - `compiler_options`: XLA options for this step's program only, as `jax.jit`'s
      (e.g. `{"xla_backend_optimization_level": 0}`, which on XLA:CPU compiles a step
      with dropout several times faster and runs it more slowly); `None`: XLA's
      defaults and the `XLA_FLAGS` environment variable.

    **Returns:**

    `train_step(state, batch) -> (new_state, metrics)`; `metrics` holds `loss`,
    `grad_norm` (before clipping), `skipped` (1 if this step was not applied: an
    application stopping after N consecutive skips counts these) and `loss_fn`'s
    metrics, all global values. `train_step.lower(state, batch)` lowers it without
    running; `train_step.compile(state, batch)` compiles it ahead of time and returns the
    compiled step (same signature), so compilation can be timed apart from the steps;
    its `.compiled` is JAX's compiled program (`memory_analysis()`, `as_text()`).
    """
    if grad_accum < 1:
        raise LayerConfigError(f"make_train_step: grad_accum must be >= 1, got {grad_accum}.")
    if view not in ("local", "global"):
        raise LayerConfigError(f"make_train_step: view must be 'local' or 'global', got {view!r}.")
    if view == "global" and any(t == AxisType.Explicit for t in mesh.axis_types):
        raise LayerConfigError(
            f"make_train_step(view='global') needs a mesh of Auto axes, where XLA chooses "
            f"the collectives; this mesh's axes are {dict(zip(mesh.axis_names, mesh.axis_types))}. "
            f"Build it with equishard.make_mesh (Auto by default), or "
            f"jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)."
        )
    data_axes = _spec_tree_axes(batch_spec)
    zaxes = zero_axes(zero, mesh, "make_train_step")

    def zero_view(tree: PyTree) -> PyTree:
        return zero_split(tree, zaxes or None, mesh=mesh, min_weight_size=zero_min_weight_size)

    with_index = _takes_index(loss_fn)
    batch_axis = _batch_axis(batch_spec) if with_index else None
    all_finite = _all_finite(mesh)
    update = _traced_once(optimizer.update)

    def loss_with_key(model: PyTree, micro: PyTree, key: PRNGKeyArray, index: Any) -> Any:
        if with_index:
            return loss_fn(model, micro, key, index=index)
        return loss_fn(model, micro, key)

    def value_and_grad(model: PyTree, micro: PyTree, key: PRNGKeyArray, index: Any) -> Any:
        return eqx.filter_value_and_grad(loss_with_key, has_aux=True)(model, micro, key, index)

    def local_gradients(model: PyTree, batch: PyTree, key: PRNGKeyArray) -> Any:
        local_batch = jax.tree.leaves(batch)[0].shape[0]
        # int32[B/data]: where this device's examples sit in the global batch.
        index = global_index(local_batch, batch_axis) if with_index else None
        if grad_accum == 1 and not zaxes:
            (loss, metrics), grads = value_and_grad(model, batch, key, index)
            return loss, metrics, global_norm(grads), grads
        # [B_local, ...] -> [k, B_local/k, ...]; the first micro-step outside the
        # scan gives the carry its types (including how each value varies).
        micro = _split_microbatches((batch, index), grad_accum)
        head = jax.tree.map(lambda x: x[0], micro)
        rest = (jnp.arange(1, grad_accum), jax.tree.map(lambda x: x[1:], micro))

        def accumulated(model: PyTree) -> Any:
            def one(i: Any, micro_batch: Any) -> Any:
                part, part_index = micro_batch
                # Per-example keys come from `index`; the plain form folds the micro-step.
                part_key = key if with_index else jax.random.fold_in(key, i)
                (loss, metrics), grads = value_and_grad(model, part, part_key, part_index)
                return jax.tree.map(lambda a: a / grad_accum, (loss, metrics, grads))

            def accumulate(carry: Any, xs: Any) -> Any:
                return jax.tree.map(jnp.add, carry, one(*xs)), None

            first = one(0, head)
            if not _invariant_over((first[0], first[1]), data_axes):
                return None
            if grad_accum == 1:
                return first
            return jax.lax.scan(accumulate, first, rest)[0]

        # Each micro-step would all-reduce the gradients of the parameters that are
        # replicated over the data axes. Differentiating a copy cast to vary over
        # them instead leaves each device's gradient unreduced; they are summed once,
        # after the last micro-step (k times fewer bytes), or under ZeRO
        # reduce-scattered once. That is exact whenever the loss is one global value
        # (invariant over the data axes): the gradient of a function of n equal copies
        # is the sum of the partial gradients.
        varying, pending = _vary_over(model, data_axes)
        result = accumulated(varying)
        if result is None:  # the loss varies with the copies: reduce every micro-step
            result = accumulated(model)
            pending = None
        loss, metrics, grads = result
        if zaxes:
            # Each box as the ZeRO rule splits it (rules read specs and global shapes).
            zgrads = zero_view(grads)
            if pending is None:
                pending = jax.tree.map(lambda g: None, grads)
            grads = jax.tree.map(
                lambda g, axes, z: g if g is None else _zero_gradient(g, axes, z, zaxes),
                grads,
                pending,
                zgrads,
                is_leaf=lambda g: g is None or is_sharded(g) or eqx.is_array(g),
            )
        elif pending is not None:
            grads = jax.tree.map(
                lambda g, axes: g if g is None or not axes else jax.lax.psum(g, axes),
                grads,
                pending,
                is_leaf=lambda g: g is None,
            )
        return loss, metrics, global_norm(grads), grads

    def global_gradients(model: PyTree, batch: PyTree, key: PRNGKeyArray) -> Any:
        batch = shard(batch, mesh, batch_spec)
        size = jax.tree.leaves(batch)[0].shape[0]
        index = jnp.arange(size, dtype=jnp.int32)
        if grad_accum == 1:
            (loss, metrics), grads = value_and_grad(model, batch, key, index)
        else:
            # [B, ...] -> [k, B/k, ...], micro-batch m taking the m-th slice of every
            # data shard's rows (as the local view does).
            shards = math.prod(mesh.shape[a] for a in data_axes)

            def split(x: Array) -> Array:
                if x.shape[0] % (shards * grad_accum):
                    raise LayerConfigError(
                        f"make_train_step: the batch of {x.shape[0]} examples does not divide "
                        f"into {shards} data shards x grad_accum={grad_accum} micro-batches."
                    )
                x = x.reshape(shards, grad_accum, x.shape[0] // (shards * grad_accum), *x.shape[1:])
                return jnp.swapaxes(x, 0, 1).reshape(grad_accum, -1, *x.shape[3:])

            micro = jax.tree.map(split, (batch, index))

            def one(carry: Any, xs: Any) -> Any:
                i, (part, part_index) = xs
                part_key = key if with_index else jax.random.fold_in(key, i)
                (loss, metrics), grads = value_and_grad(model, part, part_key, part_index)
                return jax.tree.map(lambda c, a: c + a / grad_accum, carry, (loss, metrics, grads)), None

            first = jax.tree.map(lambda x: x[0], micro)
            (loss, metrics), grads = value_and_grad(model, first[0], key if with_index else jax.random.fold_in(key, 0), first[1])
            carry = jax.tree.map(lambda a: a / grad_accum, (loss, metrics, grads))
            rest = (jnp.arange(1, grad_accum), jax.tree.map(lambda x: x[1:], micro))
            loss, metrics, grads = jax.lax.scan(one, carry, rest)[0]
        grad_norm = jnp.sqrt(
            sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads) if eqx.is_inexact_array(g)), jnp.zeros((), jnp.float32))
        )
        return loss, metrics, grad_norm, grads

    def checked_gradients(model: PyTree, batch: PyTree, key: PRNGKeyArray) -> Any:
        _check_no_mean_grads(model)
        out = local_gradients(model, batch, key)
        _check_global_loss(out[0], data_axes)
        return out

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Array]]:
        key = jax.random.fold_in(state.key, state.step)
        if zaxes:
            _check_zero_state(state.opt_state, zaxes, mesh, zero_min_weight_size)
        if view == "global":
            loss, metrics, grad_norm, grads = global_gradients(state.model, batch, key)
            # Under ZeRO, laid out as the optimizer state is: XLA reduce-scatters.
            grads = shard(zero_view(grads), mesh)
        else:
            # The out_specs are known before tracing (the parameters' specs, or under
            # ZeRO the optimizer state's): the body is traced once.
            gradients = filter_shard_map(
                checked_gradients,
                mesh=mesh,
                in_specs=(None, batch_spec, P()),
                out_specs=(P(), P(), P(), _gradient_specs(zero_view(state.model))),
            )
            loss, metrics, grad_norm, grads = gradients(state.model, batch, key)

        # Global view from here: `grads` are global arrays in their parameters' boxes
        # (under ZeRO, in the optimizer state's boxes: the parameters are viewed, and
        # laid out for the update, the same way, a local slice of a replicated array).
        if clip_norm is not None:
            scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        old_model = shard(zero_view(state.model), mesh) if zaxes else state.model
        params = eqx.filter(old_model, eqx.is_array)
        # The guard reads every update before any is applied; computed once for it and
        # once more to apply (the second inside the branch that applies it, so XLA
        # neither merges the two nor keeps the first), no update outlives its fusion:
        # the step holds the gradients, not also a parameter-sized update and new
        # moments at once.
        checked = _first_update(optimizer, update, grads, state.opt_state, params, zaxes)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(checked)
        model, opt_state = _apply_if(ok, update, grads, state.opt_state, old_model)
        if zaxes:
            # The updated shards, then (by `shard` below) all-gathered once.
            model = _with_specs_of(shard(model, mesh), state.model)
        global_batch = jax.tree.leaves(batch)[0].shape[0]
        new_state = TrainState(
            step=state.step + 1,
            model=model,
            opt_state=opt_state,
            key=state.key,
            data_position=state.data_position + global_batch,
            skipped=state.skipped + (~ok).astype(jnp.int32),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped": (~ok).astype(jnp.int32),
            **metrics,
        }
        # Each array keeps the layout it came in with (the next step's input layout).
        return shard(new_state, mesh), metrics

    # `jax.jit` over the arrays, the rest static, rather than `eqx.filter_jit`: the
    # latter waits for each call to finish (to surface Equinox runtime errors), which
    # would serialise the host's next batch with the device's step.
    def arrays_step(state_arrays: PyTree, batch: PyTree, static: _Static) -> Any:
        state, metrics = train_step(eqx.combine(state_arrays, static.tree()), batch)
        return eqx.filter(state, eqx.is_array), metrics

    jitted = jax.jit(
        arrays_step,
        static_argnums=2,
        donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options,
    )

    def split(state: TrainState) -> tuple[PyTree, _Static]:
        arrays, static = eqx.partition(state, eqx.is_array)
        return arrays, _Static(static)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Array]]:
        arrays, static = split(state)
        with warnings.catch_warnings():
            # XLA:CPU cannot reuse every donated buffer and says so on each compile.
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            new_arrays, metrics = jitted(arrays, batch, static)
        return eqx.combine(new_arrays, static.tree()), metrics

    def lower(state: TrainState, batch: PyTree) -> Any:
        arrays, static = split(state)
        return jitted.lower(arrays, batch, static)

    def compile(state: TrainState, batch: PyTree) -> Any:
        """Compile ahead of time for this state and batch; return the compiled step
        (the same signature as `train_step`), so a caller can time compilation alone."""
        arrays, static = split(state)
        compiled = jitted.lower(arrays, batch, static).compile()

        def compiled_step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Array]]:
            arrays, static = split(state)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                new_arrays, metrics = compiled(arrays, batch)
            return eqx.combine(new_arrays, static.tree()), metrics

        compiled_step.compiled = compiled  # type: ignore[attr-defined]
        return compiled_step

    step.lower = lower  # type: ignore[attr-defined]
    step.compile = compile  # type: ignore[attr-defined]
    return step
