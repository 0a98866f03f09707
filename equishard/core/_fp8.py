"""fp8 arithmetic for the matrix products: per-tensor scaling, the saturating cast, the
delayed-scaling state, and `x @ w.T` with fp8 operands (e4m3 forward, e5m2 gradients).

Convention (torchao's): a scale multiplies. `quantize(x, s) = fp8(clip(x · s, ±max))`,
`dequantize(q, s) = q · (1 / s)`, and `fp8_scale(amax) = max / (amax · 2^margin)` maps the
largest magnitude to the format's largest finite value. Scales are `float32` scalars.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._axes import cast_varying, mesh_ordered, varying_axes, vmap_names
from .._errors import LayerConfigError

E4M3 = jnp.float8_e4m3fn
"""The forward operands' format: 4 exponent bits, 3 mantissa bits, max 448, no infinities."""

E5M2 = jnp.float8_e5m2
"""The gradients' format: 5 exponent bits, 2 mantissa bits, max 57344."""

_FORMATS = (np.dtype(E4M3), np.dtype(E5M2))
_F32_MAX = float(np.finfo(np.float32).max)


def _format(dtype: Any) -> np.dtype:
    """`dtype` as a NumPy dtype, checked to be one of the two fp8 formats."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = np.dtype(np.object_)
    if dt not in _FORMATS:
        raise LayerConfigError(
            f"fp8 format {dtype!r}: expected jnp.float8_e4m3fn or jnp.float8_e5m2."
        )
    return dt


def fp8_max(dtype: Any) -> float:
    """The largest finite value of the fp8 format `dtype` (448 for e4m3fn, 57344 for e5m2).

    **Raises:**

    `LayerConfigError` if `dtype` is not `jnp.float8_e4m3fn` or `jnp.float8_e5m2`.
    """
    return float(jnp.finfo(_format(dtype)).max)


def fp8_scale(amax: Float[Array, ""] | float, dtype: Any, margin: int = 0) -> Float[Array, ""]:
    """The per-tensor scale that maps `amax` to `dtype`'s largest finite value, with
    `margin` powers of two of headroom: `max / (amax · 2^margin)`.

    **Arguments:**

    - `amax`: the largest magnitude of the tensor (a scalar).
    - `dtype`: `jnp.float8_e4m3fn` or `jnp.float8_e5m2`.
    - `margin`: a non-negative integer; the scaled tensor's largest magnitude is
      `max / 2^margin`.

    **Returns:**

    A `float32` scalar. `1` where `amax` is zero or not finite (nothing to scale, or a
    step the non-finite guard will skip); capped at `float32`'s largest finite value
    where `amax` is so small that the quotient overflows.

    **Raises:**

    `LayerConfigError` for another `dtype` or a negative `margin`.
    """
    top = fp8_max(dtype)
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise LayerConfigError(f"fp8 scale margin={margin!r}: expected an integer >= 0.")
    amax = jnp.asarray(amax, jnp.float32)
    usable = jnp.isfinite(amax) & (amax > 0)
    safe = jnp.where(usable, amax, 1.0)
    scale = jnp.minimum(jnp.float32(top) / (safe * jnp.float32(2.0**margin)), _F32_MAX)
    return jnp.where(usable, scale, jnp.float32(1.0))


def quantize(x: Float[Array, "*shape"], scale: Float[Array, ""] | float, dtype: Any) -> Array:
    """`x · scale` saturated to `±max` of `dtype` and cast to it (round to nearest even).

    The product is formed in `float32`. NaN stays NaN; infinities saturate.

    **Arguments:**

    - `x`: any floating array.
    - `scale`: a scalar, e.g. from `fp8_scale`.
    - `dtype`: `jnp.float8_e4m3fn` or `jnp.float8_e5m2`.

    **Returns:**

    An array of `x`'s shape in `dtype`.

    **Raises:**

    `LayerConfigError` for another `dtype`.
    """
    top = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return jnp.clip(scaled, -top, top).astype(_format(dtype))


def dequantize(q: Array, scale: Float[Array, ""] | float, out_dtype: Any) -> Array:
    """`q · (1 / scale)` in `float32`, cast to `out_dtype`: the inverse of `quantize` up
    to its rounding. (A multiplication by the reciprocal, as XLA:CPU computes a division
    by a scalar, so that every backend rounds alike.)

    **Arguments:**

    - `q`: an fp8 array (any array casts).
    - `scale`: the scale `q` was quantized with.
    - `out_dtype`: the dtype of the result.

    **Returns:**

    An array of `q`'s shape in `out_dtype`.
    """
    return (q.astype(jnp.float32) * _reciprocal(scale)).astype(out_dtype)


def _reciprocal(scale: Array | float) -> Array:
    """`1 / scale` as a float32 scalar."""
    return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


def _amax(x: Array) -> Float[Array, ""]:
    """The largest magnitude of the whole of `x`, as a `float32` scalar: this block's,
    `pmax`-ed over the mesh axes `x` varies along (none outside `shard_map` or without
    the varying-axes check). Invariant along every axis."""
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = mesh_ordered(varying_axes(x))
    return jax.lax.pmax(local, axes) if axes else local


class Fp8Meta(eqx.Module):
    """The delayed-scaling state of one tensor: its recent amaxes and the scale the next
    step quantizes it with. Plain data (it belongs in the train state: checkpointed,
    sharded replicated), advanced by the pure `fp8_meta_update`.

    **Fields:**

    - `amax_history`: `f32[H]`, the last `H` amaxes, newest first (zeros before any).
    - `scale`: `f32[]`, `fp8_scale(max(amax_history), dtype, margin)` (`1` at the start).
    - `dtype`: the fp8 format (static).
    - `margin`: the scale's headroom in powers of two (static).
    """

    amax_history: Float[Array, " H"]
    scale: Float[Array, ""]
    dtype: Any = eqx.field(static=True, default=E4M3)
    margin: int = eqx.field(static=True, default=0)


def fp8_meta(dtype: Any = E4M3, history: int = 16, margin: int = 0) -> Fp8Meta:
    """A fresh `Fp8Meta`: an all-zero amax history of length `history` and scale `1`.

    **Raises:**

    `LayerConfigError` for a `dtype` that is not an fp8 format, `history < 1` or a
    negative `margin`.
    """
    fmt = _format(dtype)
    fp8_scale(0.0, fmt, margin)  # validates the margin
    if isinstance(history, bool) or not isinstance(history, int) or history < 1:
        raise LayerConfigError(f"fp8 amax history={history!r}: expected an integer >= 1.")
    zeros = jnp.zeros((history,), jnp.float32)
    return Fp8Meta(zeros, jnp.ones((), jnp.float32), fmt.type, margin)


def fp8_meta_update(meta: Fp8Meta, new_amax: Float[Array, ""] | float) -> Fp8Meta:
    """`meta` after one more observation: `new_amax` pushed to the front of the history
    (the oldest entry dropped) and the scale recomputed from the history's maximum
    (`fp8_scale(max(history), dtype, margin)`). Where that maximum is zero or not finite
    (a non-finite step stays in the history for `H` updates) the scale is kept, as
    Transformer Engine's and Flax's recipes do.

    **Arguments:**

    - `meta`: the state before this step.
    - `new_amax`: this step's amax of the tensor (a scalar).

    **Returns:**

    The new `Fp8Meta` (same `dtype` and `margin`).
    """
    # f32[H]: [new, h0, ..., h_{H-2}]
    history = jnp.roll(meta.amax_history, 1).at[0].set(jnp.asarray(new_amax, jnp.float32))
    top = jnp.max(history)
    usable = jnp.isfinite(top) & (top > 0)
    scale = jnp.where(usable, fp8_scale(top, meta.dtype, meta.margin), meta.scale)
    return Fp8Meta(history, scale, meta.dtype, meta.margin)


class Fp8MatmulMeta(eqx.Module):
    """The delayed-scaling state of one `fp8_matmul`: the input's, the weight's (both
    e4m3) and the output cotangent's (e5m2).

    **Fields:**

    - `x`, `w`, `grad`: `Fp8Meta`s.
    """

    x: Fp8Meta
    w: Fp8Meta
    grad: Fp8Meta


def fp8_matmul_meta(history: int = 16, margin: int = 0) -> Fp8MatmulMeta:
    """A fresh `Fp8MatmulMeta`: e4m3 states for the input and weight, e5m2 for the
    output cotangent, each with an amax history of length `history`."""
    return Fp8MatmulMeta(
        fp8_meta(E4M3, history, margin),
        fp8_meta(E4M3, history, margin),
        fp8_meta(E5M2, history, margin),
    )


# ---------------------------------------------------------------------------
# The products. x: [..., in], w: [out, in], g (the output cotangent): [..., out].


def _scaled_dot(a: Array, b: Array, dims: Any, sa: Array, sb: Array, out_dtype: Any) -> Array:
    """`dot_general(a, b, dims)` accumulated in float32, times both scales' reciprocals, cast."""
    acc = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return (acc * _reciprocal(sa) * _reciprocal(sb)).astype(out_dtype)


def _forward(x: Array, w: Array, sx: Array, sw: Array) -> tuple[Array, Array, Array]:
    """`y = x @ w.T` with e4m3 operands: `(y [..., out] in x's dtype, qx, qw)`."""
    qx = quantize(x, sx, E4M3)  # f8e4m3[..., in]
    qw = quantize(w, sw, E4M3)  # f8e4m3[out, in]
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return _scaled_dot(qx, qw, dims, sx, sw, x.dtype), qx, qw


def _backward(g: Array, sg: Array, qx: Array, sx: Array, qw: Array, sw: Array, w_dtype: Any):
    """`(dx, dw)` from the e5m2 cotangent and the saved e4m3 operands."""
    qg = quantize(g, sg, E5M2)  # f8e5m2[..., out]
    # dx[..., in] = g[..., out] @ w[out, in]
    dx = _scaled_dot(qg, qw, (((g.ndim - 1,), (0,)), ((), ())), sg, sw, g.dtype)
    # dw[out, in] = sum over the leading dims of g[..., out]ᵀ x[..., in]
    lead = tuple(range(g.ndim - 1))
    dw = _scaled_dot(qg, qx, ((lead, lead), ((), ())), sg, sx, w_dtype)
    return dx, dw


@jax.custom_vjp
def _current(x: Array, w: Array) -> Array:
    return _current_fwd(x, w)[0]


def _current_fwd(x: Array, w: Array) -> tuple[Array, Any]:
    sx, sw = fp8_scale(_amax(x), E4M3), fp8_scale(_amax(w), E4M3)
    y, qx, qw = _forward(x, w, sx, sw)
    return y, (qx, sx, qw, sw, jnp.zeros((0,), w.dtype))


def _current_bwd(res: Any, g: Any) -> tuple[Array, Array]:
    qx, sx, qw, sw, w_like = res
    g = jnp.asarray(g)  # a cotangent may come as a NumPy array
    return _backward(g, fp8_scale(_amax(g), E5M2), qx, sx, qw, sw, w_like.dtype)


_current.defvjp(_current_fwd, _current_bwd)


@jax.custom_vjp
def _delayed(x: Array, w: Array, meta: Fp8MatmulMeta) -> Array:
    return _delayed_fwd(x, w, meta)[0]


def _delayed_fwd(x: Array, w: Array, meta: Fp8MatmulMeta) -> tuple[Array, Any]:
    sx, sw = meta.x.scale, meta.w.scale
    y, qx, qw = _forward(x, w, sx, sw)
    return y, (qx, sx, qw, sw, jnp.zeros((0,), w.dtype), meta, _amax(x), _amax(w))


def _delayed_bwd(res: Any, g: Any) -> tuple[Array, Array, Fp8MatmulMeta]:
    qx, sx, qw, sw, w_like, meta, amax_x, amax_w = res
    g = jnp.asarray(g)  # a cotangent may come as a NumPy array
    dx, dw = _backward(g, meta.grad.scale, qx, sx, qw, sw, w_like.dtype)
    new = Fp8MatmulMeta(
        fp8_meta_update(meta.x, amax_x),
        fp8_meta_update(meta.w, amax_w),
        fp8_meta_update(meta.grad, _amax(g)),
    )
    # the new state is invariant (global amaxes); typed as the state came in
    return dx, dw, jax.tree.map(lambda n, o: cast_varying(n, varying_axes(o)), new, meta)


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def fp8_matmul(
    x: Float[Array, "*batch xk"],
    w: Float[Array, "out wk"],
    meta: Fp8MatmulMeta | None = None,
) -> Float[Array, "*batch out"]:
    """`x @ w.T` for a weight stored `[out, in]`, with fp8 operands: the forward's in
    `float8_e4m3fn`, the output cotangent of both gradient products in `float8_e5m2`;
    every product accumulated in `float32` and multiplied by the reciprocals of its
    operands' scales.

    Scaling is per tensor, over the whole tensor: inside a `shard_map` with the
    varying-axes check each amax is `pmax`-ed over the mesh axes the tensor varies along
    (one scalar all-reduce per tensor), so the scales, and the result, are the one-device
    ones whatever the layout (a split contraction gives partial sums, as a plain product
    does). Without the check, each device scales its own block. Under `jax.vmap` the
    amax is per example (current scaling: a scale per example); delayed scaling refuses
    a `vmap`: call it on the whole batch.

    - current (`meta=None`): each operand's scale is `fp8_scale` of its own amax, computed
      where it is quantized (the cotangent's in the backward pass);
    - delayed (`meta` given): the operands are quantized with `meta`'s scales (from
      earlier steps' amaxes), and this step's amaxes are recorded. **The gradient with
      respect to `meta` is not a gradient**: it is the updated `Fp8MatmulMeta`
      (`fp8_meta_update` of each state with this step's amax). Replace the state with
      it; never hand it to an optimizer. A value outside `±max / scale` saturates.
      Use each state in one `fp8_matmul` call per differentiated function: autodiff
      adds the cotangents of a value used twice (two new states summed), and a product
      that does not reach the loss gives zeros, not the old state.

    The forward saves the quantized operands (fp8) for the backward pass, not `x` and `w`.

    **Arguments:**

    - `x`: `[..., in]`, floating (bf16 or f32).
    - `w`: `[out, in]`, floating.
    - `meta`: `None` for current scaling, or the delayed-scaling state.

    **Returns:**

    `[..., out]` in `x`'s dtype; `dx` comes back in `x`'s dtype, `dw` in `w`'s.

    **Raises:**

    `LayerConfigError` if `w` is not two-dimensional, the `in` dimensions differ, an
    operand is not floating, or `meta` is given under `jax.vmap`.
    """
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise LayerConfigError(
            f"fp8_matmul: x{tuple(x.shape)} @ w{tuple(w.shape)}.T needs w as [out, in] "
            f"with in == x.shape[-1]."
        )
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or np.dtype(a.dtype) in _FORMATS:
            raise LayerConfigError(f"fp8_matmul: {name} is {a.dtype}; expected bf16, f16 or f32.")
    if meta is not None and any(vmap_names(a) for a in (x, w, *jax.tree.leaves(meta))):
        raise LayerConfigError(
            "fp8_matmul with delayed scaling under jax.vmap: each example's new state would "
            "be summed into the state's 'gradient'. Call it on the whole batch (x: "
            f"[..., in], here x{tuple(x.shape)} per example), outside the vmap."
        )
    # Inside shard_map with the varying-axes check: both operands typed varying along the
    # union of their axes outside the custom_vjp, so that the transpose of the cast sums
    # the gradient of an operand replicated where the other is split.
    x, w = cast_varying((x, w), varying_axes(x) | varying_axes(w))
    if meta is None:
        return _current(x, w)
    return _delayed(x, w, meta)
