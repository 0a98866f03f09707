"""FSDP's re-gather: a custom VJP that gathers a layer's parameters again in the backward
pass and recomputes the layer there, as a `jax.checkpoint` would, with every gather
tied by a data dependency (`after`) to the layer's input or output cotangent so that
no scheduler hoists it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src import config as jax_config, core as jax_core
from jaxtyping import PyTree

from .._axes import cast_varying, mesh_ordered, varying_axes
from ..sharding import (
    is_sharded,
)
from . import _replay
from ._fsdp_gather import fsdp_gather_params
from ._remat import save_collectives_except


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
            skip_units=True,
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
    """The floating outputs' shapes, dtypes and varying axes (for zero cotangents of their
    type: a returned model state varies as the unit's input does)."""
    return jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=jax.typeof(o).manual_axis_type)
        if eqx.is_inexact_array(o) else None,
        out,
    )  # fmt: skip


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
        lambda g, o: cast_varying(jnp.zeros(o.shape, o.dtype), varying_axes(o)) if g is None and o is not None else g,
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
