"""Column- and row-parallel linear layers (Megatron tensor parallelism), with LoRA.

Both layers hold the weight in the PyTorch / `eqx.nn.Linear` layout
`[out_features, in_features]` and run in the local view: inside `shard_map` they see
their own block of the weight, outside any `shard_map` (the axis not bound) they hold the
global weight and compute the plain linear map.

With `stride=s` the split dimension is made of `s` interleaved parts (a fused QKV
weight: `stride=3`). The weight is then stored with that dimension reshaped to
`(s, features / s)` and the second of the two split over the axis, so that device `r`
holds part `r` of each of the `s` pieces, as the PyTorch library's strided
initialisation gives it; `master_weight` reshapes it back.

Gradients follow equishard's [gradient convention](../guides/meshes-and-specs.md#gradients-need-no-synchronisation): the input of a
column layer enters the model-parallel region with `equishard.core.mp_copy` (its
gradient is summed over the axis), the partial sums of a row layer leave it with
`mp_reduce` (an all-reduce whose gradient is the identity), so the gradients equal the
single-device ones with no further synchronisation.
"""

from __future__ import annotations

from typing import Any, TypedDict, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import is_bound
from .._errors import LayerConfigError
from ..core import gather_tokens, mp_copy, mp_gather, mp_reduce, mp_scatter, scatter_tokens
from ..sharding import Sharded
from ._initializers import (
    axis_size,
    check_divisible,
    check_init_type,
    check_local_weight,
    check_partition,
    check_positive,
    check_stride,
    check_token_dim,
    init_weight,
    value_of,
)


def matmul_t(x: Array, w: Array) -> Array:
    """`x @ w.T` for a weight stored `[out, in]`: one `dot_general` contracting the two
    `in` dimensions, no transpose staged (one equation fewer for every transformation of
    a layer's trace; XLA folds the transpose into the product either way)."""
    return jnp.tensordot(x, w, axes=((x.ndim - 1,), (1,)))


def _pieces(a: Array, parts: int) -> list[Array]:
    """`a` split into `parts` equal pieces along its first dimension (itself for one)."""
    return jnp.split(a, parts) if parts > 1 else [a]


def add_bias(y: Array, bias: Array) -> Array:
    """`y + bias` over the last dimension, broadcasting explicitly (rank promotion may raise)."""
    return y + jnp.broadcast_to(bias, y.shape)


def master_of(box: Sharded, shape: tuple[int, ...], axis_name: str) -> Array:
    """The whole global array of `box`, reshaped to `shape`, also inside the parallel region.

    Outside `shard_map` the box already holds the global array. Inside a `shard_map`
    over `axis_name` the dimension its spec splits over the axis is all-gathered
    (`mp_gather`: the gradient flows back to this device's block), as the PyTorch
    library's `master_weight` does.
    """
    value = value_of(box)
    if is_bound(axis_name):
        for dim, entry in enumerate(box.spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if axis_name in names:
                # f32[.., K/n, ..] -> f32[.., K, ..]
                value = mp_gather(value, dim, axis_name=axis_name)
                break
    return jnp.reshape(value, shape)


def split_dim(x: Array, dim: int, stride: int) -> Array:
    """Reshape dimension `dim` of `x` into `(stride, size / stride)` (no-op for stride 1)."""
    if stride == 1:
        return x
    dim = dim % x.ndim
    return x.reshape(*x.shape[:dim], stride, x.shape[dim] // stride, *x.shape[dim + 1 :])


def strided_spec(ndim: int, dim: int, stride: int, axis_name: str) -> P:
    """The spec of an array of rank `ndim` split over `axis_name` on `dim` with `stride`."""
    entries: list[Any] = [None] * ndim
    entries[dim % ndim] = axis_name
    if stride > 1:
        entries.insert(dim % ndim, None)
    return P(*entries)


def gather_strided(y: Array, axis_name: str, stride: int) -> Array:
    """All-gather the last dimension of `y` over `axis_name`, undoing the stride interleave.

    `y` is `[..., F/n]` holding part `r` of each of the `stride` pieces; the result is
    `[..., F]` in the global feature order, replicated over the axis.
    """
    n = axis_size(axis_name)
    # f32[..., F/n] -> f32[..., F], ordered (device, piece, feature)
    y = mp_gather(y, -1, axis_name=axis_name)
    if stride == 1:
        return y
    lead = y.shape[:-1]
    y = y.reshape(*lead, n, stride, -1)
    # (device, piece, feature) -> (piece, device, feature): the global order.
    y = jnp.swapaxes(y, -3, -2)
    return y.reshape(*lead, -1)


def scatter_strided(x: Array, axis_name: str, stride: int) -> Array:
    """Keep this device's part of the last dimension of a replicated `x` (with `stride`).

    The inverse of `gather_strided`: `[..., F]` -> `[..., F/n]`.
    """
    if stride == 1:
        return mp_scatter(x, -1, axis_name=axis_name)
    lead = x.shape[:-1]
    # f32[..., F] -> f32[..., s, F/s] -> f32[..., s, F/(s n)] -> f32[..., F/n]
    x = mp_scatter(x.reshape(*lead, stride, -1), -1, axis_name=axis_name)
    return x.reshape(*lead, -1)


def lora_scale(layer: str, lora_rank: int | None, lora_alpha: float) -> float:
    if lora_rank is None:
        return 0.0
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0:
        raise LayerConfigError(f"{layer}: lora_rank must be a positive integer or None, got {lora_rank!r}.")
    return float(lora_alpha) / lora_rank


class LinearOptions(TypedDict, total=False):
    """The keyword options both parallel linears take (`ColumnParallelLinear(...,
    **options)`, `RowParallelLinear(..., **options)`), spelled as the seeds spell them;
    each may be left out (its default in brackets).

    - `axis_name` (`"tp"`): the mesh axis the split features are split over (the
      outputs of a column layer, the inputs of a row layer).
    - `bias` (`True`): whether to add a bias (a row layer adds it once, after the sum
      over the axis).
    - `init_type` (`"xavier_normal"`): see `equishard.nn.init_weight`.
    - `stride` (`1`): the number of interleaved pieces of the split features (3 for a
      fused QKV projection's outputs); must divide each device's partition.
    - `lora_rank` (`None`): if given, add a LoRA update `scale * B @ A` with `A`
      `[r, in]` and `B` `[out, r]` (zero-initialised, so a fresh layer equals its
      base); the factor that touches the split features is split as the weight is.
    - `lora_alpha` (`1.0`): LoRA's `alpha`; the update is scaled by `alpha / r`.
    - `sequence_parallel` (`False`): the token dimension (-2) of the activations is
      split over the axis (Megatron sequence parallelism): a column layer all-gathers
      its input over it, a row layer reduce-scatters its output.
    - `dtype` (`None`: JAX's default float): the parameters' dtype.
    """

    axis_name: str
    bias: bool
    init_type: str
    stride: int
    lora_rank: int | None
    lora_alpha: float
    sequence_parallel: bool
    dtype: Any


class _ParallelLinear(eqx.Module):
    """What the column- and the row-parallel layer share: the weight `[out, in]` split
    over one of its dimensions (`split`: 0, the outputs, or 1, the inputs), with
    `stride` interleaved pieces; a zero bias; LoRA factors, the one that touches the
    split features split as the weight is; and the options both take."""

    weight: Sharded
    bias: Sharded | None
    lora_a: Sharded | None
    lora_b: Sharded | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    init_type: str = eqx.field(static=True)
    stride: int = eqx.field(static=True)
    lora_rank: int | None = eqx.field(static=True)
    lora_scale: float = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def _init_parameters(
        self, name: str, split: int, in_features: int, out_features: int, *, key: PRNGKeyArray,
        axis_name: str = "tp", bias: bool = True, init_type: str = "xavier_normal", stride: int = 1,
        lora_rank: int | None = None, lora_alpha: float = 1.0, sequence_parallel: bool = False,
        dtype: Any = None,
    ) -> None:  # fmt: skip
        """Check the options and build the arrays (mesh-invariant: the global arrays from
        `key`, then split), for `name` splitting dimension `split` of the weight."""
        check_positive(name, "in_features", in_features)
        check_positive(name, "out_features", out_features)
        check_init_type(name, init_type)
        check_stride(name, ("out_features", "in_features")[split], (out_features, in_features)[split], stride)
        self.lora_scale = lora_scale(name, lora_rank, lora_alpha)
        wkey, _, akey = jax.random.split(key, 3)

        def spread(a: Array, dim: int) -> Sharded:
            # f32[..., F, ...] stored as f32[..., s, F/s, ...] when strided, split over the axis.
            return Sharded(split_dim(a, dim, stride), strided_spec(a.ndim, dim, stride, axis_name))

        # f32[out, in] (global), split over dimension `split`.
        w = init_weight(wkey, (out_features, in_features), init_type, dtype=dtype)
        self.weight = spread(w, split)
        # zero, as the reference's layers (biased_normal too): split like the outputs by a
        # column layer, replicated by a row layer (added once, after the sum)
        b = jnp.zeros((out_features,), w.dtype)
        self.bias = None if not bias else spread(b, 0) if split == 0 else Sharded(b, P())
        self.lora_a = self.lora_b = None
        if lora_rank is not None:
            a = init_weight(akey, (lora_rank, in_features), "kaiming_uniform", dtype=dtype)
            b0 = jnp.zeros((out_features, lora_rank), w.dtype)
            # A f32[r, in] and B f32[out, r]: the factor on the split features split too.
            self.lora_a = spread(a, 1) if split == 1 else Sharded(a, P())
            self.lora_b = spread(b0, 0) if split == 0 else Sharded(b0, P())
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.init_type, self.stride = axis_name, init_type, stride
        self.lora_rank, self.sequence_parallel = lora_rank, sequence_parallel

    @property
    def master_weight(self) -> Array:
        """The full global weight `[out_features, in_features]`; inside `shard_map` gathered."""
        return master_of(self.weight, (self.out_features, self.in_features), self.axis_name)


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer whose weight is split over the output features.

    Each device computes `out_features / n` of the outputs. With `gather_output=True`
    the outputs are all-gathered (replicated result); with `gather_output=False` they
    stay split, ready for a `RowParallelLinear(input_is_parallel=True)`.

    With `sequence_parallel=True` the input arrives split over its token dimension
    (-2) and is all-gathered before the matmul (Megatron sequence parallelism); the
    output then stays split over features.

    Fields: `weight` (`Sharded`, `[out, in]` split `P(axis, None)`, or
    `[stride, out/stride, in]` split `P(None, axis, None)`), `bias` (`[out]` split like
    the outputs, or `None`), `lora_a` (`[r, in]`, replicated) and `lora_b`
    (`[out, r]`, split like the weight), or `None`.
    """

    gather_output: bool = eqx.field(static=True)

    def __init__(
        self, in_features: int, out_features: int, *, gather_output: bool = True,
        key: PRNGKeyArray, **options: Unpack[LinearOptions],
    ):  # fmt: skip
        """**Arguments:**

        - `in_features`, `out_features`: the global sizes.
        - `gather_output`: all-gather the outputs (replicated result) or leave them split.
        - `key`: a PRNG key; the global weight is built from it (mesh-invariant).
        - `options`: `LinearOptions` (`axis_name`, `bias`, `init_type`, `stride`,
          `lora_rank`, `lora_alpha`, `sequence_parallel`, `dtype`): here the outputs are
          split and interleaved by `stride`, LoRA's `A` is replicated and `B` split like
          the weight; `sequence_parallel` requires `gather_output=False`.
        """
        name = "ColumnParallelLinear"
        if options.get("sequence_parallel", False) and gather_output:
            raise LayerConfigError(
                f"{name}: sequence_parallel=True leaves the output split over features; "
                "it requires gather_output=False."
            )
        self._init_parameters(name, 0, in_features, out_features, key=key, **options)
        self.gather_output = gather_output

    @property
    def master_bias(self) -> Array | None:
        """The full global bias `[out_features]` (inside `shard_map` gathered), or `None`."""
        if self.bias is None:
            return None
        return master_of(self.bias, (self.out_features,), self.axis_name)

    def __call__(
        self, x: Float[Array, "... in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out"]:
        """**Arguments:**

        - `x`: the input `[..., in_features]`, replicated over the axis; with
          `sequence_parallel`, `[..., tokens/n, in_features]`.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        `[..., out_features]` with `gather_output`, else this device's
        `[..., out_features/n]` (with `sequence_parallel`: for all tokens).
        """
        (y,) = self._products(x, 1)
        if self.gather_output and is_bound(self.axis_name):
            # f32[..., out/n] -> f32[..., out], replicated over the axis
            y = gather_strided(y, self.axis_name, self.stride)
        return y

    def split(self, x: Float[Array, "... in_features"]) -> tuple[Array, ...]:
        """The layer's output as its `stride` pieces, one product each.

        `(q, k, v)` of a fused QKV projection (`stride=3`), `(gate, up)` of a SwiGLU's
        (`stride=2`): each `[..., out/(stride n)]` (with `gather_output`, replicated
        `[..., out/stride]`), equal to splitting `layer(x)` into `stride` pieces. One
        product against each piece's rows of the weight, not one product split: the
        split's transpose would concatenate the pieces' gradients into one
        `[..., tokens, out/n]` buffer before the input's gradient product (4.7 % of the
        124 M GPT's step on an H200, `benchmarks/RESULTS.md`); here the input's gradient
        sums `stride` products, and only the weight's gradient is concatenated.

        **Arguments:**

        - `x`: as for `__call__`.

        **Returns:**

        A tuple of `stride` arrays.
        """
        ys = self._products(x, self.stride)
        if self.gather_output and is_bound(self.axis_name):
            # f32[..., out/(s n)] -> f32[..., out/s] each, replicated over the axis
            ys = [gather_strided(y, self.axis_name, 1) for y in ys]
        return tuple(ys)

    def _products(self, x: Array, parts: int) -> list[Array]:
        """The checks, the input brought into the region, and `parts` products against
        this device's weight rows in `parts` pieces (LoRA and bias included)."""
        bound = is_bound(self.axis_name)
        n = axis_size(self.axis_name)
        check_partition("ColumnParallelLinear", "out_features", self.out_features, self.stride, self.axis_name, n)
        shape = (self.out_features, self.in_features)
        check_local_weight("ColumnParallelLinear", "weight", value_of(self.weight), shape, self.axis_name, n)
        if self.sequence_parallel and bound:
            check_token_dim("ColumnParallelLinear", x.shape, self.axis_name)
            # f32[..., T/n, in] -> f32[..., T, in]
            x = gather_tokens(x, self.axis_name)
        elif bound:
            # Enter the model-parallel region: the gradient of x is summed over the axis.
            x = mp_copy(x, axis_name=self.axis_name)
        # f32[out/n, in]: this device's rows, the stride pieces concatenated; in `parts`.
        w = _pieces(jnp.reshape(value_of(self.weight), (-1, self.in_features)), parts)
        # f32[..., in] @ f32[in, out/(parts n)] -> f32[..., out/(parts n)] each
        ys = [matmul_t(x, piece) for piece in w]
        if self.lora_a is not None and self.lora_b is not None:
            # f32[..., in] @ f32[in, r]
            xa = matmul_t(x, value_of(self.lora_a))
            b = _pieces(jnp.reshape(value_of(self.lora_b), (-1, value_of(self.lora_b).shape[-1])), parts)
            # f32[..., r] @ f32[r, out/(parts n)] each
            ys = [y + self.lora_scale * matmul_t(xa, piece) for y, piece in zip(ys, b)]
        if self.bias is not None:
            bias = _pieces(jnp.reshape(value_of(self.bias), (-1,)), parts)
            ys = [add_bias(y, piece) for y, piece in zip(ys, bias)]
        return ys


class RowParallelLinear(_ParallelLinear):
    """A linear layer whose weight is split over the input features.

    Each device multiplies its `in_features / n` slice of the input; the partial
    results are summed over the axis (an all-reduce), and the bias is added once,
    after the sum. With `input_is_parallel=True` the input is already split (the output
    of a `ColumnParallelLinear(gather_output=False)` with the same `stride`); otherwise
    each device takes its slice of a replicated input.

    With `sequence_parallel=True` the sum is a reduce-scatter over the token
    dimension (-2): the output is split over tokens (Megatron sequence parallelism).

    Fields: `weight` (`Sharded`, `[out, in]` split `P(None, axis)`, or
    `[out, stride, in/stride]` split `P(None, None, axis)`), `bias` (`[out]`,
    replicated, or `None`), `lora_a` (`[r, in]`, split like the weight's input) and
    `lora_b` (`[out, r]`, replicated), or `None`.
    """

    input_is_parallel: bool = eqx.field(static=True)

    def __init__(
        self, in_features: int, out_features: int, *, input_is_parallel: bool = False,
        key: PRNGKeyArray, **options: Unpack[LinearOptions],
    ):  # fmt: skip
        """**Arguments:**

        - `in_features`, `out_features`: the global sizes.
        - `input_is_parallel`: the input is already split over its features.
        - `key`: a PRNG key; the global weight is built from it (mesh-invariant).
        - `options`: `LinearOptions` (`axis_name`, `bias`, `init_type`, `stride`,
          `lora_rank`, `lora_alpha`, `sequence_parallel`, `dtype`): here the inputs are
          split and interleaved by `stride`, LoRA's `A` is split like the inputs and `B`
          replicated; `sequence_parallel` reduce-scatters the output over its tokens
          instead of all-reducing it.
        """
        self._init_parameters("RowParallelLinear", 1, in_features, out_features, key=key, **options)
        self.input_is_parallel = input_is_parallel

    @property
    def master_bias(self) -> Array | None:
        """The global bias `[out_features]` (replicated: one bias, not one per device), or `None`."""
        return None if self.bias is None else jnp.asarray(value_of(self.bias))

    def __call__(
        self, x: Float[Array, "... in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... out_features"]:
        """**Arguments:**

        - `x`: this device's `[..., in_features/n]` with `input_is_parallel`, else the
          replicated `[..., in_features]`.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        `[..., out_features]`, replicated over the axis; with `sequence_parallel`,
        `[..., tokens/n, out_features]`.
        """
        name = "RowParallelLinear"
        bound = is_bound(self.axis_name)
        n = axis_size(self.axis_name)
        check_partition(name, "in_features", self.in_features, self.stride, self.axis_name, n)
        shape = (self.out_features, self.in_features)
        check_local_weight(name, "weight", value_of(self.weight), shape, self.axis_name, n)
        if not self.input_is_parallel and bound:
            # f32[..., in] -> f32[..., in/n]
            x = scatter_strided(x, self.axis_name, self.stride)
        if self.sequence_parallel and bound:
            check_token_dim(name, x.shape, self.axis_name)
            check_divisible(name, "the token dimension", x.shape[-2], self.axis_name, n)
        # f32[out, in/n]: this device's columns, the stride pieces concatenated.
        w = jnp.reshape(value_of(self.weight), (self.out_features, -1))
        # f32[..., in/n] @ f32[in/n, out] -> f32[..., out] (a partial sum)
        y = matmul_t(x, w)
        if self.lora_a is not None and self.lora_b is not None:
            a = jnp.reshape(value_of(self.lora_a), (value_of(self.lora_a).shape[0], -1))
            # (f32[..., in/n] @ f32[in/n, r]) @ f32[r, out] -> f32[..., out] (partial)
            y = y + self.lora_scale * matmul_t(matmul_t(x, a), value_of(self.lora_b))
        if bound:
            if self.sequence_parallel:
                # f32[..., T, out] (partial) -> f32[..., T/n, out]
                y = scatter_tokens(y, self.axis_name)
            else:
                # f32[..., out] (partial) -> f32[..., out], replicated
                y = mp_reduce(y, axis_name=self.axis_name)
        if self.bias is not None:
            y = add_bias(y, value_of(self.bias))
        return y
