"""Fully-sharded data parallelism (FSDP / ZeRO-3) for any Equinox module.

Parameters are stored split over a data axis (`fsdp_split_params`), all-gathered just
before the module's call (`fsdp_gather_params`) and — by default — gathered again in the backward
pass instead of being kept alive from the forward pass. Under equishard's gradient
convention the transpose of each all-gather is a reduce-scatter, so gradients come out
split like their parameters and equal to the single-device gradients.

The re-gather is a custom VJP that recomputes the layer in its backward pass, as a
`jax.checkpoint` would: both forward and backward
gathers are tied by a data dependency to the layer's input (forward) or output
cotangent (backward), so that no scheduler can hoist them and hold every layer's
parameters whole at once. (With a checkpoint policy alone, XLA:CPU issues all the
gathers at the start of the step, and merges the backward's with the forward's.) The
forward keeps the outputs of the layer's other collectives (a
tensor-parallel all-reduce, an expert all-to-all), so that the recomputation in the
backward pass sends nothing but the FSDP gathers.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src import config as jax_config, core as jax_core
from jax._src.interpreters.batching import BatchTracer
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import (
    AxisName,
    check_local_loss_convention,
    entry_axes,
    is_bound,
    mesh_ordered,
    varying_axes,
)
from .._errors import LayerConfigError
from ..core import gather_array, gather_array_with_mean_grads
from ..sharding import (
    AutoSharded,
    Sharded,
    drop_leading_axis,
    fsdp_split_params,
    is_array_like,
    is_sharded,
    shard_params,
)
from ..sharding._internal import DEFAULT_MIN_WEIGHT_SIZE, map_modules, spec_axes
from . import _replay
from ._remat import save_collectives_except


def _check_dtype(name: str, dtype: Any) -> None:
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise LayerConfigError(f"{name} must be a floating dtype or None, got {dtype!r}.")


def _split_entry(spec: P, axes: tuple[str, ...]) -> tuple[int, Any] | None:
    """The dimension whose spec entry ends with `axes`, and the entry left after them."""
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        if len(names) >= len(axes) and tuple(names[len(names) - len(axes):]) == axes:
            rest = tuple(names[: len(names) - len(axes)])
            return dim, (None if not rest else rest[0] if len(rest) == 1 else rest)
    return None


def fsdp_gather_params(
    params: PyTree,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
    *,
    mean_grads: bool = False,
) -> PyTree:
    """All-gather every array of `params` that is split over `axis_name` (inside `shard_map`).

    equishard's gather of FSDP parameters (the one `FSDP` uses): the backward pass
    reduce-scatters each gathered array's gradient (in `grad_scatter_dtype`) instead of
    all-reducing it, and by default *sums* it — the gradient of the global loss under
    equishard's convention. `gather_params` is xLSTM-JAX's function (mean gradients,
    local-loss convention).

    **Arguments:**

    - `params`: the local blocks of a module or parameter tree, with their boxes.
    - `axis_name`: the FSDP axis, or a tuple of axes. An array is gathered when its spec
      entry for some dimension ends with these axes (`"fsdp"` in `P(("tp", "fsdp"))`:
      the minor axes, whose blocks are contiguous); that entry keeps the others.
    - `gather_dtype`: the dtype to gather in (e.g. `jnp.bfloat16` for mixed precision);
      `None` keeps each array's dtype.
    - `grad_scatter_dtype`: the dtype of the gradient reduce-scatter; `None` uses each
      parameter's dtype.
    - `mean_grads`: `False` (default) for equishard's convention (the function
      differentiated returns the global loss; gradients are summed). `True` for the
      local-loss convention: `gather_array_with_mean_grads`, gradients averaged (only
      under `check_vma=False`; it raises `ConventionError` otherwise).

    Outside `shard_map` (the axis not bound) the arrays are already whole and are only
    unwrapped, so an `FSDP` module also runs in the global view.

    **Returns:**

    `params` with the split arrays whole along `axis_name`: boxes equishard added
    (`AutoSharded`) become plain arrays again, a user's boxes keep their spec minus
    `axis_name`.
    """
    _check_dtype("gather_dtype", gather_dtype)
    _check_dtype("grad_scatter_dtype", grad_scatter_dtype)
    gather = gather_array_with_mean_grads if mean_grads else gather_array

    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    # Outside shard_map (the global view) the arrays are already whole.
    bound = all(is_bound(a) for a in axes)

    def whole(leaf: Any) -> Any:
        if not is_sharded(leaf) or not is_array_like(leaf.value):
            return leaf
        found = _split_entry(leaf.spec, axes)
        value = leaf.value
        spec = leaf.spec
        if found is not None and bound:
            dim, rest = found
            # f32[.., K/fsdp, ..] -> f32[.., K, ..]
            value = gather(value, dim, axes, gather_dtype, grad_scatter_dtype)
            spec = P(*(rest if d == dim else e for d, e in enumerate(spec)))
        if isinstance(leaf, AutoSharded):
            return value
        return Sharded(value, spec, leaf.global_shape)

    return jax.tree.map(whole, params, is_leaf=is_sharded)


def gather_params(
    params: PyTree,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> PyTree:
    """xLSTM-JAX's `gather_params`: all-gather the split arrays, gradients *averaged*.

    As `xlstm_jax.distributed.data_parallel.gather_params`: every array whose spec
    names `axis_name` is all-gathered with `gather_array_with_mean_grads`, so its
    gradient is reduce-scattered and divided by the axis size — the local-loss
    convention (each device differentiates its own loss, then `sync_gradients`), run
    in `shard_map(..., check_vma=False)`. With the varying-axes check on (equishard's
    convention) it raises `ConventionError`; use `fsdp_gather_params` there.

    **Arguments:**

    - `params`: the local blocks, with their boxes (from `shard_params`).
    - `axis_name`: the axis to gather over.
    - `gather_dtype`: the dtype to gather in; `None` keeps each array's dtype.
    - `grad_scatter_dtype`: the dtype of the gradient reduce-scatter; `None` uses each
      parameter's dtype.

    **Returns:**

    `params` with the split arrays whole along `axis_name` (boxes `shard_params` added
    become plain arrays again).

    **Raises:**

    `ConventionError` if called inside `shard_map` with the varying-axes check on.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if all(is_bound(a) for a in axes):
        check_local_loss_convention("gather_params", axes)
    return fsdp_gather_params(params, axis_name, gather_dtype, grad_scatter_dtype, mean_grads=True)


@jax.custom_batching.custom_vmap
def _tie_batched(xs: list[Any], anchor: Any) -> list[Any]:
    zero = anchor * 0
    return [x + zero.astype(x.dtype) for x in xs]


@_tie_batched.def_vmap
def _tie_batched_vmap(axis_size: int, in_batched: Any, xs: list[Any], anchor: Any) -> Any:
    del axis_size
    xs_batched, anchor_batched = in_batched
    # One example's anchor is dependency enough: the parameters stay unbatched, so a
    # `vmap` over the examples outside the unit gathers them once, not once per example.
    return _tie_batched(xs, anchor[0] if anchor_batched else anchor), xs_batched


def _tie(xs: list[Any], anchor: Any) -> list[Any]:
    """`[x + 0 * anchor for x in xs]`: the arrays, made to wait for `anchor` (gradient:
    identity, none). One call for a whole unit's arrays: one custom rule to trace."""
    # What the backward pass needs of each `x`, its varying axes, is known now.
    return _tie_rule(tuple(frozenset(varying_axes(x)) for x in xs), xs, anchor)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tie_rule(x_axes: tuple[frozenset[str], ...], xs: list[Any], anchor: Any) -> list[Any]:
    del x_axes
    return _tie_batched(xs, anchor)


def _tie_fwd(x_axes: tuple[frozenset[str], ...], xs: list[Any], anchor: Any) -> Any:
    del x_axes
    return _tie_batched(xs, anchor), jnp.zeros_like(anchor)


def _tie_bwd(x_axes: tuple[frozenset[str], ...], zero: Any, gs: list[Any]) -> Any:
    def grad(g: Any, axes: frozenset[str]) -> Any:
        # The output varied also over the anchor's axes; `x`'s gradient is summed over
        # them, as the transpose of the implicit cast in `x + 0 * anchor` would.
        extra = mesh_ordered(frozenset(varying_axes(g)) - axes)
        return jax.lax.psum(g, extra) if extra else g

    return [grad(g, axes) for g, axes in zip(gs, x_axes)], zero


_tie_rule.defvjp(_tie_fwd, _tie_bwd)


def after(tree: PyTree, anchor_tree: PyTree, *, unboxed: bool = False) -> PyTree:
    """`tree`, made to depend on `anchor_tree` so that its all-gathers wait for it.

    Without a data dependency a scheduler may issue every layer's all-gather at the start
    of the step (XLA:CPU does), holding all the parameters whole at once. Adding
    `0 * anchor` (one element of the first array of `anchor_tree`, gradient stopped)
    to every floating array in a box of `tree` (with `unboxed`, to every floating
    array) creates the dependency for one add per array; XLA does not fold a float
    times zero (it could be NaN). The result varies over the axes the anchor varies
    over, as the parameter would at its first use with that input anyway.
    """
    anchor = _anchor(anchor_tree)
    return tree if anchor is None else _tied_to(tree, anchor, unboxed=unboxed)


def _anchor(anchor_tree: PyTree) -> Any:
    """One element of the first array of `anchor_tree`, gradient stopped (`None` if it
    has none): what `after` ties to."""
    leaves = [x for x in jax.tree.leaves(anchor_tree) if eqx.is_array(x) and x.size]
    return jax.lax.stop_gradient(leaves[0].ravel()[0]) if leaves else None


def _tied_to(tree: PyTree, anchor: Any, *, unboxed: bool = False, widen: bool = True) -> PyTree:
    """`after` with the anchor given: `tree` made to wait for the scalar `anchor`.

    With `widen=False` only the arrays that already vary over the anchor's axes are tied,
    so that no array changes its type (a jaxpr traced on the untied types still applies).
    """
    anchor_axes = varying_axes(anchor) if not widen else set()

    def tied(leaf: Any) -> bool:
        value = leaf.value if is_sharded(leaf) else leaf
        return (
            eqx.is_inexact_array(value)
            and (unboxed or is_sharded(leaf))
            and (widen or set(anchor_axes) <= set(varying_axes(value)))
        )

    flat, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
    chosen = [i for i, leaf in enumerate(flat) if tied(leaf)]
    if not chosen:
        return tree
    values = _tie([flat[i].value if is_sharded(flat[i]) else flat[i] for i in chosen], anchor)
    for i, value in zip(chosen, values):
        flat[i] = flat[i].with_value(value) if is_sharded(flat[i]) else value
    return jax.tree.unflatten(treedef, flat)


class _GatherConfig(eqx.Module):
    axis_name: str = eqx.field(static=True)
    gather_dtype: Any = eqx.field(static=True)
    grad_scatter_dtype: Any = eqx.field(static=True)
    mean_grads: bool = eqx.field(static=True)

    def call(self, operands: Any, anchor: Any) -> Any:
        """Gather the module's parameters once `anchor` exists, then call it."""
        return self.call_after(operands, _anchor(anchor))

    def call_after(self, operands: Any, anchor: Any) -> Any:
        """`call`, with the scalar `anchor` (`_anchor`'s) given (or `None`: no wait)."""
        module, args, kwargs = operands
        module = fsdp_gather_params(
            module if anchor is None else _tied_to(module, anchor),
            self.axis_name,
            self.gather_dtype,
            self.grad_scatter_dtype,
            mean_grads=self.mean_grads,
        )
        return module(*args, **kwargs)


@eqx.filter_custom_vjp
def _call_regathering(operands: Any, config: _GatherConfig) -> Any:
    # Forward: gather after the inputs exist, call; nothing gathered is kept. Traced as
    # the forward rule traces it (`_trace_call`), so that under differentiation the
    # rule finds the trace made here.
    anchor = _anchor(operands[1:])
    if anchor is None:
        return config.call_after(operands, None)
    traced, flat = _trace_call(operands, anchor, config, leave=True)
    return _outputs(traced, _replay.run(traced.closed, [anchor, *flat], config.axis_name)[0])


class _Traced(eqx.Module):
    """The unit's call as its forward pass traced it, for the backward pass to replay."""

    closed: Any = eqx.field(static=True)  # the call's ClosedJaxpr, on the operands' arrays
    operands: Any = eqx.field(static=True)  # the operands' treedef and non-array leaves
    out: Any = eqx.field(static=True)  # the outputs' treedef and non-array leaves


# The primal of `_call_regathering`, traced inside a `scan`'s body, leaves its trace
# here for the forward rule, which `jax.vjp` calls later on the same types, to take:
# the call is traced once between them. Taken once, so that each differentiation's
# forward rule finds the trace its own primal made (a later trace of the same unit, in
# another step, traces it again).
_TRACED: OrderedDict[Any, _Traced] = OrderedDict()
_TRACED_SIZE = 32


def _trace_key(config: _GatherConfig, treedef: Any, static: Any, types: tuple[Any, ...]) -> Any:
    """What decides `_trace_call`'s jaxpr (`None` if some part is not hashable): the
    operands' structure and non-array leaves, the arrays' types (varying axes
    included), and the context a trace reads (JAX's trace context, the bound axes' sizes,
    the mesh), as `jax.jit`'s cache keys on them."""
    try:
        static_leaves, static_def = jax.tree.flatten(static)
        key = (
            config, treedef, static_def, tuple(static_leaves), types,
            jax_config.trace_context(), jax_core.get_axis_env(), jax.sharding.get_abstract_mesh(),
        )  # fmt: skip
        hash(key)
        return key
    except Exception:  # an unhashable static leaf (a list, an array-valued field)
        return None


def _trace_call(
    operands: Any, anchor: Any, config: _GatherConfig, *, leave: bool = False, take: bool = False
) -> tuple[_Traced, list[Any]]:
    """The unit's call, its parameters tied to `anchor`, traced to a jaxpr of
    `(anchor, *arrays)` (the operands' arrays, returned too). With `leave` the trace is
    left for a later call with `take` on the same types (`_TRACED`)."""
    dynamic, static = eqx.partition(operands, eqx.is_array)
    flat, treedef = jax.tree.flatten(dynamic)
    key = None
    if leave or take:
        key = _trace_key(config, treedef, static, tuple(jax.typeof(x) for x in (anchor, *flat)))
    if take and key is not None:
        try:
            traced = _TRACED.pop(key, None)
        except Exception:  # a static leaf whose `==` raises
            traced = None
        if traced is not None:
            return traced, flat
    out_static = []

    def call(anchor: Any, *flat: Any) -> Any:
        ops = eqx.combine(jax.tree.unflatten(treedef, flat), static)
        out_dynamic, out_nonarray = eqx.partition(config.call_after(ops, anchor), eqx.is_array)
        out_static.append(out_nonarray)
        return out_dynamic

    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(anchor, *flat)
    traced = _Traced(closed, (treedef, static), (jax.tree.structure(out_shape), out_static[0]))
    # A jaxpr that closes over a trace's values is not left for another trace.
    if leave and key is not None and not any(isinstance(c, jax_core.Tracer) for c in closed.consts):
        try:
            _TRACED[key] = traced
        except Exception:  # a static leaf whose `==` raises
            pass
        while len(_TRACED) > _TRACED_SIZE:
            _TRACED.popitem(last=False)
    return traced, flat


def _outputs(traced: _Traced, flat_out: list[Any]) -> Any:
    treedef, static = traced.out
    return eqx.combine(jax.tree.unflatten(treedef, flat_out), static)


@_call_regathering.def_fwd
def _call_regathering_fwd(perturbed: Any, operands: Any, config: _GatherConfig) -> Any:
    del perturbed
    # The call, traced once and run: its residuals are the operands (parameters still
    # split, kept by `filter_custom_vjp`) and the outputs of the unit's other collectives;
    # everything else, the gathered parameters first, is recomputed in the backward pass.
    # As a `jax.checkpoint` keeping those collectives would, under `jax.vjp`, without
    # linearising the call here (see `_replay`).
    anchor = _anchor(operands[1:])
    traced, flat = _trace_call(operands, anchor, config, take=True) if anchor is not None else (None, [])
    if traced is None or not _replay.replayable(traced.closed.jaxpr, config.axis_name):
        # A collective to keep that `_replay` does not replay (one inside a nested
        # jaxpr, a `pmax`), or no input to wait for: the checkpoint keeps it.
        call = eqx.filter_checkpoint(
            lambda ops: config.call(ops, ops[1:]), policy=save_collectives_except(config.axis_name)
        )
        out, vjp = eqx.filter_vjp(call, operands)
        return out, (vjp, _shapes(out))
    flat_out, kept = _replay.run(traced.closed, [anchor, *flat], config.axis_name)
    out = _outputs(traced, flat_out)
    return out, ((traced, kept), _shapes(out))


def _shapes(out: Any) -> Any:
    return jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype) if eqx.is_inexact_array(o) else None,
        out,
    )


def _replayed_grads(
    traced: _Traced,
    kept: list[Any],
    primal: Any,
    operands_of: Callable[[Any], Any],
    grad_out: Any,
    cotangent: Any,
    config: _GatherConfig,
) -> Any:
    """The gradients of `primal`, the unit's operands being `operands_of(primal)`: the
    call replayed from `kept` (`_replay.replay`) and differentiated, its output's
    cotangent `cotangent` (`grad_out` with zeros for the outputs that were not
    differentiated)."""
    operands = operands_of(primal)
    # The recomputation waits for the cotangent: its parameters' gathers (tied to
    # `anchor` in the jaxpr), its inputs and the kept outputs (those that vary as the
    # cotangent does: the jaxpr was traced on their types).
    anchor = _anchor(grad_out)
    anchor = _anchor(cotangent) if anchor is None else anchor
    if jax.typeof(anchor) != traced.closed.in_avals[0]:
        # Not the input's type (another dtype, other varying axes): trace again.
        traced = _trace_call(operands, anchor, config)[0]
    kept = _tied_to(kept, anchor, unboxed=True, widen=False)

    def call(ops: Any) -> Any:
        module, args, kwargs = ops
        ops = (module, *_tied_to((args, kwargs), anchor, unboxed=True, widen=False))
        flat = jax.tree.leaves(eqx.filter(ops, eqx.is_array))
        return _outputs(traced, _replay.replay(traced.closed, [anchor, *flat], config.axis_name, kept))

    diff, nondiff = eqx.partition(primal, eqx.is_inexact_array)

    def differentiable(diff: Any) -> Any:
        return eqx.filter(call(operands_of(eqx.combine(diff, nondiff))), eqx.is_inexact_array)

    def tangent(t: Any) -> Any:
        return jax.jvp(differentiable, (diff,), (t,))[1]

    (grads,) = jax.linear_transpose(tangent, diff)(cotangent)
    return grads


@_call_regathering.def_bwd
def _call_regathering_bwd(
    residuals: Any, grad_out: Any, perturbed: Any, operands: Any, config: _GatherConfig
) -> Any:
    # Backward: gather again — only once this layer's output cotangent exists, so the
    # gathers follow the backward pass layer by layer — and differentiate the call.
    # Tying the residuals to the cotangent delays the recomputation (and its gathers)
    # until then. The all-gather's transpose reduce-scatters the parameters' gradients.
    saved, shapes = residuals
    # Outputs that were not differentiated get a zero cotangent (integers none).
    cotangent = jax.tree.map(
        lambda g, o: jnp.zeros(o.shape, o.dtype) if g is None and o is not None else g,
        grad_out,
        shapes,
        is_leaf=lambda g: g is None,
    )
    if isinstance(saved, tuple) and isinstance(saved[0], _Traced):
        traced, kept = saved
        grads = _replayed_grads(traced, kept, operands, lambda ops: ops, grad_out, cotangent, config)
    else:
        (grads,) = after(saved, grad_out, unboxed=True)(cotangent)
    return jax.tree.map(
        lambda g, p: g if p else None, grads, perturbed, is_leaf=lambda g: g is None
    )


class FSDP(eqx.Module):
    """Wrap any Equinox module so that its parameters are fully sharded.

    ```python
    block = FSDP(MyBlock(..., key=key), "fsdp", mesh=mesh)   # or under sharded_init
    y = block(x)                      # inside filter_shard_map: gathers, calls, frees
    ```

    **Arguments:**

    - `module`: the module (a plain one or one of equishard's layers).
    - `axis_name`: the data axis to split parameters over.
    - `min_weight_size`: arrays with fewer elements stay replicated (equishard's rule,
      `fsdp_split_params`: global sizes, ties to the earlier dimension). A warning
      says when that leaves half of the module's parameter bytes or more replicated.
    - `gather_dtype`, `grad_scatter_dtype`: mixed precision of the gathers and of the
      gradient reduce-scatters (see `fsdp_gather_params`).
    - `regather`: gather the parameters again in the backward pass instead of saving
      the gathered copies from the forward pass (the layer's forward is recomputed
      there too, as under `jax.checkpoint`, except its collectives over other axes —
      tensor-parallel all-reduces, expert all-to-alls — whose outputs are kept from the
      forward pass rather than sent twice). On by default.
    - `mean_grads`: the local-loss convention (gradients averaged, see `gather_params`);
      only under `check_vma=False`, it raises `ConventionError` otherwise.
    - `split_rule`: `"fsdp"` (default, `fsdp_split_params`) or `"xlstm"` (xLSTM-JAX's
      rule, `shard_params`, as `shard_module_params` uses).
    - `mesh`: outside `shard_map`, the mesh whose `axis_name` size decides divisibility
      (default: the ambient mesh, which `sharded_init` sets).
    """

    module: PyTree
    axis_name: str = eqx.field(static=True)
    gather_dtype: Any = eqx.field(static=True)
    grad_scatter_dtype: Any = eqx.field(static=True)
    regather: bool = eqx.field(static=True)
    mean_grads: bool = eqx.field(static=True)

    def __init__(
        self,
        module: PyTree,
        axis_name: str = "fsdp",
        *,
        min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
        gather_dtype: Any = None,
        grad_scatter_dtype: Any = None,
        regather: bool = True,
        mean_grads: bool = False,
        split_rule: str = "fsdp",
        mesh: Mesh | AbstractMesh | None = None,
    ):
        _check_dtype("gather_dtype", gather_dtype)
        _check_dtype("grad_scatter_dtype", grad_scatter_dtype)
        if split_rule not in ("fsdp", "xlstm"):
            raise LayerConfigError(f"FSDP: split_rule must be 'fsdp' or 'xlstm', got {split_rule!r}.")
        split = fsdp_split_params if split_rule == "fsdp" else shard_params
        self.module = split(module, axis_name, min_weight_size, mesh=mesh)
        if split_rule == "fsdp":
            _warn_if_little_is_split(self.module, axis_name, min_weight_size)
        self.axis_name = axis_name
        self.gather_dtype = gather_dtype
        self.grad_scatter_dtype = grad_scatter_dtype
        self.regather = regather
        self.mean_grads = mean_grads

    def __unbox__(self) -> PyTree:
        """The wrapped module, for `equishard.unbox` (its arrays still in their boxes)."""
        return self.module

    def _config(self) -> _GatherConfig:
        return _GatherConfig(
            self.axis_name, self.gather_dtype, self.grad_scatter_dtype, self.mean_grads
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, call the wrapped module with `args`, free them.

        Inside `shard_map` (local view). The gathers wait for the inputs, so one layer's
        parameters are whole at a time; with `regather` the backward pass gathers
        them again after the layer's output cotangent arrives.
        """
        if self.mean_grads and is_bound(self.axis_name):
            check_local_loss_convention("FSDP(mean_grads=True) / shard_module_params", self.axis_name)
        operands = (self.module, args, kwargs)
        return _call_unit_once_per_batch(operands, self._call_unit)

    def gathered(self) -> "_GatheredUnit":
        """This unit with its split parameters all-gathered, to call many times.

        For a caller that runs the unit on many inputs one after another and gathers
        once for all of them (a pipeline schedule gathers each stage's units once per
        step, see the pipeline guide): `fsdp_gather_params` with this unit's options.
        The gathered parameters live until the last call; the gradients of all the
        calls are summed before the gather's transpose reduce-scatters them, once. With
        `regather` each call still recomputes its forward in the backward pass (keeping
        its other collectives' outputs), so a call keeps only its inputs for the
        backward, as the unit's own call does; nothing is gathered again.
        """
        if self.mean_grads and is_bound(self.axis_name):
            check_local_loss_convention("FSDP(mean_grads=True) / shard_module_params", self.axis_name)
        module = fsdp_gather_params(
            self.module, self.axis_name, self.gather_dtype, self.grad_scatter_dtype,
            mean_grads=self.mean_grads,
        )  # fmt: skip
        return _GatheredUnit(module, self.axis_name, self.regather)

    def _call_unit(self, operands: Any) -> Any:
        if self.regather:
            return _call_regathering(operands, self._config())
        return self._config().call(operands, operands[1:])


class _GatheredUnit(eqx.Module):
    """An `FSDP` unit's module with its parameters already gathered (`FSDP.gathered`).

    Calls the module; with `recompute`, under a checkpoint that keeps only the outputs
    of its collectives over axes other than `axis_name` (as `FSDP`'s regathering call).
    """

    module: PyTree
    axis_name: str = eqx.field(static=True)
    recompute: bool = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.recompute:
            return self.module(*args, **kwargs)
        call = eqx.filter_checkpoint(
            lambda m, a, k: m(*a, **k), policy=save_collectives_except(self.axis_name)
        )
        return call(self.module, args, kwargs)


def _call_unit_once_per_batch(operands: Any, call: Callable[[Any], Any]) -> Any:
    """`call(operands)`; under `vmap`s outside the unit (its inputs batch tracers),
    with each `vmap` moved inside it (`_call_once_per_batch`)."""
    if any(isinstance(x, BatchTracer) for x in jax.tree.leaves(operands)):
        return _call_once_per_batch(operands, call)
    return call(operands)


class _OverExamples(eqx.Module):
    """A module called on a batch of inputs, one example at a time (`jax.vmap`)."""

    module: PyTree
    static_inputs: Any = eqx.field(static=True)
    in_axes: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def one(dynamic: Any) -> Any:
            args, kwargs = eqx.combine(dynamic, self.static_inputs)
            return self.module(*args, **kwargs)

        dynamic = eqx.partition((args, kwargs), eqx.is_array)[0]
        return jax.vmap(one, in_axes=(self.in_axes,))(dynamic)


def _call_once_per_batch(operands: Any, call: Callable[[Any], Any]) -> Any:
    """`call(operands)` under a `vmap` outside the unit, with the parameters gathered once.

    A `vmap` over the examples would batch the unit's custom gradient, and with it the
    reduce-scatter of every parameter's gradient: one per example. Its batching rule
    instead moves the `vmap` inside the unit, around the wrapped module's call: the
    parameters are gathered once per batch, their gradients summed over the examples
    and then reduce-scattered once.
    """
    dynamic, static = eqx.partition(operands, eqx.is_array)
    out_static: list[Any] = []

    def arrays_of(out: Any) -> Any:
        arrays, rest = eqx.partition(out, eqx.is_array)
        out_static.append(rest)
        return arrays

    @jax.custom_batching.custom_vmap
    def per_example(dynamic: Any) -> Any:
        return arrays_of(call(eqx.combine(dynamic, static)))

    @per_example.def_vmap
    def over_examples(axis_size: int, in_batched: Any, dynamic: Any) -> Any:
        del axis_size
        module, args, kwargs = eqx.combine(dynamic, static)
        ((module_batched, args_batched, kwargs_batched),) = in_batched
        if any(jax.tree.leaves(module_batched)):  # per-example parameters: nothing to share
            in_axes = jax.tree.map(lambda b: 0 if b else None, in_batched[0])
            out = jax.vmap(lambda d: call(eqx.combine(d, static)), in_axes=(in_axes,))(dynamic)
        else:
            in_axes = jax.tree.map(lambda b: 0 if b else None, (args_batched, kwargs_batched))
            static_inputs = eqx.partition((args, kwargs), eqx.is_array)[1]
            # Further `vmap`s outside this one move inside the unit too.
            out = _call_unit_once_per_batch((_OverExamples(module, static_inputs, in_axes), args, kwargs), call)
        arrays = arrays_of(out)
        return arrays, jax.tree.map(lambda _: True, arrays)

    return eqx.combine(per_example(dynamic), out_static[-1])


def shard_module_params(
    target: PyTree,
    axis_name: str,
    min_weight_size: int = 2**18,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
) -> FSDP:
    """xLSTM-JAX's `shard_module_params`: `target` with its parameters split over `axis_name`.

    As `xlstm_jax.distributed.data_parallel.shard_module_params` (a Flax
    `nn.map_variables` of `shard_params` / `gather_params`): the parameters are split
    by `shard_params`'s rule and all-gathered before each call by `gather_params`, whose
    gradients are averaged over the axis. The reference's recipe — each device's local
    loss differentiated inside `shard_map(..., check_vma=False)`, then
    `sync_gradients(grads, axis_names)` — gives the single-device gradients of the mean
    loss. Under the varying-axes check (equishard's convention) the call raises
    `ConventionError`; use `FSDP` there. (The returned module is an `FSDP` with
    `mean_grads=True, split_rule="xlstm"`.)

    **Arguments:**

    - `target`: any Equinox module (a user's own too).
    - `axis_name`: the axis to split parameters over.
    - `min_weight_size`: arrays of at most this many elements stay replicated.
    - `gather_dtype`, `grad_scatter_dtype`: see `gather_params`.
    - `mesh`: see `FSDP`.

    **Returns:**

    An `FSDP` module: parameters stored split, gathered just before each call.
    """
    return FSDP(
        target,
        axis_name,
        min_weight_size=min_weight_size,
        gather_dtype=gather_dtype,
        grad_scatter_dtype=grad_scatter_dtype,
        mean_grads=True,
        split_rule="xlstm",
        mesh=mesh,
    )


def _split_fraction(module: PyTree, axis_name: str) -> tuple[int, int]:
    """`(split, total)`: parameter bytes split over `axis_name`, and all of them."""
    split = total = 0
    for leaf in jax.tree.leaves(module, is_leaf=is_sharded):
        value = leaf.value if is_sharded(leaf) else leaf
        if not is_array_like(value):
            continue
        shape = leaf.global_shape if is_sharded(leaf) else tuple(value.shape)
        size = math.prod(shape) * value.dtype.itemsize
        total += size
        if is_sharded(leaf) and axis_name in spec_axes(leaf.spec):
            split += size
    return split, total


def _warn_if_little_is_split(module: PyTree, axis_name: str, min_weight_size: int) -> None:
    split, total = _split_fraction(module, axis_name)
    if total and split < total / 2:
        warnings.warn(
            f"FSDP over {axis_name!r} splits {split} of the {total} parameter bytes of "
            f"{type(module).__name__} (min_weight_size={min_weight_size}); the rest stays "
            f"replicated on every device. Lower min_weight_size, or check that the "
            f"arrays' dimensions divide by the axis size.",
            stacklevel=3,
        )


WrapPolicy = type | tuple[type, ...] | str | Callable[[str, Any], bool]


def _policy_matcher(policy: WrapPolicy) -> Callable[[str, Any], bool]:
    if isinstance(policy, str):
        pattern = re.compile(policy)
        return lambda path, node: isinstance(node, eqx.Module) and bool(pattern.search(path))
    if isinstance(policy, type) or (
        isinstance(policy, tuple) and all(isinstance(t, type) for t in policy)
    ):
        return lambda path, node: isinstance(node, policy)
    if callable(policy):
        return policy
    raise LayerConfigError(
        f"fsdp_wrap: policy must be a class, a tuple of classes, a path pattern or a "
        f"function (path, module) -> bool, got {policy!r}."
    )


def fsdp_wrap(
    model: PyTree,
    axis_name: str = "fsdp",
    *,
    policy: WrapPolicy,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    mesh: Mesh | AbstractMesh | None = None,
    **fsdp_options: Any,
) -> PyTree:
    """Wrap the sub-modules of `model` that `policy` selects in `FSDP` units.

    PyTorch FSDP's auto-wrap for Equinox: each selected module (the outermost match;
    nothing inside it is wrapped again) becomes one FSDP unit, whose parameters are
    gathered just before its call and freed after it. Wrap the repeated blocks of a
    model, one unit each, so that one block's parameters are whole at a time:

    ```python
    model = es.nn.fsdp_wrap(model, "fsdp", policy=TransformerBlock, mesh=mesh)
    ```

    The arrays outside every unit (an embedding, a head) are not split: give them specs
    with path rules, or wrap the model's root too (`policy=lambda path, m: path == ""`
    wraps the whole model as one unit). See the "Your own model" guide.

    **Arguments:**

    - `model`: any pytree of Equinox modules (a plain model too).
    - `axis_name`: the data axis to split parameters over.
    - `policy`: which modules become units: a class or a tuple of classes
      (`isinstance`), a regular expression searched in the module's path
      (`r"blocks\\[\\d+\\]"`), or a function `(path, module) -> bool`. Paths are written
      as `blocks[3].attention`; the root's path is `""`.
    - `min_weight_size`: arrays with fewer elements stay replicated (see `FSDP`).
    - `mesh`: outside `shard_map`, the mesh (see `FSDP`).
    - `fsdp_options`: further `FSDP` options (`regather`, `gather_dtype`, ...).

    **Returns:**

    `model` with the selected modules wrapped.

    **Raises:**

    `LayerConfigError` if the policy selects nothing.
    """
    matches = _policy_matcher(policy)
    wrapped: list[str] = []

    def visit(path: str, node: Any, descend: Callable[[Any], Any]) -> Any:
        if not matches(path, node):
            return descend(node)
        wrapped.append(path)
        return FSDP(node, axis_name, min_weight_size=min_weight_size, mesh=mesh, **fsdp_options)

    result = map_modules(model, visit)
    if not wrapped:
        raise LayerConfigError(
            f"fsdp_wrap: policy {policy!r} selects no module of {type(model).__name__}."
        )
    return result


# ---------------------------------------------------------------------------
# A scan over stacked regathering units, differentiated as one


def scannable(layers: PyTree, static: PyTree, x: Any) -> bool:
    """Whether `scan_units` applies: the stacked unit (`eqx.combine(layers, static)`) is
    a regathering `FSDP` unit (not `mean_grads`), and no `vmap` batches the scan. (Its
    call must also keep only top-level linear collectives over other axes, as `_replay`
    replays: the caller knows; `scan_units` raises otherwise.)"""
    unit = eqx.combine(layers, static)
    return (
        isinstance(unit, FSDP)
        and unit.regather
        and not unit.mean_grads
        and not any(isinstance(a, BatchTracer) for a in jax.tree.leaves((layers, x)))
    )


def scan_units(layers: PyTree, static: PyTree, x: Any, *args: Any) -> tuple[Any, Any]:
    """`jax.lax.scan` of `unit(x, *args) -> (x, y)` over stacked `FSDP` units, where
    each layer's `unit` is `drop_leading_axis(eqx.combine(layer, static))`: the new
    `x` and the stacked `y`s. Needs `scannable`.

    The values and gradients of the plain scan, each layer's as `FSDP`'s regathering
    call computes it. Differentiated as one: the forward pass scans the layers running
    each traced call and keeping its input and its other collectives' outputs; the
    backward pass scans them in reverse, replaying and differentiating each call.
    JAX's own differentiation of the scan would linearise its body (with the units'
    forward rules), partially evaluate it and transpose it, each a pass over every
    equation of the layer while the train step is traced.
    """
    return _scanned((layers, x), static, args)


def _unit_of(layer: PyTree, static: PyTree) -> "FSDP":
    """One layer's unit: its slice of the stacked arrays with the stacked unit's rest."""
    return drop_leading_axis(eqx.combine(layer, static))


def _layer_call(static: PyTree, args: tuple[Any, ...]) -> Callable[[Any], Any]:
    """`(layer, x) -> (unit.module, (x, *args), {})`: one layer's operands, as `FSDP`
    calls its module."""

    def operands_of(primal: Any) -> Any:
        layer, x = primal
        return (_unit_of(layer, static).module, (x, *args), {})

    return operands_of


@eqx.filter_custom_vjp
def _scanned(diff: Any, static: PyTree, args: tuple[Any, ...]) -> Any:
    layers, x = diff

    def body(x: Any, layer: Any) -> Any:
        return _unit_of(layer, static)(x, *args)

    return jax.lax.scan(body, x, layers)


@_scanned.def_fwd
def _scanned_fwd(perturbed: Any, diff: Any, static: PyTree, args: tuple[Any, ...]) -> Any:
    del perturbed
    layers, x = diff
    config = static._config()
    operands_of = _layer_call(static, args)
    seen: list[tuple[_Traced, Any]] = []  # the body's trace, for the backward pass

    def body(x: Any, layer: Any) -> Any:
        operands = operands_of((layer, x))
        anchor = _anchor(operands[1:])
        traced, flat = _trace_call(operands, anchor, config)
        traced = _Traced(_replay.unnamed(traced.closed), traced.operands, traced.out)
        if not _replay.replayable(traced.closed.jaxpr, config.axis_name):
            raise LayerConfigError(
                "scan_units: a layer's call has a collective over an axis other than "
                f"{config.axis_name!r} that is nested or not linear; scan the layers with "
                "jax.lax.scan (each FSDP unit then keeps it by a checkpoint)."
            )
        flat_out, kept = _replay.run(traced.closed, [anchor, *flat], config.axis_name)
        x_out, y = out = _outputs(traced, flat_out)
        seen.append((traced, _shapes(out)))
        # The layer's input and its kept collectives' outputs, stacked over the layers.
        return x_out, (y, (x, kept))

    x_out, (ys, saved) = jax.lax.scan(body, x, layers)
    traced, shapes = seen[0]
    return (x_out, ys), (traced, shapes, saved)


@_scanned.def_bwd
def _scanned_bwd(
    residuals: Any, grad_out: Any, perturbed: Any, diff: Any, static: PyTree, args: tuple[Any, ...]
) -> Any:
    traced, shapes, (xs, kept) = residuals
    layers, _ = diff
    config = static._config()
    operands_of = _layer_call(static, args)
    g_x, g_ys = grad_out
    x_shape, y_shapes = shapes
    # A cotangent for every layer output: zeros where none was given (integers none).
    g_x = jnp.zeros(x_shape.shape, x_shape.dtype) if g_x is None else g_x
    g_ys = jax.tree.map(
        lambda g, o: jnp.zeros((xs.shape[0], *o.shape), o.dtype) if g is None and o is not None else g,
        g_ys,
        y_shapes,
        is_leaf=lambda g: g is None,
    )

    def body(g_x: Any, per_layer: Any) -> Any:
        layer, x, kept, g_y = per_layer
        grad = (g_x, g_y)
        g_layer, g_x = _replayed_grads(traced, kept, (layer, x), operands_of, grad, grad, config)
        return g_x, g_layer

    g_x, g_layers = jax.lax.scan(body, g_x, (layers, xs, kept, g_ys), reverse=True)
    return jax.tree.map(
        lambda g, p: g if p else None, (g_layers, g_x), perturbed, is_leaf=lambda g: g is None
    )
