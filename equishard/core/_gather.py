"""The all-gather of a sharded parameter, under either gradient convention.

- `gather_array`: equishard's convention (the function differentiated returns the
  global loss). The sum over the devices of the axis of each
  device's cotangent is exactly the gradient of the global loss, so the backward pass
  is one reduce-scatter — never an all-reduce.
- `gather_array_with_mean_grads`: xLSTM-JAX's local-loss convention (each device
  differentiates its own local loss); the reduce-scattered gradient is divided by the
  axis size, giving the gradient of the mean of the devices' losses (with the
  varying-axes check on or off, as the reference).

Both gather in `gather_dtype` and reduce-scatter the gradient in `grad_scatter_dtype`,
returning it in the parameter's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from .._axes import (
    AxisName,
    axis_tuple,
    cast_varying,
    combined_axis_size,
    invariant_along,
    vma_checked,
)
from .._errors import ConventionError
from ._collectives import _normalise_dim


def gather_array(
    x: Shaped[Array, "..."],
    axis: int,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> Shaped[Array, "..."]:
    """All-gather a sharded parameter; its gradient is reduce-scattered (summed).

    For equishard's convention (see the module documentation); the twin for xLSTM-JAX's
    local-loss convention is `gather_array_with_mean_grads`.

    Forward: cast to `gather_dtype`, all-gather along `axis`. Backward: cast the
    cotangent to `grad_scatter_dtype`, reduce-scatter it along `axis`, cast back to
    `x`'s dtype.

    **Arguments:**

    - `x`: this device's shard of the parameter.
    - `axis`: the array dimension the parameter is split along.
    - `axis_name`: the mesh axis (or tuple of axes) it is split over.
    - `gather_dtype`: dtype to gather in (e.g. `jnp.bfloat16`); `None` keeps `x`'s.
    - `grad_scatter_dtype`: dtype to reduce-scatter the gradient in; `None` uses the
      gathered dtype.

    **Returns:**

    The gathered parameter: `x.shape` with dimension `axis` multiplied by the axis
    size, in `gather_dtype`.
    """
    axes = axis_tuple(axis_name)
    axis = _normalise_dim(x, axis, "gather_array")
    x = cast_varying(x, axes)
    gathered_dtype = jnp.dtype(gather_dtype if gather_dtype is not None else x.dtype)
    if grad_scatter_dtype is None or jnp.dtype(grad_scatter_dtype) == gathered_dtype:
        # Plain autodiff: the transpose of the all-gather is the reduce-scatter, in the
        # gathered dtype; the cast's transpose casts back.
        # f32[.., K/n, ..] -> f32[.., K, ..]
        return jax.lax.all_gather(x.astype(gathered_dtype), axes, axis=axis, tiled=True)
    return _gather(x, axes, axis, gather_dtype, jnp.dtype(grad_scatter_dtype), jnp.dtype(x.dtype), False)


def gather_array_with_mean_grads(
    x: Shaped[Array, "..."],
    axis: int,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> Shaped[Array, "..."]:
    """All-gather a sharded parameter; its gradient is reduce-scattered and averaged.

    xLSTM-JAX's function, for its *local-loss* convention: each device differentiates
    its own local loss, and the gradient of the shard comes out as the gradient of the
    *mean* of the devices' losses, i.e. the single-device gradient of the mean loss.
    Under `check_vma=False` and with the varying-axes check on alike it computes the
    reference's gradient, `psum_scatter(g) / n` — the check does not change it, as in the
    reference's own test (xlstm-jax `tests/distributed/test_data_parallel.py`). Under
    equishard's own convention (the function differentiated returns the global,
    `pmean`-ed loss) that gradient is `n` times too small: use `gather_array` there.

    Forward: cast to `gather_dtype`, all-gather along `axis`. Backward: cast the
    cotangent to `grad_scatter_dtype`, reduce-scatter it along `axis`, divide by the
    axis size, cast back to `x`'s dtype.

    **Arguments:**

    - `x`: this device's shard of the parameter.
    - `axis`: the array dimension the parameter is sharded along.
    - `axis_name`: the mesh axis (or tuple of axes) it is sharded over.
    - `gather_dtype`: dtype to gather in (e.g. `jnp.bfloat16`); `None` keeps `x`'s.
    - `grad_scatter_dtype`: dtype to reduce-scatter the gradient in; `None` uses `x`'s.

    **Returns:**

    The gathered parameter, `x.shape` with dimension `axis` multiplied by the axis size,
    in `gather_dtype`.

    **Raises:**

    `ConventionError` if, with the varying-axes check on, `x` is typed invariant along
    an axis of `axis_name` (the same on every device of it, not a shard): the
    reference's gradient differs from device to device there, which an invariant
    array's gradient cannot.
    """
    axes = axis_tuple(axis_name)
    check_mean_grads_input("gather_array_with_mean_grads", x, axes)
    axis = _normalise_dim(x, axis, "gather_array_with_mean_grads")
    x = cast_varying(x, axes)
    scatter = jnp.dtype(grad_scatter_dtype if grad_scatter_dtype is not None else x.dtype)
    return _gather(x, axes, axis, gather_dtype, scatter, jnp.dtype(x.dtype), True)


def check_mean_grads_input(fn_name: str, x: Any, axis_name: AxisName) -> None:
    """Raise a `ConventionError` if, under the varying-axes check, `x` is invariant along `axis_name`.

    The mean-gradient gather (xLSTM-JAX's local-loss convention) gives each device the
    reduce-scattered mean of the devices' cotangents, a different block on each device:
    the gradient of a shard, which varies along the axis. An array typed invariant along
    it (replicated: `in_specs` not naming the axis) must get one gradient for all
    devices, so the reference's result cannot be given.
    """
    axes = axis_tuple(axis_name)
    if not vma_checked(axes):
        return
    names = invariant_along(x, axes)
    if names is not None:
        raise ConventionError(
            f"{fn_name}: the array of shape {tuple(jnp.shape(x))} is invariant along "
            f"{names!r} under the varying-axes check (the same on every device: "
            f"replicated, not a shard). Its averaged gradient (xLSTM-JAX's local-loss "
            f"convention) is a different block on each device, which a replicated array's "
            f"gradient cannot be. Pass the shard itself (in_specs naming {names!r}, or "
            f"shard_params inside shard_map), or run shard_map with check_vma=False as the "
            f"reference does. See the guide 'Coming from xLSTM-JAX or PyTorch'."
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _gather(x, axes, axis, gather_dtype, grad_scatter_dtype, param_dtype, mean):
    if gather_dtype is not None:
        x = x.astype(gather_dtype)
    # f32[.., K/n, ..] -> f32[.., K, ..]
    return jax.lax.all_gather(x, axes, axis=axis, tiled=True)


def _gather_fwd(x, axes, axis, gather_dtype, grad_scatter_dtype, param_dtype, mean):
    return _gather(x, axes, axis, gather_dtype, grad_scatter_dtype, param_dtype, mean), None


def _gather_bwd(axes, axis, gather_dtype, grad_scatter_dtype, param_dtype, mean, _, g):
    # f32[.., K, ..] -> f32[.., K/n, ..], summed over the devices of `axes`
    g = jax.lax.psum_scatter(g.astype(grad_scatter_dtype), axes, scatter_dimension=axis, tiled=True)
    if mean:
        g = g / combined_axis_size(axes)
    return (g.astype(param_dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


# ---------------------------------------------------------------------------
# The token dimension of sequence-parallel activations


def gather_tokens(x: Shaped[Array, "*batch tokens dim"], axis_name: AxisName) -> Shaped[Array, "*batch all_tokens dim"]:
    """All-gather the token dimension (-2) of sequence-sharded activations.

    `f32[..., T/n, D] -> f32[..., T, D]`, the blocks in the order of `axis_name`'s
    devices (a tuple names one combined axis, in the order given). Its transpose is a
    reduce-scatter, so the gradient of every device's partial use of the gathered
    activations is summed.

    **Arguments:**

    - `x`: this device's tokens `[..., T/n, D]`.
    - `axis_name`: the mesh axis (or tuple of axes) the tokens are split over.

    **Returns:**

    All tokens `[..., T, D]`, replicated over the axis.
    """
    return jax.lax.all_gather(x, axis_tuple(axis_name), axis=x.ndim - 2, tiled=True)


def scatter_tokens(y: Shaped[Array, "*batch all_tokens dim"], axis_name: AxisName) -> Shaped[Array, "*batch tokens dim"]:
    """Sum partial results over `axis_name` and keep this device's tokens (dimension -2).

    `f32[..., T, D]` (partial sums) `-> f32[..., T/n, D]`: one reduce-scatter, the
    inverse layout of `gather_tokens`.

    **Arguments:**

    - `y`: this device's partial sums `[..., T, D]`.
    - `axis_name`: the mesh axis (or tuple of axes) to sum over and split the tokens over.

    **Returns:**

    This device's tokens of the sum, `[..., T/n, D]`.
    """
    return jax.lax.psum_scatter(y, axis_tuple(axis_name), scatter_dimension=y.ndim - 2, tiled=True)
