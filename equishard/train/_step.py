"""The functional train step: `make_train_step` and the `TrainStep` it returns.

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

The parts: the loss adapter (`_loss`), the precision policy (`_precision`), the gradients
and their accumulation (`_gradients`), the optimizer-state layout (`_opt_sharding`) and the
guarded update (`_update`). The precision policy and the optimizer-state layout are values
the caller passes and the `TrainStep` holds as fields (one source of truth:
`TrainStep.init_state` builds the state in the step's own layout). This module assembles
the parts (`step_body`), checks what a call is given (`check_state`, `check_batch`) and
wraps the program (`TrainStep`, `CompiledTrainStep`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from .._compile import check_compiler_options
from .._errors import LayerConfigError, TrainStepError
from ..sharding import filter_shard_map, path_str, shard
from ._gradients import data_axes_of, global_gradients, gradient_specs, local_gradients
from ._loss import LossAdapter, LossFn, describe
from ._opt_sharding import OptStateSharding, bind_opt_sharding
from ._precision import Precision, check_precision
from ._state import TrainState, init_train_state
from ._trainable import Trainable, TrainableMask, check_trainable, resolve_mask
from ._update import all_finite, check_optimizer_state, clip, guarded_update, traced_once

Metrics = dict[str, Any]


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


def _split(state: TrainState) -> tuple[PyTree, _Static]:
    arrays, static = eqx.partition(state, eqx.is_array)
    return arrays, _Static(static)


class _Parts:
    """What `step_body` is assembled from: the validated options and the parts."""

    def __init__(
        self, loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh,
        batch_spec: P | PyTree, grad_accum: int, clip_norm: float | None, view: str,
        layout: OptStateSharding, precision: Precision, batch_stats: str = "global",
        trainable: Trainable | None = None,
    ):
        self.data_axes = data_axes_of(batch_spec)
        # Batch norms inside `shard_map` take their statistics over the data axes too
        # (or this device's examples); in the global view the vmap spans the whole batch.
        norm_axes = None if view == "global" else (self.data_axes if batch_stats == "global" else ())
        self.adapter = LossAdapter(loss_fn, batch_spec, norm_axes, self.data_axes if view == "local" else ())
        self.optimizer = optimizer
        self.update = traced_once(optimizer.update)
        self.all_finite = all_finite(mesh)
        self.mesh, self.batch_spec, self.view = mesh, batch_spec, view
        self.grad_accum, self.clip_norm = grad_accum, clip_norm
        self.layout, self.precision, self.trainable = layout, precision, trainable


def compute_gradients(
    parts: _Parts, model: PyTree, batch: PyTree, key: Any, model_state: Any, mask: TrainableMask
) -> Any:
    """`(loss, metrics, grad_norm, grads, model_state)`: the global gradients of `mask`'s
    trainable arrays in the layout's view (`None` for the frozen ones), and the model
    state after the step's micro-steps (replicated)."""
    common: dict[str, Any] = dict(
        adapter=parts.adapter, precision=parts.precision, grad_accum=parts.grad_accum, mask=mask
    )
    if parts.view == "global":
        loss, metrics, grad_norm, grads, model_state = global_gradients(
            model, batch, key, model_state, mesh=parts.mesh, batch_spec=parts.batch_spec,
            data_axes=parts.data_axes, **common,
        )  # fmt: skip
        # Under ZeRO, laid out as the optimizer state is: XLA reduce-scatters. Metrics
        # and state replicated, as the local view returns them.
        grads = shard(parts.layout.view(grads), parts.mesh)
        metrics, model_state = shard((metrics, model_state), parts.mesh)
        return loss, metrics, grad_norm, grads, model_state

    def local(model: PyTree, batch: PyTree, key: Any, model_state: Any) -> Any:
        return local_gradients(
            model, batch, key, model_state, layout=parts.layout, data_axes=parts.data_axes, **common
        )

    # The out_specs are known before tracing (the parameters' specs, or under ZeRO the
    # optimizer state's): the body is traced once.
    gradients = filter_shard_map(
        local,
        mesh=parts.mesh,
        in_specs=(None, parts.batch_spec, P(), P()),
        out_specs=(P(), P(), P(), gradient_specs(parts.layout.view(mask.trained(model))), P()),
    )
    return gradients(model, batch, key, model_state)


def step_body(parts: _Parts, state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
    """One step: gradients, then the guarded update, on `state` and the global `batch`."""
    key = jax.random.fold_in(state.key, state.step)
    mask = resolve_mask(parts.trainable, state.model)
    check_optimizer_state(parts.optimizer, state.model, state.opt_state, mask)
    parts.layout.check(state.opt_state)
    loss, metrics, grad_norm, grads, model_state = compute_gradients(
        parts, state.model, batch, key, state.model_state, mask
    )
    # Global view from here: `grads` are global arrays in their parameters' boxes
    # (under ZeRO, in the optimizer state's boxes: the parameters are viewed, and laid
    # out for the update, the same way, a local slice of a replicated array).
    grads = clip(grads, grad_norm, parts.clip_norm)
    model, opt_state, ok = guarded_update(
        parts.optimizer, parts.update, parts.all_finite, parts.layout, loss, grad_norm,
        grads, state.opt_state, state.model, mask,
    )  # fmt: skip
    skipped = (~ok).astype(jnp.int32)
    # A skipped step keeps the model state too (a NaN batch leaves the statistics).
    model_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), model_state, state.model_state)
    new_state = TrainState(
        step=state.step + 1,
        model=model,
        opt_state=opt_state,
        key=state.key,
        data_position=state.data_position + jax.tree.leaves(batch)[0].shape[0],
        skipped=state.skipped + skipped,
        model_state=model_state,
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, **metrics}
    # Each array keeps the layout it came in with (the next step's input layout).
    return shard(new_state, parts.mesh), metrics


def _arrays_step(parts: _Parts, state_arrays: PyTree, batch: PyTree, static: _Static) -> Any:
    state, metrics = step_body(parts, eqx.combine(state_arrays, static.tree()), batch)
    return eqx.filter(state, eqx.is_array), metrics


def _mesh_text(mesh: Mesh) -> str:
    return f"{dict(mesh.shape)} of devices {[d.id for d in mesh.devices.flat]}"


def _on_mesh(sharding: Any, mesh: Mesh) -> bool:
    """Whether an array laid out by `sharding` lives on `mesh` (its devices, its axes)."""
    if not isinstance(sharding, NamedSharding):
        return sharding.device_set <= set(mesh.devices.flat)
    other = sharding.mesh
    return other is mesh or (
        isinstance(other, Mesh)
        and other.axis_names == mesh.axis_names
        and other.devices.shape == mesh.devices.shape
        and bool((other.devices == mesh.devices).all())
    )


def _refuse_placement(where: str, sharding: Any, mesh: Mesh) -> None:
    if isinstance(sharding, NamedSharding):
        other = sharding.mesh
        given = "mesh " + (_mesh_text(other) if isinstance(other, Mesh) else str(other))
    else:
        given = f"devices {sorted(d.id for d in sharding.device_set)}"
    raise TrainStepError(
        f"make_train_step: the state's `{where}` is laid out on {given}; this step runs on "
        f"mesh {_mesh_text(mesh)}. The state was built for another layout or other "
        f"devices: build it with init_train_state(..., mesh=...) of the step's mesh, or "
        f"restore its checkpoint onto that mesh (a checkpoint restores across layouts)."
    )


def _leaf_name(state: TrainState, index: int) -> str:
    """The path of `state`'s `index`-th leaf (a box's array named by the box's path)."""
    path, _ = jax.tree_util.tree_leaves_with_path(state)[index]
    name = path_str(path).lstrip(".")
    return name.removesuffix(".value")


def check_state(state: TrainState, mesh: Mesh) -> None:
    """Raise a `TrainStepError` if an array of `state` was donated or lives elsewhere.

    Reads each array's deletion flag and sharding (no device work), before dispatch: a
    donated array given to XLA again crashes the process rather than raising.
    """
    seen: set[int] = set()
    for index, leaf in enumerate(jax.tree.leaves(state)):
        if isinstance(leaf, Tracer) or not isinstance(leaf, jax.Array):
            continue  # abstract (lowering from shapes) or not an array
        if leaf.is_deleted():
            raise TrainStepError(
                f"make_train_step: the state's `{_leaf_name(state, index)}` has been "
                f"deleted: this state was donated to an earlier call of a train step "
                f"(make_train_step(..., donate=True), the default), which consumed its "
                f"buffers. Go on with the state that call returned (`state, metrics = "
                f"step(state, batch)`), or make the step with donate=False to keep the "
                f"state it is given (two states' memory during the step)."
            )
        sharding = leaf.sharding
        if id(sharding) not in seen:
            seen.add(id(sharding))
            if not _on_mesh(sharding, mesh):
                _refuse_placement(_leaf_name(state, index), sharding, mesh)


def _shapes(batch: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), batch)


def check_batch(batch: PyTree, expected: PyTree) -> None:
    """Raise a `TrainStepError` unless `batch` has `expected`'s structure, shapes and dtypes."""
    given = _shapes(batch)
    if jax.tree.structure(given) != jax.tree.structure(expected):
        raise TrainStepError(
            f"make_train_step: this compiled step was compiled for a batch "
            f"{jax.tree.structure(expected)} and was given {jax.tree.structure(given)}."
        )
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(given)):
        if (want.shape, want.dtype) != (got.shape, got.dtype):
            raise TrainStepError(
                f"make_train_step: this compiled step was compiled for a batch whose "
                f"`batch{path_str(path)}` is {describe(want)}, and was given {describe(got)}. "
                f"A compiled step runs one batch shape: compile one for this shape "
                f"(`step.compile(state, batch)`), or call the step itself, which compiles "
                f"for each new shape."
            )


@contextlib.contextmanager
def _quiet_donation() -> Iterator[None]:
    """A context in which XLA's notice of unusable donated buffers is not shown (XLA:CPU
    cannot reuse every donated buffer and says so on each compile)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


class TrainStep(eqx.Module):
    """A jitted `step(state, batch) -> (state, metrics)`, made by `make_train_step`.

    Its parts are fields: `mesh`, `optimizer`, `opt_sharding` (the optimizer state's
    layout, bound to the mesh), `precision` (the precision policy) and `trainable` (the
    trainable filter, a `Trainable`; `None`: every floating array). Each call checks
    the state (not donated already, laid out on the step's mesh) before dispatching the
    program; a new batch shape compiles anew, as `jax.jit` does.
    """

    jitted: Any = eqx.field(static=True)
    mesh: Mesh = eqx.field(static=True)
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    opt_sharding: OptStateSharding = eqx.field(static=True)
    precision: Precision = eqx.field(static=True)
    trainable: Trainable | None = eqx.field(static=True, default=None)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        """One step: `(new_state, metrics)` (see `make_train_step`)."""
        check_state(state, self.mesh)
        arrays, static = _split(state)
        with _quiet_donation():
            new_arrays, metrics = self.jitted(arrays, batch, static)
        return eqx.combine(new_arrays, static.tree()), metrics

    def init_state(self, make_model: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> TrainState:
        """The initial state for this step: `init_train_state` with the step's optimizer,
        mesh, optimizer-state layout and trainable filter (born sharded, mesh-invariant).

        **Arguments:**

        - `make_model`: `key -> model` (or `-> (model, state)`), as `init_train_state`'s.
        - `key`: the run's key.
        """
        return init_train_state(
            make_model, self.optimizer, key, mesh=self.mesh, opt_sharding=self.opt_sharding,
            trainable=self.trainable,
        )  # fmt: skip

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """The step lowered for this state and batch, without running it."""
        check_state(state, self.mesh)
        arrays, static = _split(state)
        return self.jitted.lower(arrays, batch, static)

    def compile(self, state: TrainState, batch: PyTree) -> CompiledTrainStep:
        """The step compiled ahead of time for this state and batch, so that a caller can
        time compilation alone: a `CompiledTrainStep`, called as the step is."""
        with _quiet_donation():
            compiled = self.lower(state, batch).compile()
        return CompiledTrainStep(compiled, self.mesh, _shapes(batch))


class CompiledTrainStep(eqx.Module):
    """A train step compiled for one batch shape: `step(state, batch) -> (state, metrics)`.

    **Fields:**

    - `compiled`: JAX's compiled program (`memory_analysis()`, `as_text()`).
    - `mesh`: the step's mesh.
    - `batch`: the batch it was compiled for (`jax.ShapeDtypeStruct`s); another shape
      raises `TrainStepError`.
    """

    compiled: Any = eqx.field(static=True)
    mesh: Mesh = eqx.field(static=True)
    batch: PyTree = eqx.field(static=True)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        """One step: `(new_state, metrics)` (see `make_train_step`)."""
        check_state(state, self.mesh)
        check_batch(batch, self.batch)
        arrays, static = _split(state)
        with _quiet_donation():
            new_arrays, metrics = self.compiled(arrays, batch)
        return eqx.combine(new_arrays, static.tree()), metrics


@dataclasses.dataclass(frozen=True)
class LocalView:
    """`make_train_step`'s local view (`view="local"` is `LocalView()`), with how batch
    norms take their statistics in it.

    **Fields:**

    - `batch_stats`: `"global"` (default): an `eqx.nn.BatchNorm` (written as on one
      device, `axis_name` the name of the `vmap` over the batch) takes its statistics
      over the examples of the whole micro-batch, across the data axes, as on one device
      (PyTorch's SyncBatchNorm). `"device"`: over each device's own examples (PyTorch
      DDP's BatchNorm); the running statistics stored are then the mean over the devices
      of each device's running statistics. With `grad_accum`, a micro-step's statistics
      are over that micro-step's examples: the m-th slice of each device's block of the
      batch. (The global view has no such choice: its loss sees the whole batch.)

    **Raises:**

    `LayerConfigError` for another `batch_stats`.
    """

    batch_stats: str = "global"

    def __post_init__(self) -> None:
        if self.batch_stats not in ("global", "device"):
            raise LayerConfigError(
                f"LocalView: batch_stats must be 'global' (statistics over the global batch, "
                f"as on one device) or 'device' (each device's own examples), got {self.batch_stats!r}."
            )


def _check_view(view: Any) -> tuple[str, str]:
    """`(view, batch_stats)` of `make_train_step`'s `view`: `"local"`, `"global"` or a
    `LocalView`."""
    if isinstance(view, LocalView):
        return "local", view.batch_stats
    if view in ("local", "global"):
        return view, "global"
    raise LayerConfigError(
        f"make_train_step: view must be 'local', 'global' or a LocalView(batch_stats=...), got {view!r}."
    )


def _check_options(grad_accum: int, view: str, mesh: Mesh, clip_norm: float | None) -> None:
    """Raise for an option of `make_train_step` that cannot work."""
    if grad_accum < 1:
        raise LayerConfigError(f"make_train_step: grad_accum must be >= 1, got {grad_accum}.")
    if view == "global" and any(t == AxisType.Explicit for t in mesh.axis_types):
        raise LayerConfigError(
            f"make_train_step(view='global') needs a mesh of Auto axes, where XLA chooses "
            f"the collectives; this mesh's axes are {dict(zip(mesh.axis_names, mesh.axis_types))}. "
            f"Build it with equishard.make_mesh (Auto by default), or "
            f"jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)."
        )
    if clip_norm is not None and not clip_norm > 0:
        raise TrainStepError(
            f"make_train_step: clip_norm must be a global norm above 0, or None for no "
            f"clipping; got {clip_norm!r} (0 would zero every gradient, a negative norm "
            f"flip them)."
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
    view: str | LocalView = "local",
    opt_sharding: OptStateSharding | None = None,
    precision: Precision | None = None,
    compiler_options: dict[str, Any] | None = None,
    trainable: Trainable | Any = None,
) -> TrainStep:
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
      view, written as on one device: `loss` the mean over the batch it is given,
      `metrics` a dict of scalars (aux losses, dropped tokens, ...). A loss and metrics
      that vary over the data axes (each device's mean over its own examples) are
      averaged over them by the step, inside the differentiated function: the mean of
      equal shards' means, the one-device value. A loss that is already global
      (`pmean`-ed by the function, or a token-weighted mean the function computed over
      all devices, as the GPT's masked loss must) is taken as it is. The same function
      serves both views. (With `shard_map`'s varying-axes check off nothing tells a
      local value from a global one: return the global loss.)
      A loss function with a keyword `index`, `loss_fn(model, batch, key, *, index)`,
      is also given `int32[B_local]`, the global indices of its local examples (in the
      step's whole batch, whatever the micro-batch), and always the step's key: per-
      example keys `equishard.core.example_keys(key, index)` make dropout independent
      of the layout and of `grad_accum`. The plain form gets the step's key, folded
      with the micro-step under `grad_accum` (layout-dependent if split per example).
      For a state holding a model state (`eqx.nn.make_with_state`, see
      `init_train_state`): `loss_fn(model, state, batch, key) -> (loss, (metrics,
      new_state))` (`index` again optional), `new_state` the state its stateful layers
      returned; it is carried to the next step (kept as it was if the step is skipped).
      Only the floating arrays of the model are differentiated, optimized, clipped and
      checked for finiteness; integer and boolean fields are carried unchanged.
    - `optimizer`: an optax optimizer (its `update` is given the parameters).
    - `mesh`: the mesh.
    - `batch_spec`: the spec (or spec tree) of the global batch, e.g. `P(("dp", "fsdp"))`.
    - `grad_accum`: micro-steps per step.
    - `clip_norm`: clip the gradient to this global norm, which must be positive
      (`None`: no clipping).
    - `donate`: donate the old state's buffers to the new state: the state a step was
      given is deleted (calling a step with it again raises `TrainStepError`; keep
      using the state the step returns). `False` keeps it, at the cost of memory for
      two states.
    - `view`: `"local"` (default): phase 1 as above, inside `shard_map`, for models
      whose layers communicate (equishard's layers, `FSDP`). `"global"`: phase 1 on
      the global arrays under `jit`, each array laid out by its spec and XLA (GSPMD)
      inserting the collectives — the shortest route to tensor parallelism for a model
      given specs by path rules that has no collectives of its own. `loss_fn` then sees
      the global batch and returns its mean (a `pmean` over no axes, `()`, is a no-op);
      `index` is `0, ..., B - 1`. The mesh's axes must be `Auto` (what `make_mesh`
      builds). See the "Your own model" guide for what each view costs.
      `LocalView(batch_stats="device")`: the local view, batch norms taking their
      statistics over each device's own examples (see `LocalView`; `"local"` is
      `LocalView()`, statistics over the whole micro-batch as on one device).
    - `opt_sharding`: the optimizer state's layout, a value the step holds: `Mirror()`
      (default, `None`: the state's arrays as their parameters) or `ZeRO1(axes)`
      (optimizer-state sharding over those data axes, e.g. `ZeRO1("dp")`): the
      parameters stay replicated over them, each gradient that the ZeRO rule splits
      (`equishard.sharding.zero_split`) is reduce-scattered over them once per step
      (after the last micro-step) instead of all-reduced, the update runs on the
      optimizer state's shards, and the updated parameters are all-gathered once: the
      same bytes as the all-reduce, and 1/n of the optimizer state per device. Build the
      state with `step.init_state(make_model, key)`, which uses this layout. See the
      training guide.
    - `precision`: the precision policy, a value the step holds: `FULL_PRECISION`
      (default, `None`: no cast) or `MixedPrecision(compute_dtype, gather_dtype,
      reduce_dtype)`: the loss function sees the model with its floating arrays cast to
      `compute_dtype` inside the differentiated function, so the parameters (the master
      weights), their gradients and the optimizer state stay in their own dtype; FSDP
      gathers in `gather_dtype` (`None`: `compute_dtype`; an `FSDP` unit's own dtypes
      take precedence) and gradients are reduced in `reduce_dtype` (`None`: float32, as
      torch FSDP2). The policy decides every cast: the loss function casts nothing. See
      the training guide's "Mixed precision".
    - `trainable`: the trainable filter, a value the step holds (`None`, the default:
      every floating array): a `Trainable`, or what it takes — a callable `(path, leaf)
      -> bool` over the model's arrays (`path` as `equishard.sharding.path_str` writes
      it, e.g. `lambda path, leaf: ".lora" in path`) or a pytree of bools with the
      model's structure (an `eqx.partition` filter spec, prefixes allowed). The other
      arrays are frozen: carried unchanged (bit for bit), no gradient computed (they are
      constants of the differentiated function), no optimizer state, no clipping,
      finiteness check or gradient reduction. Build the state with
      `step.init_state(make_model, key)`, whose optimizer state covers the trainable
      arrays only. See the training guide's "Frozen parameters".
    - `compiler_options`: XLA options for this step's program only, as `jax.jit`'s
      (e.g. `{"xla_backend_optimization_level": 0}`, which on XLA:CPU compiles a step
      with dropout several times faster and runs it more slowly); `None`: XLA's
      defaults and the `XLA_FLAGS` environment variable.

    **Returns:**

    A `TrainStep`, `train_step(state, batch) -> (new_state, metrics)`; `metrics` holds `loss`,
    `grad_norm` (before clipping), `skipped` (1 if this step was not applied: an
    application stopping after N consecutive skips counts these), with a model state in
    the local view `state_diverged` (1 if the loss function returned a state that
    differed across the data axes: the first device's was kept), and `loss_fn`'s
    metrics, all global values. `train_step.lower(state, batch)` lowers it without
    running; `train_step.compile(state, batch)` compiles it ahead of time and returns the
    compiled step (a `CompiledTrainStep`, same signature, for batches of that shape), so
    compilation can be timed apart from the steps; its `.compiled` is JAX's compiled
    program (`memory_analysis()`, `as_text()`).

    **Raises:**

    `LayerConfigError` for an option that cannot work (`grad_accum < 1`, an unknown
    `view`, `ZeRO1` axes not on the mesh, a `precision` or `opt_sharding` that is not
    one; when traced, a `trainable` filter that leaves nothing trainable, does not fit
    the model's structure or marks a non-floating array); `TrainStepError` for
    `clip_norm <= 0` and,
    when the step is called or compiled, for what breaks its contract: a loss function
    that does not return a floating scalar and a dict of metrics, an optimizer whose
    state changes structure or dtype in its update, a state donated already or laid out
    on another mesh or whose optimizer state was built for another trainable set, a
    compiled step given a batch of another shape. `EquishardError`
    for `compiler_options` that XLA refuses, before anything is traced.
    """
    view, batch_stats = _check_view(view)
    _check_options(grad_accum, view, mesh, clip_norm)
    compiler_options = check_compiler_options(compiler_options, "make_train_step")
    layout = bind_opt_sharding(opt_sharding, mesh, "make_train_step")
    data_axes = data_axes_of(batch_spec) if view == "local" else ()
    precision = check_precision(precision, "make_train_step").bind(data_axes)
    trainable = check_trainable(trainable, "make_train_step")
    parts = _Parts(
        loss_fn, optimizer, mesh, batch_spec, grad_accum, clip_norm, view, layout,
        precision, batch_stats, trainable,
    )  # fmt: skip
    # `jax.jit` over the arrays, the rest static, rather than `eqx.filter_jit`: the
    # latter waits for each call to finish (to surface Equinox runtime errors), which
    # would serialise the host's next batch with the device's step.
    jitted = jax.jit(
        functools.partial(_arrays_step, parts),
        static_argnums=2,
        donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options,
    )
    return TrainStep(jitted, mesh, optimizer, layout, precision, trainable)
