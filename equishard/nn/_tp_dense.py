"""`TPDense` and `TPAsyncDense`: the xLSTM library's tensor-parallel dense layers.

As in `xlstm_jax.distributed.tensor_parallel`, activations between layers are split
over their **features** (the last dimension) across `model_axis_name`:

- `tp_mode="gather"`: all-gather the feature-split input `[..., in/n]` over the last
  dimension and apply the dense layer whose output features are split:
  `[..., in] @ [in, out/n] -> [..., out/n]`.
- `tp_mode="scatter"`: apply the dense layer to the feature-split input,
  `[..., in/n] @ [in/n, out] -> [..., out]` (partial sums), and reduce-scatter the
  result over the last dimension: `[..., out/n]`.
- `tp_mode="none"`, or an axis of size 1: a plain dense layer, initialised with
  `kernel_init` without `kernel_init_adjustment`.

A "gather" layer followed by a "scatter" layer is a tensor-parallel MLP whose input and
output are split over features. (equishard's token-split pair is
`ColumnParallelLinear(sequence_parallel=True)` -> `RowParallelLinear(input_is_parallel=True,
sequence_parallel=True)`.)

`dense_fn` is the Equinox counterpart of the reference's: a constructor of the dense
layer *one device holds* — configured with the local sizes, as the reference's Flax
`nn.Dense(features=...)` is — that accepts the keywords `kernel_init` and `key` and
returns a module with a `kernel` `[in, out]` and a `bias` (`[out]` or `None`), such as
`functools.partial(equishard.nn.Dense, in_features_local, out_features_local)`. The
layer lives under `dense_name` in the `dense` dictionary.

Departure (mesh-invariant initialisation): where the reference initialises one kernel
per device (and, in `TPAsyncDense`, one per ring step), here `dense_fn` is called once
and its kernel replaced by the *global* kernel drawn from the key with
`scale_init(kernel_init, kernel_init_adjustment)`; the same key gives the same global
layer on every mesh, and `skip_communication` in "scatter" mode adds one bias (on
device 0's partial sums) where the reference adds one per device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import is_bound
from .._errors import LayerConfigError
from ..core import (
    async_gather,
    async_gather_bidirectional,
    async_scatter,
    async_scatter_split,
    mp_gather,
)
from ..core._internal import ring_index
from ..sharding import Sharded
from ..sharding._internal import axis_size_and_bound as _axis_size
from ._initializers import (
    axis_size,
    check_choice,
    check_divisible,
    check_positive,
    default_dtype,
    scale_init,
    value_of,
)
from ._linear import add_bias

TP_MODES = ("scatter", "gather", "none")
_LECUN_NORMAL = jax.nn.initializers.lecun_normal()  # flax.linen.Dense's default kernel_init


class Dense(eqx.Module):
    """A dense layer in the `flax.linen.Dense` layout: `y = x @ kernel + bias`.

    The default `dense_fn` building block of `TPDense` / `TPAsyncDense`. Its arrays may
    be plain or `Sharded` boxes (inside `shard_map` it uses the local block).

    **Arguments:**

    - `in_features`, `out_features`: the sizes of the kernel `[in_features, out_features]`.
    - `use_bias`: whether to add a bias (initialised at zero, as Flax's).
    - `kernel_init`: an initialiser `(key, shape, dtype) -> array` (default: LeCun
      normal, as Flax's).
    - `dtype`: the parameters' dtype (default: JAX's default float).
    - `key`: a PRNG key.
    """

    kernel: Any
    bias: Any
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        kernel_init: Callable[..., Array] = _LECUN_NORMAL,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        check_positive("Dense", "in_features", in_features)
        check_positive("Dense", "out_features", out_features)
        dtype = default_dtype(dtype)
        self.kernel = kernel_init(key, (in_features, out_features), dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features

    def __call__(self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "... out"]:
        """`x @ kernel + bias` over the last dimension."""
        del key
        kernel = _unbox(self.kernel)
        y = x @ kernel  # f32[..., in] @ f32[in, out] -> f32[..., out]
        return y if self.bias is None else add_bias(y, _unbox(self.bias))


def _unbox(a: Any) -> Array:
    return value_of(a) if isinstance(a, Sharded) else a


def _build(
    layer: str,
    dense_fn: Callable[..., Any],
    model_axis_name: str,
    tp_mode: str,
    kernel_init: Callable[..., Array],
    kernel_init_adjustment: float,
    key: PRNGKeyArray,
    mesh: Mesh | AbstractMesh | None,
) -> Any:
    """The layer `dense_fn` builds, holding the global kernel and bias in `Sharded` boxes."""
    check_choice(layer, "tp_mode", tp_mode, TP_MODES)
    if not callable(dense_fn) or not callable(kernel_init):
        raise LayerConfigError(f"{layer}: dense_fn and kernel_init must be callable.")
    # The local layer's shapes, without drawing any number.
    local = eqx.filter_eval_shape(lambda k: dense_fn(kernel_init=kernel_init, key=k), key)
    if not hasattr(local, "kernel") or not hasattr(local, "bias") or local.kernel.ndim != 2:
        raise LayerConfigError(
            f"{layer}: dense_fn must build a module with a `kernel` [in, out] and a `bias` "
            f"([out] or None), such as equishard.nn.Dense; got {type(local).__name__}."
        )
    n = 1
    if tp_mode != "none":
        try:
            n, _ = _axis_size(model_axis_name, mesh, layer)
        except Exception as err:
            raise LayerConfigError(
                f"{layer}: dense_fn is configured with the local sizes, so the size of "
                f"{model_axis_name!r} is needed to build the global kernel: construct the "
                f"layer under equishard.sharded_init(..., mesh=...), inside shard_map, or pass "
                f"mesh=...."
            ) from err
    mode = tp_mode if n > 1 else "none"
    fan_in, fan_out = local.kernel.shape
    # gather: local [in, out/n] of a global [in, out]; scatter: local [in/n, out] of [in, out].
    shape = {"gather": (fan_in, fan_out * n), "scatter": (fan_in * n, fan_out), "none": (fan_in, fan_out)}[mode]
    init = kernel_init if mode == "none" else scale_init(kernel_init, kernel_init_adjustment)
    kernel = init(key, shape, local.kernel.dtype)  # the global kernel: mesh-invariant
    spec = {"gather": P(None, model_axis_name), "scatter": P(model_axis_name, None), "none": P()}[mode]
    module = dense_fn(kernel_init=lambda *_: jnp.zeros(local.kernel.shape, local.kernel.dtype), key=key)
    module = eqx.tree_at(lambda m: m.kernel, module, Sharded(kernel, spec))
    if local.bias is not None:
        bias = jnp.zeros((shape[1],), local.bias.dtype)
        module = eqx.tree_at(lambda m: m.bias, module, Sharded(bias, P(model_axis_name) if mode != "none" else P()))
    return module, mode


def _check_call(layer: str, x: Array, module: Any, axis: str, mode: str) -> int:
    n = axis_size(axis)
    if mode == "none" or n == 1:
        return n
    kernel = module.kernel.value  # the local block [in_local, out_local]
    expected = kernel.shape[0] // n if mode == "gather" else kernel.shape[0]
    if x.ndim < 1 or x.shape[-1] != expected:
        raise LayerConfigError(
            f"{layer}: tp_mode={mode!r} takes an input split over features, "
            f"[..., {expected}] on each of the {n} devices of {axis!r}; got shape {x.shape}."
        )
    return n


class TPDense(eqx.Module):
    """A dense layer with tensor parallelism over features (`xlstm_jax`'s `TPDense`).

    See the module documentation for the three `tp_mode`s and `dense_fn`. Outside any
    `shard_map` the layer is a plain dense layer on its global kernel.

    Fields: `dense` (`{dense_name: layer}`: the layer `dense_fn` built, whose `kernel`
    is a `Sharded` `[in, out]` with spec `P(None, axis)` for "gather", `P(axis, None)`
    for "scatter", `P()` for "none", and whose `bias` is split over the axis like the
    output features, or `None`).
    """

    dense: dict[str, Any]
    model_axis_name: str = eqx.field(static=True)
    tp_mode: str = eqx.field(static=True)
    skip_communication: bool = eqx.field(static=True)
    dense_name: str = eqx.field(static=True)

    def __init__(
        self,
        dense_fn: Callable[..., Any],
        model_axis_name: str,
        tp_mode: str = "none",
        skip_communication: bool = False,
        kernel_init: Callable[..., Array] = _LECUN_NORMAL,
        kernel_init_adjustment: float = 1.0,
        dense_name: str = "module",
        *,
        key: PRNGKeyArray,
        mesh: Mesh | AbstractMesh | None = None,
    ):
        """**Arguments:**

        - `dense_fn`: the constructor of one device's dense layer, configured with the
          local sizes (`functools.partial(equishard.nn.Dense, in, out // n)` for
          "gather", `(in // n, out)` for "scatter"); it must accept `kernel_init` and
          `key`.
        - `model_axis_name`: the mesh axis of tensor parallelism.
        - `tp_mode`: `"gather"`, `"scatter"` or `"none"`.
        - `skip_communication`: "gather" takes an input already gathered over the
          features, `[..., in]`; "scatter" returns the partial sums `[..., out]`
          unreduced (the bias is part of device 0's partial sum), for a caller that
          reduces them itself.
        - `kernel_init`: an initialiser `(key, shape, dtype) -> array`, applied to the
          global kernel (default: LeCun normal, as `flax.linen.Dense`).
        - `kernel_init_adjustment`: the factor `kernel_init` is scaled by in "gather" and
          "scatter" mode (not in "none" mode, as in the reference).
        - `dense_name`: the key of the layer in `dense`.
        - `key`: a PRNG key.
        - `mesh`: where the size of `model_axis_name` is not known from the context
          (`sharded_init`'s mesh, or a bound axis), the mesh.
        """
        module, mode = _build(
            "TPDense", dense_fn, model_axis_name, tp_mode, kernel_init, kernel_init_adjustment, key, mesh
        )
        self.dense = {dense_name: module}
        self.model_axis_name = model_axis_name
        self.tp_mode = mode
        self.skip_communication = skip_communication
        self.dense_name = dense_name

    def __call__(self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "... out"]:
        """**Arguments:**

        - `x`: "gather": `[..., in/n]` (`[..., in]` with `skip_communication`);
          "scatter": `[..., in/n]`; "none": `[..., in]`.
        - `key`: unused (the Equinox layer convention).

        **Returns:**

        "gather" and "scatter": `[..., out/n]` (the partial sums `[..., out]` with
        `skip_communication` in "scatter"); "none": `[..., out]`.
        """
        del key
        module = self.dense[self.dense_name]
        axis, mode = self.model_axis_name, self.tp_mode
        if mode == "none" or not is_bound(axis):
            return module(x)
        n = axis_size(axis)
        if mode == "gather":
            if not self.skip_communication:
                _check_call("TPDense", x, module, axis, mode)
                # f32[..., in/n] -> f32[..., in]
                x = jax.lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)
            # f32[..., in] @ f32[in, out/n] + f32[out/n] -> f32[..., out/n]
            return module(x)
        _check_call("TPDense", x, module, axis, mode)
        plain = eqx.tree_at(lambda m: m.bias, module, None) if module.bias is not None else module
        y = plain(x)  # f32[..., in/n] @ f32[in/n, out] -> f32[..., out] (partial sums)
        bias = None if module.bias is None else value_of(module.bias)  # f32[out/n]
        if self.skip_communication:
            if bias is None:
                return y
            first = jax.lax.axis_index(axis) == 0
            full = mp_gather(bias, axis_name=axis)  # f32[out]
            return add_bias(y, jnp.where(first, full, jnp.zeros((), y.dtype)))
        check_divisible("TPDense", "the output features", y.shape[-1], axis, n)
        # f32[..., out] -> f32[..., out/n]
        y = jax.lax.psum_scatter(y, axis, scatter_dimension=y.ndim - 1, tiled=True)
        return y if bias is None else add_bias(y, bias)


def _kernel_block(kernel: Array, dim: int, block: Array, size: int) -> Array:
    """Block `block` (traced) of `size` rows (`dim=0`) or columns (`dim=1`) of `kernel`."""
    return jax.lax.dynamic_slice_in_dim(kernel, block * size, size, axis=dim)


class TPAsyncDense(eqx.Module):
    """`TPDense` with communication overlapped with computation (`xlstm_jax`'s `TPAsyncDense`).

    "gather": the feature-split input goes round the ring (`async_gather_bidirectional`,
    or `async_gather`), and each block is multiplied, as it arrives, with the rows of
    this device's kernel columns that belong to the block's device: ring offset `k`
    pairs with device `i - k`'s rows. "scatter": one output block per destination
    device, `x @ kernel[:, columns of device (i - k - 1)]` for ring offset `k`, summed
    round the ring by `async_scatter` (or `async_scatter_split`, halves in both
    directions). Same parameters, same results as `TPDense` with the same key; no
    constraint on the number of tokens.

    Fields: as `TPDense`.
    """

    dense: dict[str, Any]
    model_axis_name: str = eqx.field(static=True)
    tp_mode: str = eqx.field(static=True)
    dense_name: str = eqx.field(static=True)
    use_bidirectional_gather: bool = eqx.field(static=True)
    use_bidirectional_scatter: bool = eqx.field(static=True)

    def __init__(
        self,
        dense_fn: Callable[..., Any],
        model_axis_name: str,
        tp_mode: str = "none",
        kernel_init: Callable[..., Array] = _LECUN_NORMAL,
        kernel_init_adjustment: float = 1.0,
        dense_name: str = "module",
        use_bidirectional_gather: bool = True,
        use_bidirectional_scatter: bool = False,
        *,
        key: PRNGKeyArray,
        mesh: Mesh | AbstractMesh | None = None,
    ):
        """**Arguments:**

        - `dense_fn`, `model_axis_name`, `tp_mode`, `kernel_init`,
          `kernel_init_adjustment`, `dense_name`, `key`, `mesh`: as `TPDense`.
        - `use_bidirectional_gather`: "gather" sends blocks up and down the ring
          (`async_gather_bidirectional`) instead of one way.
        - `use_bidirectional_scatter`: "scatter" sums half blocks in both directions
          (`async_scatter_split`; the local output features must be even).
        """
        module, mode = _build(
            "TPAsyncDense", dense_fn, model_axis_name, tp_mode, kernel_init, kernel_init_adjustment, key, mesh
        )
        self.dense = {dense_name: module}
        self.model_axis_name = model_axis_name
        self.tp_mode = mode
        self.dense_name = dense_name
        self.use_bidirectional_gather = use_bidirectional_gather
        self.use_bidirectional_scatter = use_bidirectional_scatter

    def __call__(self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "... out"]:
        """**Arguments:**

        - `x`: "gather" and "scatter": `[..., in/n]`; "none": `[..., in]`.
        - `key`: unused (the Equinox layer convention).

        **Returns:**

        "gather" and "scatter": `[..., out/n]`; "none": `[..., out]`.
        """
        del key
        module = self.dense[self.dense_name]
        axis, mode = self.model_axis_name, self.tp_mode
        if mode == "none" or not is_bound(axis):
            return module(x)
        n = _check_call("TPAsyncDense", x, module, axis, mode)
        kernel = value_of(module.kernel)
        bias = None if module.bias is None else value_of(module.bias)  # f32[out/n]
        i = jax.lax.axis_index(axis)
        if mode == "gather":
            gather = async_gather_bidirectional if self.use_bidirectional_gather else async_gather
            xs = gather(x, axis)  # xs[k]: f32[..., in/n] of device i - k
            rows = kernel.shape[0] // n
            # sum_k f32[..., in/n] @ f32[in/n, out/n] (rows of device i - k)
            ys = [xk @ _kernel_block(kernel, 0, ring_index(i, -k, n), rows) for k, xk in enumerate(xs)]
            y = functools.reduce(jnp.add, ys)
        else:
            cols = kernel.shape[1] // n
            check_divisible("TPAsyncDense", "out_features", kernel.shape[1], axis, n)
            if self.use_bidirectional_scatter:
                if cols % 2:
                    raise LayerConfigError(
                        f"TPAsyncDense: use_bidirectional_scatter splits each device's "
                        f"{cols} output features in halves; they must be even."
                    )
                half = cols // 2
                # First halves travel up (to device i - k - 1), second halves down (i + k + 1).
                ys = [
                    jnp.concatenate(
                        [
                            x @ _kernel_block(kernel, 1, ring_index(i, -k - 1, n), cols)[:, :half],
                            x @ _kernel_block(kernel, 1, ring_index(i, k + 1, n), cols)[:, half:],
                        ],
                        axis=-1,
                    )
                    for k in range(n)
                ]
                y = async_scatter_split(ys, axis)
            else:
                # ys[k]: f32[..., in/n] @ f32[in/n, out/n], for device i - k - 1
                ys = [x @ _kernel_block(kernel, 1, ring_index(i, -k - 1, n), cols) for k in range(n)]
                y = async_scatter(ys, axis)
        return y if bias is None else add_bias(y, bias)
