"""A scan over stacked regathering units (`scan_units`), differentiated as one: the
forward traces one unit's call once and the backward replays it per unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src.interpreters.batching import BatchTracer
from jaxtyping import PyTree

from .._errors import LayerConfigError
from ..sharding import (
    drop_leading_axis,
)
from . import _replay
from ._fsdp import FSDP
from ._fsdp_regather import _anchor, _outputs, _replayed_grads, _shapes, _trace_call, _Traced


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
