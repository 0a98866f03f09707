"""Initialisation of the tensor-parallel layers, and the checks they share.

The layers build their *global* weights from the key (`init_weight`), so with
`equishard.sharded_init` each device computes exactly its slice of the single-device
weight: initialisation is mesh-invariant. The init types are those of the PyTorch
model-parallel library (`initialize_model_parallel_affine_weight_`); `scale_init` is
the xLSTM library's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .._axes import axis_size as axis_size
from .._errors import LayerConfigError
from ..sharding import Sharded

InitType = Literal[
    "orthogonal",
    "normal",
    "biased_normal",
    "uniform",
    "kaiming_uniform",
    "kaiming_normal",
    "xavier_uniform",
    "xavier_normal",
    "trunc_normal",
    "dirac",
    "constant",
    "zeros",
    "ones",
]
"""The names accepted as `init_type` by the parallel layers."""

INIT_TYPES: tuple[str, ...] = get_args(InitType)
"""Every `InitType`, as a tuple: the thirteen initialisations of the PyTorch library."""


def default_dtype(dtype: Any = None) -> Any:
    """`dtype`, or JAX's default float where it is `None`: every layer's default-dtype rule.

    The default float is float32, or float64 with `jax_enable_x64`.
    """
    return jnp.result_type(float) if dtype is None else dtype


def check_init_type(layer: str, init_type: Any) -> None:
    """Raise a `LayerConfigError` naming `layer` unless `init_type` is an `InitType`."""
    if init_type not in INIT_TYPES:
        raise LayerConfigError(
            f"{layer}: unknown init_type {init_type!r}; expected one of {', '.join(INIT_TYPES)}."
        )


def init_weight(
    key: PRNGKeyArray,
    shape: tuple[int, ...],
    init_type: str = "xavier_normal",
    *,
    dtype: Any = None,
    normal_std: float = 0.01,
    uniform_scale: float = 0.02,
    scale: float = 0.02,
) -> Array:
    """Initialise a weight of `shape` in the PyTorch layout (`[..., out, in]`).

    The fans are `fan_in = shape[-1]` and `fan_out = shape[-2]` (a 1-D shape has
    `fan_in = fan_out = shape[0]`), as `torch.nn.init` computes them for a linear
    layer's `[out_features, in_features]` weight and an embedding's
    `[num_embeddings, embedding_dim]` table.

    **Arguments:**

    - `key`: a PRNG key.
    - `shape`: the global shape.
    - `init_type`: one of
        - `"orthogonal"`: a (semi-)orthogonal matrix;
        - `"normal"`, `"biased_normal"`: N(0, `normal_std`²) (the two differ in the
          bias, see `init_bias`);
        - `"uniform"`: U(0, `uniform_scale`) (torch's `uniform_(w, b=uniform_scale)`);
        - `"kaiming_uniform"`, `"kaiming_normal"`: He et al. with fan-in and gain √2
          (bound √(6/fan_in), standard deviation √(2/fan_in));
        - `"xavier_uniform"`, `"xavier_normal"`: Glorot et al. (bound
          √(6/(fan_in+fan_out)), standard deviation √(2/(fan_in+fan_out)));
        - `"trunc_normal"`: torch's `trunc_normal_(w, std=normal_std)`: N(0,
          `normal_std`²) truncated to [-2, 2] (absolute bounds, torch's defaults);
        - `"dirac"`: the identity (`eye(out, in)`, repeated over leading axes);
        - `"constant"`: every entry `scale`; `"zeros"`; `"ones"`.
    - `dtype`: the dtype (default: JAX's default float).
    - `normal_std`: the standard deviation of `"normal"`, `"biased_normal"`,
      `"trunc_normal"` (the PyTorch library's default, 0.01).
    - `uniform_scale`: the upper bound of `"uniform"` (the PyTorch library's default,
      0.02).
    - `scale`: the value of `"constant"`.

    **Returns:**

    The global weight, an array of `shape`.
    """
    check_init_type("init_weight", init_type)
    dtype = default_dtype(dtype)
    fan_in = shape[-1] if shape else 1
    fan_out = shape[-2] if len(shape) > 1 else fan_in
    if init_type == "orthogonal":
        return jax.nn.initializers.orthogonal()(key, shape, dtype)
    if init_type in ("normal", "biased_normal"):
        return normal_std * jax.random.normal(key, shape, dtype)
    if init_type == "uniform":
        return jax.random.uniform(key, shape, dtype, 0.0, uniform_scale)
    if init_type == "kaiming_uniform":
        bound = math.sqrt(6.0 / fan_in)
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    if init_type == "kaiming_normal":
        return math.sqrt(2.0 / fan_in) * jax.random.normal(key, shape, dtype)
    if init_type == "xavier_uniform":
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    if init_type == "xavier_normal":
        return math.sqrt(2.0 / (fan_in + fan_out)) * jax.random.normal(key, shape, dtype)
    if init_type == "trunc_normal":
        bound = 2.0 / normal_std  # [-2, 2] in units of the standard deviation
        return normal_std * jax.random.truncated_normal(key, -bound, bound, shape, dtype)
    if init_type == "dirac":
        eye = jnp.eye(fan_out, fan_in, dtype=dtype) if len(shape) > 1 else jnp.ones(shape, dtype)
        return jnp.broadcast_to(eye, shape)
    if init_type == "constant":
        return jnp.full(shape, scale, dtype)
    if init_type == "zeros":
        return jnp.zeros(shape, dtype)
    return jnp.ones(shape, dtype)


def init_bias(
    key: PRNGKeyArray,
    shape: tuple[int, ...],
    init_type: str = "xavier_normal",
    *,
    dtype: Any = None,
    normal_std: float = 0.01,
) -> Array:
    """Initialise the bias that goes with a weight initialised by `init_weight`.

    `"biased_normal"` draws the bias from N(0, `normal_std`²), as the PyTorch
    library's `init_` does for a layer's bias; every other init type starts the bias at
    zero. (The parallel layers, like the library's, keep their bias at zero whatever
    the init type.)

    **Arguments:**

    - `key`: a PRNG key.
    - `shape`: the global shape of the bias.
    - `init_type`: the weight's init type.
    - `dtype`: the dtype (default: JAX's default float).
    - `normal_std`: the standard deviation for `"biased_normal"`.

    **Returns:**

    The global bias, an array of `shape`.
    """
    check_init_type("init_bias", init_type)
    dtype = default_dtype(dtype)
    if init_type == "biased_normal":
        return normal_std * jax.random.normal(key, shape, dtype)
    return jnp.zeros(shape, dtype)


def initialize_model_parallel_affine_weight_(
    key: PRNGKeyArray,
    out_features: int,
    in_features: int,
    per_partition_size: int,
    partition_dim: int,
    init_type: str = "xavier_normal",
    stride: int = 1,
    *,
    axis_name: str | None = None,
    dtype: Any = None,
) -> Array:
    """This device's partition of a model-parallel affine weight (`ml.models.parallel`'s function).

    The reference fills a tensor in place; JAX has no in-place update, so this takes a
    key instead of the tensor and returns the partition. As the reference: the master
    weight `[out_features, in_features]` is initialised with `init_type`
    (`init_weight`), split along `partition_dim` into pieces of
    `per_partition_size // stride`, and this device (rank `r` of `world_size`) keeps the
    pieces `r, r + world_size, ...`, concatenated. With one device, the whole weight.
    The same key gives the same master weight on every mesh (mesh-invariant).

    **Arguments:**

    - `key`: a PRNG key (the same on every device).
    - `out_features`, `in_features`: the master weight's shape.
    - `per_partition_size`: the size of this device's partition along `partition_dim`.
    - `partition_dim`: `0` (column-parallel) or `1` / `-1` (row-parallel).
    - `init_type`: see `init_weight`.
    - `stride`: the number of interleaved pieces per partition.
    - `axis_name`: the model-parallel mesh axis (inside `shard_map`), whose index is the
      rank; not needed when the partition is the whole weight.
    - `dtype`: the dtype (default: JAX's default float).

    **Returns:**

    The partition: `[out_features, in_features]` with `partition_dim` of size
    `per_partition_size`.

    **Raises:**

    `LayerConfigError` if the sizes do not split evenly, or the rank is needed and
    `axis_name` is not a bound axis of that world size.
    """
    name = "initialize_model_parallel_affine_weight_"
    check_init_type(name, init_type)
    check_positive(name, "per_partition_size", per_partition_size)
    check_positive(name, "stride", stride)
    shape = (out_features, in_features)
    dim = partition_dim % 2
    full = shape[dim]
    if full % per_partition_size or per_partition_size % stride:
        raise LayerConfigError(
            f"{name}: per_partition_size={per_partition_size} must divide "
            f"{('out_features', 'in_features')[dim]}={full} and be divisible by stride={stride}."
        )
    world_size = full // per_partition_size
    master = init_weight(key, shape, init_type, dtype=dtype)
    if world_size == 1:
        return master
    bound = 1 if axis_name is None else axis_size(axis_name)
    if bound != world_size:
        raise LayerConfigError(
            f"{name}: a partition of {per_partition_size} of {full} needs the rank on a "
            f"model axis of size {world_size}; pass axis_name= a bound mesh axis of that "
            f"size (got {axis_name!r}, size {bound})."
        )
    assert axis_name is not None
    rank = jax.lax.axis_index(axis_name)
    piece = per_partition_size // stride
    # [.., full, ..] -> [.., stride, world, piece, ..]: piece c = s * world + r
    pieces = master.reshape(*shape[:dim], stride, world_size, piece, *shape[dim + 1 :])
    mine = jax.lax.dynamic_index_in_dim(pieces, rank, axis=dim + 1, keepdims=False)
    return mine.reshape(*shape[:dim], per_partition_size, *shape[dim + 1 :])


def scale_init(init_fn: Callable[..., Array], scale_factor: float = 1.0) -> Callable[..., Array]:
    """Scale the output of an initialiser by a constant factor (the xLSTM library's helper).

    **Arguments:**

    - `init_fn`: an initialiser `init_fn(key, shape, dtype) -> array`, e.g. one of
      `jax.nn.initializers`.
    - `scale_factor`: the factor to multiply its output by.

    **Returns:**

    A new initialiser with the same signature whose output is `scale_factor` times
    that of `init_fn`.
    """

    def scaled(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any = None) -> Array:
        dtype = default_dtype(dtype)
        return init_fn(key, shape, dtype) * jnp.asarray(scale_factor, dtype)

    return scaled


# ---------------------------------------------------------------------------------------
# Checks shared by the layers. Construction needs no mesh; what depends on the size of the
# axis is checked at trace time inside `shard_map`, where `jax.lax.axis_size` knows it.
# ---------------------------------------------------------------------------------------


def value_of(box: Any) -> Array:
    """The array a `Sharded` box holds, typed as an `Array` (for the type checker).

    A plain array is its own value: a layer given plain arrays by `equishard.unbox`
    (a one-device copy after `equishard.gather`) computes as with its boxes.
    """
    value: Any = box.value if isinstance(box, Sharded) else box
    return value


def check_local_weight(
    layer: str, what: str, value: Any, global_shape: tuple[int, ...], axis_name: str, n: int
) -> None:
    """Check that this device holds `1/n` of a weight split over `axis_name` (of size `n`).

    A layer whose weight arrives whole inside `shard_map` (its carried spec overridden,
    e.g. `in_specs=P()`) would otherwise compute on the wrong block and return a wrong
    shape silently.

    **Raises:**

    `LayerConfigError` naming the layer, the weight, its local and global shapes and the axis.
    """
    size = int(np.prod(np.shape(value)))
    expected = int(np.prod(global_shape)) // n
    if size != expected:
        raise LayerConfigError(
            f"{layer}: its local {what} has shape {tuple(np.shape(value))}, but with global "
            f"shape {global_shape} split over axis {axis_name!r} of size {n} each device "
            f"should hold {expected} elements. The weight was not split by its spec: pass the "
            f"layer to `filter_shard_map` with the specs it carries (in_specs None for it), "
            f"not an overriding spec such as P()."
        )


def check_positive(layer: str, name: str, value: Any) -> None:
    """Raise a `LayerConfigError` unless `value` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayerConfigError(f"{layer}: {name} must be a positive integer, got {value!r}.")


def check_choice(layer: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise a `LayerConfigError` unless `value` is one of `choices`."""
    if value not in choices:
        expected = ", ".join(repr(c) for c in choices)
        raise LayerConfigError(f"{layer}: unknown {name} {value!r}; expected one of {expected}.")


def check_divisible(layer: str, name: str, value: int, axis_name: str, size: int) -> None:
    """Raise a `LayerConfigError` unless `value` is divisible by the axis size `size`."""
    if value % size:
        raise LayerConfigError(
            f"{layer}: {name}={value} is not divisible by {size}, the size of mesh axis "
            f"{axis_name!r}."
        )


def check_token_dim(layer: str, shape: tuple[int, ...], axis_name: str, *, feature_dim: bool = True) -> None:
    """Raise a `LayerConfigError` unless a sequence-parallel input of `shape` has a token
    dimension (-2 with `feature_dim`, else -1) to split over `axis_name`.

    A model that calls the layer under `jax.vmap` over its tokens (one token at a time,
    as `eqx.nn.Linear` is called) hides that dimension: a layer cannot gather or
    scatter tokens it is given one by one.
    """
    if len(shape) < (2 if feature_dim else 1):
        raise LayerConfigError(
            f"{layer}: sequence_parallel=True needs the token dimension, to gather or "
            f"scatter it over {axis_name!r}, but the layer is called on shape {shape} (one "
            f"token: under jax.vmap over the tokens?). Sequence parallelism needs a model "
            f"that calls the layer on whole sequences; leave sequence_parallel off."
        )


def check_stride(layer: str, name: str, features: int, stride: int) -> None:
    """Raise a `LayerConfigError` unless `stride` is positive and divides `features`."""
    check_positive(layer, "stride", stride)
    if features % stride:
        raise LayerConfigError(
            f"{layer}: stride={stride} does not divide {name}={features}."
        )


def check_partition(layer: str, name: str, features: int, stride: int, axis_name: str, size: int) -> None:
    """Check that `features` splits into `size` partitions, each divisible by `stride`."""
    check_divisible(layer, name, features, axis_name, size)
    if (features // size) % stride:
        raise LayerConfigError(
            f"{layer}: stride={stride} does not divide the partition of {name}={features} "
            f"over the {size} devices of mesh axis {axis_name!r} ({features // size} each)."
        )
