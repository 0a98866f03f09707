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

`TPAsyncDense` in "scatter" mode holds the reference's parameters: one layer per ring
step, `shard_0` ... `shard_{n-1}`, each built by `dense_fn` with the *local* sizes
`(in/n, out/n)` (only `shard_0` with a bias), whose outputs `async_scatter` sums.

Departure (mesh-invariant initialisation): where the reference initialises one kernel
per device (and, in `TPAsyncDense`, one per ring step), here the *global* kernel is drawn
from the key with `scale_init(kernel_init, kernel_init_adjustment)` and each layer
`dense_fn` built holds its part of it; the same key gives the same global layer on
every mesh, and `skip_communication` in "scatter" mode adds one bias (on device 0's
partial sums) where the reference adds one per device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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


def _local_layer(
    layer: str,
    dense_fn: Callable[..., Any],
    model_axis_name: str,
    tp_mode: str,
    kernel_init: Callable[..., Array],
    mesh: Mesh | AbstractMesh | None,
    key: PRNGKeyArray,
) -> tuple[Any, int, str]:
    """The shapes of the layer `dense_fn` builds (nothing drawn), the axis size and the mode."""
    check_choice(layer, "tp_mode", tp_mode, TP_MODES)
    if not callable(dense_fn) or not callable(kernel_init):
        raise LayerConfigError(f"{layer}: dense_fn and kernel_init must be callable.")
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
    return local, n, tp_mode if n > 1 else "none"


def _holding(dense_fn: Callable[..., Any], local: Any, key: PRNGKeyArray, kernel: Any, bias: Any) -> Any:
    """The layer `dense_fn` builds, holding `kernel` and `bias` (boxes, or `None`)."""
    module = dense_fn(kernel_init=lambda *_: jnp.zeros(local.kernel.shape, local.kernel.dtype), key=key)
    module = eqx.tree_at(lambda m: m.kernel, module, kernel)
    if local.bias is not None:
        module = eqx.tree_at(lambda m: m.bias, module, bias, is_leaf=lambda x: x is None)
    return module


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
    local, n, mode = _local_layer(layer, dense_fn, model_axis_name, tp_mode, kernel_init, mesh, key)
    fan_in, fan_out = local.kernel.shape
    # gather: local [in, out/n] of a global [in, out]; scatter: local [in/n, out] of [in, out].
    shape = {"gather": (fan_in, fan_out * n), "scatter": (fan_in * n, fan_out), "none": (fan_in, fan_out)}[mode]
    init = kernel_init if mode == "none" else scale_init(kernel_init, kernel_init_adjustment)
    kernel = init(key, shape, local.kernel.dtype)  # the global kernel: mesh-invariant
    spec = {"gather": P(None, model_axis_name), "scatter": P(model_axis_name, None), "none": P()}[mode]
    bias = None
    if local.bias is not None:
        bias = Sharded(jnp.zeros((shape[1],), local.bias.dtype), P(model_axis_name) if mode != "none" else P())
    return _holding(dense_fn, local, key, Sharded(kernel, spec), bias), mode


# ---------------------------------------------------------------------------
# TPAsyncDense's "scatter" layout: one [in/n, out/n] kernel per ring step
#
# Ring step k's output on device j travels to device j - k - 1 (`async_scatter`); with
# `async_scatter_split` the first `c // 2` of its c = out/n columns go there and the
# others to device j + k + 1. So on device j, shard k's kernel holds the rows of j's
# input block and the columns of those destinations' output blocks of the global kernel.


def _destinations(n: int, k: int, bidirectional: bool) -> tuple[np.ndarray, np.ndarray]:
    """For each device j: where shard `k`'s first and last columns go (static)."""
    j = np.arange(n)
    return (j - k - 1) % n, ((j + k + 1) % n if bidirectional else (j - k - 1) % n)


def _to_shards(kernel: Array, n: int, bidirectional: bool) -> list[Array]:
    """The global kernel `[in, out]` as the `n` ring steps' kernels, each `[in, out/n]`."""
    (fan_in, fan_out), j = kernel.shape, np.arange(n)
    blocks = kernel.reshape(n, fan_in // n, n, fan_out // n)  # [rows' device, r, columns' device, c]
    half = fan_out // n // 2 if bidirectional else fan_out // n
    shards = []
    for k in range(n):
        lo, hi = _destinations(n, k, bidirectional)
        # f32[n, r, c]: on device j, rows of j, columns of lo[j] (first part) / hi[j] (rest)
        shard = jnp.concatenate([blocks[j, :, lo, :half], blocks[j, :, hi, half:]], axis=-1)
        shards.append(shard.reshape(fan_in, fan_out // n))
    return shards


def _from_shards(shards: list[Array], bidirectional: bool) -> Array:
    """The global kernel `[in, out]` the ring steps' kernels hold (`_to_shards` inverted)."""
    n, j = len(shards), np.arange(len(shards))
    fan_in, c = shards[0].shape
    half = c // 2 if bidirectional else c
    blocks = jnp.zeros((n, fan_in // n, n, c), shards[0].dtype)
    for k, shard in enumerate(shards):
        lo, hi = _destinations(n, k, bidirectional)
        shard = shard.reshape(n, fan_in // n, c)
        blocks = blocks.at[j, :, lo, :half].set(shard[..., :half]).at[j, :, hi, half:].set(shard[..., half:])
    return blocks.reshape(fan_in, n * c)


def _bias_to_shard(bias: Array, n: int, bidirectional: bool) -> Array:
    """The global bias `[out]` in the order shard 0's biases sum into it (`[out]`, split over the axis)."""
    b = bias.reshape(n, -1)
    half = b.shape[1] // 2 if bidirectional else b.shape[1]
    lo, hi = _destinations(n, 0, bidirectional)
    return jnp.concatenate([b[lo, :half], b[hi, half:]], axis=-1).reshape(-1)


def _bias_from_shard(stored: Array, n: int, bidirectional: bool) -> Array:
    """The global bias `[out]` from shard 0's stored one (`_bias_to_shard` inverted)."""
    s = stored.reshape(n, -1)
    half = s.shape[1] // 2 if bidirectional else s.shape[1]
    lo, hi = _destinations(n, 0, bidirectional)
    return jnp.zeros_like(s).at[lo, :half].set(s[:, :half]).at[hi, half:].set(s[:, half:]).reshape(-1)


def _build_scatter_shards(
    dense_fn: Callable[..., Any],
    model_axis_name: str,
    kernel_init: Callable[..., Array],
    kernel_init_adjustment: float,
    bidirectional: bool,
    key: PRNGKeyArray,
    mesh: Mesh | AbstractMesh | None,
) -> tuple[dict[str, Any], str]:
    """`TPAsyncDense`'s "scatter" layers `{"shard_k": layer}` (or `({}, mode)` if not scatter)."""
    local, n, mode = _local_layer("TPAsyncDense", dense_fn, model_axis_name, "scatter", kernel_init, mesh, key)
    if mode == "none":
        return {}, mode
    fan_in, c = local.kernel.shape  # the local sizes: in/n, out/n
    # The global kernel f32[in, out]: mesh-invariant.
    kernel = scale_init(kernel_init, kernel_init_adjustment)(key, (fan_in * n, c * n), local.kernel.dtype)
    # Drawn whole before it is dealt into shards: fused with the dealing, XLA:CPU (JAX
    # 0.12) computes some draws an ulp apart from `TPDense`'s with the same key.
    kernel = jax.lax.optimization_barrier(kernel)
    shards = {}
    for k, part in enumerate(_to_shards(kernel, n, bidirectional)):
        bias = None
        if k == 0 and local.bias is not None:  # as the reference: one bias, shard_0's
            bias = Sharded(jnp.zeros((c * n,), local.bias.dtype), P(model_axis_name))
        shards[f"shard_{k}"] = _holding(dense_fn, local, key, Sharded(part, P(model_axis_name, None)), bias)
    return shards, mode


def _check_call(layer: str, x: Array, module: Any, axis: str, mode: str) -> int:
    n = axis_size(axis)
    if mode == "none" or n == 1:
        return n
    kernel = module.kernel.value  # the local block [in_local, out_local]
    expected = kernel.shape[0] // n if mode == "gather" else kernel.shape[0]
    if x.ndim < 1 or x.shape[-1] != expected:
        hint = ""
        if mode == "gather" and x.ndim and x.shape[-1] == kernel.shape[0]:
            # The reference's Flax dense infers its input size; here dense_fn states it.
            hint = (
                f" dense_fn was built with {kernel.shape[0]} input features, one device's "
                f"block; in 'gather' mode it takes the gathered input's size: pass "
                f"dense_fn=functools.partial(equishard.nn.Dense, {x.shape[-1] * n}, "
                f"{kernel.shape[1]}) ({n} x {x.shape[-1]} input features, {kernel.shape[1]} "
                f"output features per device)."
            )
        raise LayerConfigError(
            f"{layer}: tp_mode={mode!r} takes an input split over features, "
            f"[..., {expected}] on each of the {n} devices of {axis!r}; got shape {x.shape}.{hint}"
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
    pairs with device `i - k`'s rows. "scatter": as the reference, one layer per ring
    step (`shard_0` ... `shard_{n-1}`, `dense_fn` with the local sizes `(in/n, out/n)`,
    the bias in `shard_0` only); `shard_k`'s output `[..., out/n]` is summed round the
    ring by `async_scatter` (or `async_scatter_split`, the first `out/n // 2` features
    up the ring and the rest down). Same results as `TPDense` with the same key, but in
    "scatter" mode not the same parameters; no constraint on the number of tokens.

    Fields: `dense`: "gather" and "none": `{dense_name: layer}` as `TPDense`; "scatter":
    `{"shard_0": layer, ..., "shard_{n-1}": layer}`, each `kernel` a `Sharded`
    `[in, out/n]` with spec `P(axis, None)` (device `j`'s block: the rows of its input
    features, the columns of the output features its ring step `k` sends on) and
    `shard_0`'s `bias` a `Sharded` `[out]` with spec `P(axis)` (device `j` holds the bias
    of the output features its ring step 0 sends on).
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

        - `dense_fn`: the constructor of one device's dense layer, configured with the
          local sizes, accepting `kernel_init` and `key`: "gather":
          `functools.partial(equishard.nn.Dense, in, out // n)` (the gathered input's
          size, which Flax infers); "scatter": the reference's
          `functools.partial(equishard.nn.Dense, in // n, out // n)`, one per ring step.
        - `model_axis_name`, `tp_mode`, `kernel_init`, `kernel_init_adjustment`,
          `dense_name`, `key`, `mesh`: as `TPDense` (`dense_name` names the layer in
          "gather" and "none" mode; "scatter" names them `shard_k`, as the reference).
        - `use_bidirectional_gather`: "gather" sends blocks up and down the ring
          (`async_gather_bidirectional`) instead of one way.
        - `use_bidirectional_scatter`: "scatter" sums the first `out/n // 2` output
          features of each ring step up the ring and the rest down (`async_scatter_split`;
          any number of features, as the reference).
        """
        dense, mode = ({}, "none")
        if tp_mode == "scatter":
            dense, mode = _build_scatter_shards(
                dense_fn, model_axis_name, kernel_init, kernel_init_adjustment, use_bidirectional_scatter, key, mesh
            )
        if not dense:
            module, mode = _build(
                "TPAsyncDense", dense_fn, model_axis_name, tp_mode, kernel_init, kernel_init_adjustment, key, mesh
            )
            dense = {dense_name: module}
        self.dense = dense
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
        axis, mode = self.model_axis_name, self.tp_mode
        if mode == "scatter":
            return self._scatter(x) if is_bound(axis) else self._global_scatter(x)
        module = self.dense[self.dense_name]
        if mode == "none" or not is_bound(axis):
            return module(x)
        n = _check_call("TPAsyncDense", x, module, axis, mode)
        kernel = value_of(module.kernel)
        bias = None if module.bias is None else value_of(module.bias)  # f32[out/n]
        i = jax.lax.axis_index(axis)
        gather = async_gather_bidirectional if self.use_bidirectional_gather else async_gather
        xs = gather(x, axis)  # xs[k]: f32[..., in/n] of device i - k
        rows = kernel.shape[0] // n
        # sum_k f32[..., in/n] @ f32[in/n, out/n] (rows of device i - k)
        ys = [xk @ _kernel_block(kernel, 0, ring_index(i, -k, n), rows) for k, xk in enumerate(xs)]
        y = functools.reduce(jnp.add, ys)
        return y if bias is None else add_bias(y, bias)

    def _scatter(self, x: Array) -> Array:
        n = len(self.dense)
        if axis_size(self.model_axis_name) != n:
            raise LayerConfigError(
                f"TPAsyncDense: built for {n} devices of {self.model_axis_name!r} (layers "
                f"shard_0 ... shard_{n - 1}), called where the axis has "
                f"{axis_size(self.model_axis_name)}."
            )
        _check_call("TPAsyncDense", x, self.dense["shard_0"], self.model_axis_name, "scatter")
        # ys[k]: f32[..., in/n] @ f32[in/n, out/n] (+ bias for k = 0), for device i - k - 1
        ys = [self.dense[f"shard_{k}"](x) for k in range(n)]
        scatter = async_scatter_split if self.use_bidirectional_scatter else async_scatter
        return scatter(ys, self.model_axis_name)  # f32[..., out/n]

    def _global_scatter(self, x: Array) -> Array:
        """Outside `shard_map`: the dense layer on the global kernel the shards hold."""
        shards = [self.dense[f"shard_{k}"] for k in range(len(self.dense))]
        bidirectional = self.use_bidirectional_scatter
        kernel = _from_shards([value_of(s.kernel) for s in shards], bidirectional)
        y = x @ kernel  # f32[..., in] @ f32[in, out] -> f32[..., out]
        if shards[0].bias is None:
            return y
        return add_bias(y, _bias_from_shard(value_of(shards[0].bias), len(shards), bidirectional))
