"""A tensor-parallel transformer block: RMSNorm, causal attention, MLP.

Two styles over the same tensor-parallel axis, with the same parameters:

- `style="megatron"` (Megatron-LM tensor parallelism): activations `[..., T, D]` are
  replicated over the axis between sub-layers; each column layer's input is copied in
  (its gradient all-reduced), each row layer's output all-reduced.
- `style="sequence"` (tensor + sequence parallelism): activations `[..., T/n, D]` are
  split over the sequence between sub-layers, so norms and residuals run on `1/n` of
  the tokens; the input of each column layer is all-gathered over the sequence and
  the output of each row layer reduce-scattered over it.

Attention heads are split over the axis (`n_heads` must be divisible by its size). With
as many key/value heads as query heads the fused QKV projection is a
`ColumnParallelLinear` with `stride=3`, so each device holds the query, key and value
columns of its own heads; with grouped-query attention (`n_kv_heads < n_heads`) the
queries and the keys/values have separate projections, the key/value heads split over
the axis when it has at most `n_kv_heads` devices and replicated otherwise (see
`ParallelAttention`). Outside any `shard_map` the block is the plain single-device
block on its global parameters.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._axes import cast_varying, is_bound, varying_axes
from .._errors import LayerConfigError
from .._names import CONTEXT_IMPLS, RING, ZIGZAG
from ..core import (
    AttentionMask,
    alltoall_attention,
    attention as attention_kernel,
    dense_attention,
    gather_tokens,
    merge_attention,
    mp_copy,
    ring_attention,
)
from ..sharding import Sharded
from ._fsdp_regather import after
from ._initializers import (
    axis_size,
    check_choice,
    check_divisible,
    check_init_type,
    check_positive,
    default_dtype,
    init_weight,
    value_of,
)
from ._linear import ColumnParallelLinear, RowParallelLinear, add_bias, matmul_t
from ._lora import (
    MLP_TARGETS,
    LoRA,
    LoRAAdapter,
    LoRADropout,
    adapted,
    adapted_row,
    attention_adapters,
    mlp_adapters,
)
from ._moe import MoE, MoEAux
from ._remat import CONTEXT, MLP_IN, MLP_OUT, OUT_PROJ, QKV_PROJ

STYLES = ("megatron", "sequence")


def _check_style(layer: str, style: Any) -> None:
    check_choice(layer, "style", style, STYLES)


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale.

    `y = x / sqrt(mean(x**2) + eps) * weight`, computed in float32 at least. Its
    weight is replicated (`P()`); it runs on whatever tokens the device holds.
    """

    weight: Sharded | None
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, use_weight: bool = True, dtype: Any = None):
        """**Arguments:**

        - `dim`: the size of the normalised (last) dimension.
        - `eps`: added to the mean square.
        - `use_weight`: whether to learn a per-feature scale (initialised at one).
        - `dtype`: the weight's dtype (default: JAX's default float).
        """
        check_positive("RMSNorm", "dim", dim)
        dtype = default_dtype(dtype)
        self.weight = Sharded(jnp.ones((dim,), dtype), P()) if use_weight else None
        self.dim = dim
        self.eps = eps

    def __call__(
        self, x: Float[Array, "... dim"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... dim"]:
        """**Arguments:**

        - `x`: `[..., dim]`.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        The normalised `[..., dim]`, in `x`'s dtype.
        """
        weight = None
        if self.weight is not None:
            # Vary the weight like `x` before it meets `x`, so that its gradient's sum over
            # the axes `x` varies over is one all-reduce of `f32[dim]` (not of the
            # broadcast `f32[..., dim]`, as JAX's automatic cast after a broadcast gives),
            # in float32 (the cast before it) whatever the compute dtype.
            compute = jnp.promote_types(x.dtype, jnp.float32)
            weight = cast_varying(value_of(self.weight).astype(compute), varying_axes(x))
        return _rms_norm(x, weight, self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """`x / sqrt(mean(x**2) + eps) * weight` over the last dimension, in float32 at least,
    returned in `x`'s dtype.

    Its own backward pass, so that what it saves is `x` (already the residual stream's)
    and the inverse RMS `f32[..., 1]`: autodiff would keep a float32 copy of `x`, the
    normalised values and the weight broadcast to every token beside it (measured in
    `benchmarks/RESULTS.md`, "What each layer saves")."""
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x: Array, weight: Array | None, eps: float) -> tuple[Array, Any]:
    # bf16[..., D] -> f32[..., D]; the statistics f32[..., 1]
    h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    inv = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = h * inv
    if weight is not None:
        h = h * jnp.broadcast_to(weight.astype(h.dtype), h.shape)
    return h.astype(x.dtype), (x, inv, weight)


def _rms_norm_bwd(eps: float, residuals: Any, dy: Array) -> tuple[Array, Array | None]:
    x, inv, weight = residuals
    h = x.astype(inv.dtype) * inv  # f32[..., D], the normalised values made again
    g = dy.astype(h.dtype)
    dweight = None
    if weight is not None:
        # f32[..., D] -> f32[D]: summed over every token this device holds.
        dweight = jnp.sum(g * h, axis=tuple(range(h.ndim - 1))).astype(weight.dtype)
        g = g * jnp.broadcast_to(weight.astype(h.dtype), g.shape)
    # d/dx of (x * inv(x)) against g: inv * (g - h * mean(g * h)).
    dx = inv * (g - h * jnp.mean(g * h, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dweight


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rotary_embedding(
    x: Float[Array, "... seq heads head_dim"],
    base: float = 10000.0,
    *,
    positions: Int[Array, "... seq"] | None = None,
) -> Float[Array, "... seq heads head_dim"]:
    """Rotate query or key features by their position (RoPE, the half-split variant).

    Position `p` and frequency `i` rotate the pair `(x[..., i], x[..., i + head_dim/2])`
    by the angle `p * base**(-2i/head_dim)`.

    **Arguments:**

    - `x`: `[..., seq, heads, head_dim]` with an even `head_dim`.
    - `base`: the frequency base.
    - `positions`: the integer position of each token, `[seq]` or `[..., seq]` (a
      sequence split over devices or permuted, see the "Long sequences" guide);
      default `0, 1, ..., seq - 1`.

    **Returns:**

    The rotated array, same shape and dtype.
    """
    return _rotate(x, *_rotary_table(x.shape[-3], x.shape[-1], base, positions))


def _rotary_table(
    seq: int, head_dim: int, base: float, positions: Int[Array, "... seq"] | None,
    scaling: tuple[float, float, float, float] | None = None,
) -> tuple[Array, Array]:  # fmt: skip
    """The cosines and sines of `rotary_embedding`'s angles, each `f32[..., T, 1, hd/2]`
    (one table for the queries and the keys of a layer); `scaling` as `ParallelAttention`'s
    `rotary_scaling`."""
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * (2.0 / head_dim))
    if scaling is not None:
        # As `transformers` computes them (1 / base**(2i/d)), then scaled.
        inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
        inv_freq = _llama3_frequencies(inv_freq, *scaling)
    if positions is None:
        positions = jnp.arange(seq, dtype=jnp.int32)
    if positions.shape[-1] != seq:
        raise LayerConfigError(
            f"rotary_embedding: positions of shape {positions.shape} for a sequence of {seq} tokens."
        )
    # f32[..., T, 1, hd/2]
    pos = positions.astype(jnp.float32)[..., :, None]
    angles = (pos * jnp.broadcast_to(inv_freq, (*pos.shape[:-1], half)))[..., :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def _llama3_frequencies(
    inv_freq: Array, factor: float, low_freq_factor: float, high_freq_factor: float, original_length: float
) -> Array:
    """Llama 3.1's rotary frequencies: wavelengths longer than `original_length /
    low_freq_factor` divided by `factor`, shorter than `original_length / high_freq_factor`
    kept, and those between interpolated smoothly."""
    wavelength = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelength > original_length / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original_length / high_freq_factor) & (wavelength <= original_length / low_freq_factor)
    return jnp.where(medium, smoothed, scaled)


def _table_for(x: Float[Array, "... seq heads head_dim"], cos: Array, sin: Array) -> tuple[Array, Array]:
    """The table `(cos, sin)` of `_rotary_table` broadcast to `x`'s half features
    (`f32[..., T, H, hd/2]`) and cast to vary as `x` does: made once, it serves every
    array of that shape (the queries and the keys of a layer)."""
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    axes = varying_axes(x)
    return cast_varying(jnp.broadcast_to(cos, shape), axes), cast_varying(jnp.broadcast_to(sin, shape), axes)


def _rotate(x: Float[Array, "... seq heads head_dim"], cos: Array, sin: Array) -> Array:
    """`x` rotated by the table `(cos, sin)` of `_rotary_table` (or `_table_for`'s),
    same shape and dtype."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    if cos.shape != x1.shape:
        cos, sin = _table_for(x, cos, sin)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def causal_attention(
    q: Float[Array, "... seq heads head_dim"],
    k: Float[Array, "... seq heads head_dim"],
    v: Float[Array, "... seq heads head_dim"],
) -> Float[Array, "... seq heads head_dim"]:
    """Softmax attention of each position over itself and the positions before it.

    **Arguments:**

    - `q`, `k`, `v`: `[..., seq, heads, head_dim]`.

    **Returns:**

    `[..., seq, heads, head_dim]`.
    """
    seq, head_dim = q.shape[-3], q.shape[-1]
    # f32[..., T, H/n, hd] x f32[..., T, H/n, hd] -> f32[..., H/n, T, T]
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(head_dim)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), scores.shape)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # f32[..., H/n, T, T] x f32[..., T, H/n, hd] -> f32[..., T, H/n, hd]
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


class SharedKVLinear(eqx.Module):
    """The key/value projection of grouped-query attention when the axis outnumbers the key/value heads.

    Megatron's rule for `n` tensor-parallel devices and `n_kv_heads < n` key/value heads:
    each key/value head serves the `n / n_kv_heads` devices whose query heads read it.
    The weight is stored once (`[2, n_kv_heads * head_dim, in]`, keys then values,
    replicated over the axis, `P()`), each device projects only onto the head its query
    heads read, and the gradient is summed over the devices (those not reading a head
    contribute zero to its columns). Its global weight and bias are those of the
    `ColumnParallelLinear(in, 2 * n_kv_heads * head_dim, stride=2)` the same key builds,
    so a checkpoint moves between the split and the replicated layout.
    """

    weight: Sharded
    bias: Sharded | None
    in_features: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        axis_name: str = "tp",
        bias: bool = False,
        init_type: str = "xavier_normal",
        sequence_parallel: bool = False,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`: the input width.
        - `n_kv_heads`, `head_dim`: the key/value heads and their size.
        - `axis_name`: the tensor-parallel mesh axis.
        - `bias`: whether to add a bias.
        - `init_type`: see `equishard.nn.init_weight`.
        - `sequence_parallel`: the input is split over its token dimension (-2) and is
          all-gathered before the projection.
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key (drawn as `ColumnParallelLinear` draws it).
        """
        name = "SharedKVLinear"
        for what, value in (("in_features", in_features), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_positive(name, what, value)
        check_init_type(name, init_type)
        out = 2 * n_kv_heads * head_dim
        wkey, _, _ = jax.random.split(key, 3)
        # f32[2 Hkv hd, in] (global) stored as f32[2, Hkv hd, in], replicated.
        w = init_weight(wkey, (out, in_features), init_type, dtype=dtype)
        self.weight = Sharded(w.reshape(2, out // 2, in_features), P())
        self.bias = Sharded(jnp.zeros((2, out // 2), w.dtype), P()) if bias else None
        self.in_features = in_features
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel

    def __call__(
        self, x: Float[Array, "... in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... kv_local"]:
        """**Arguments:**

        - `x`: `[..., T, in]` replicated over the axis (with `sequence_parallel`, this
          device's `[..., T/n, in]`).
        - `key`: ignored.

        **Returns:**

        `[..., T, 2 * h * head_dim]`: keys then values of the `h` key/value heads this
        device's query heads read (`h = max(n_kv_heads / n, 1)`), for all tokens.
        """
        n = axis_size(self.axis_name)
        local = max(self.n_kv_heads // n, 1)
        w = value_of(self.weight).reshape(2, self.n_kv_heads, self.head_dim, self.in_features)
        b = None if self.bias is None else value_of(self.bias).reshape(2, self.n_kv_heads, self.head_dim)
        if is_bound(self.axis_name):
            if self.sequence_parallel:
                # f32[..., T/n, in] -> f32[..., T, in]
                x = gather_tokens(x, self.axis_name)
            else:
                x = mp_copy(x, axis_name=self.axis_name)
            # The first key/value head this device's query heads read.
            start = jax.lax.axis_index(self.axis_name) * self.n_kv_heads // n
            w = jax.lax.dynamic_slice_in_dim(w, start, local, axis=1)
            b = None if b is None else jax.lax.dynamic_slice_in_dim(b, start, local, axis=1)
        # f32[..., in] @ f32[in, 2 h hd] -> f32[..., 2 h hd]
        y = matmul_t(x, w.reshape(-1, self.in_features))
        if b is not None:
            y = add_bias(y, b.reshape(-1))
        return y


    def all_heads(self, x: Float[Array, "... in_features"]) -> Float[Array, "... 2 kv_local head_dim"]:
        """`__call__`'s keys and values as `[..., T, 2, h, head_dim]`, from one product
        against the whole (replicated) weight, then this device's heads taken from the
        output: the weight is read once, not sliced (generation's decode step).

        **Arguments:**

        - `x`: `[..., T, in]` replicated over the axis.
        """
        n = axis_size(self.axis_name)
        local = max(self.n_kv_heads // n, 1)
        if is_bound(self.axis_name):
            x = mp_copy(x, axis_name=self.axis_name)
        # f32[..., in] @ f32[in, 2 Hkv hd] -> f32[..., 2, Hkv, hd]
        y = matmul_t(x, value_of(self.weight).reshape(-1, self.in_features))
        if self.bias is not None:
            y = add_bias(y, value_of(self.bias).reshape(-1))
        y = y.reshape(*y.shape[:-1], 2, self.n_kv_heads, self.head_dim)
        if is_bound(self.axis_name):
            start = jax.lax.axis_index(self.axis_name) * self.n_kv_heads // n
            y = jax.lax.dynamic_slice_in_dim(y, start, local, axis=-2)
        return y


class ParallelAttention(eqx.Module):
    """Causal self-attention with the heads split over the axis; grouped-query heads.

    With `n_kv_heads == n_heads` (multi-head attention), `qkv` is a
    `ColumnParallelLinear(d_model, 3 * d_model, stride=3)`: its global weight is
    `[Wq; Wk; Wv]` and each device holds the columns of its `n_heads / n` heads of each.
    With `n_kv_heads < n_heads` (grouped-query attention; multi-query with
    `n_kv_heads=1`), query head `h` reads key/value head `h // (n_heads / n_kv_heads)`;
    `q` is a `ColumnParallelLinear(d_model, d_model)` and `kv` projects onto
    `[Wk; Wv]` (`2 * n_kv_heads * head_dim` outputs): a `ColumnParallelLinear` with
    `stride=2`, split over the axis, when the axis has at most `n_kv_heads` devices,
    or (`kv_replicated=True`) a `SharedKVLinear` stored once and replicated over the
    axis, each device projecting onto the one head its query heads read, when the axis
    has more (Megatron's rule). `proj` is a
    `RowParallelLinear(d_model, d_model, input_is_parallel=True)`. Heads are laid out
    head-major in the features (head `h` is features `[h * head_dim, (h + 1) * head_dim)`).
    Scores come from `equishard.core.attention` (blockwise above its threshold); see the
    "Long sequences" guide.
    """

    qkv: ColumnParallelLinear | None
    q: ColumnParallelLinear | None
    kv: ColumnParallelLinear | SharedKVLinear | None
    proj: RowParallelLinear
    lora: dict[str, LoRAAdapter] | None
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    style: str = eqx.field(static=True)
    rotary: bool = eqx.field(static=True)
    rotary_base: float = eqx.field(static=True)
    rotary_scaling: tuple[float, float, float, float] | None = eqx.field(static=True)
    context_axis_name: str | None = eqx.field(static=True)
    context_impl: str = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        kv_replicated: bool = False,
        axis_name: str = "tp",
        context_axis_name: str | None = None,
        context_impl: str = "ring",
        style: str = "megatron",
        rotary: bool = False,
        rotary_base: float = 10000.0,
        rotary_scaling: tuple[float, float, float, float] | None = None,
        bias: bool = False,
        qkv_bias: bool | None = None,
        init_type: str = "xavier_normal",
        dtype: Any = None,
        lora: LoRA | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `d_model`: the model width.
        - `n_heads`: the number of query heads; divides `d_model`, and must be divisible
          by the size of the axis.
        - `n_kv_heads`: the number of key/value heads, a divisor of `n_heads` (default
          `n_heads`: multi-head attention; 1: multi-query attention).
        - `kv_replicated`: store the key/value projection replicated over the axis
          (`SharedKVLinear`), as an axis with more devices than `n_kv_heads` needs;
          otherwise it is split over the axis, whose size must then divide `n_kv_heads`.
        - `axis_name`: the tensor-parallel mesh axis.
        - `context_axis_name`: a context-parallel mesh axis the sequence is split over
          (`None`: none). Where it is bound the layer attends across it with
          `equishard.core.ring_attention` or `alltoall_attention`, the tokens' global
          positions given by `positions` (zigzag order, see the "Long sequences"
          guide). The sequence splits over it first, then over `axis_name` with
          `style="sequence"` (cp outer, tp inner).
        - `context_impl`: `"ring"` or `"alltoall"` (needs the heads per tensor shard
          divisible by the context axis).
        - `style`: `"megatron"` or `"sequence"` (see the module documentation).
        - `rotary`: apply rotary position embeddings to queries and keys (needs an even
          head size).
        - `rotary_base`: the rotary frequency base.
        - `rotary_scaling`: Llama 3.1's rotary frequency scaling, `(factor,
          low_freq_factor, high_freq_factor, original_max_position_embeddings)` (`None`:
          none).
        - `bias`: biases in the projections.
        - `qkv_bias`: biases in the query, key and value projections only (`None`: as
          `bias`; Qwen2 has them, without one in the output projection).
        - `init_type`: the projections' init type.
        - `dtype`: the parameters' dtype.
        - `lora`: LoRA adapters on its targets among q, k, v and o (`equishard.nn.LoRA`;
          `None`: none), one `LoRAAdapter` each in the field `lora`, drawn from a key
          derived from `key` (the projections' own arrays are those of the same key
          without adapters).
        - `key`: a PRNG key.
        """
        name = "ParallelAttention"
        check_positive(name, "d_model", d_model)
        check_positive(name, "n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_positive(name, "n_kv_heads", n_kv_heads)
        _check_style(name, style)
        if d_model % n_heads:
            raise LayerConfigError(f"{name}: n_heads={n_heads} does not divide d_model={d_model}.")
        if n_heads % n_kv_heads:
            raise LayerConfigError(
                f"{name}: n_kv_heads={n_kv_heads} does not divide n_heads={n_heads}."
            )
        head_dim = d_model // n_heads
        if rotary and head_dim % 2:
            raise LayerConfigError(
                f"{name}: rotary embeddings need an even head size, got "
                f"d_model/n_heads = {head_dim}."
            )
        check_choice(name, "context_impl", context_impl, CONTEXT_IMPLS)
        sp = style == "sequence"
        qkey, pkey = jax.random.split(key)
        in_bias = bias if qkv_bias is None else qkv_bias
        self.qkv = self.q = self.kv = None
        if n_kv_heads == n_heads:
            self.qkv = ColumnParallelLinear(
                d_model, 3 * d_model, axis_name=axis_name, bias=in_bias, gather_output=False,
                init_type=init_type, stride=3, sequence_parallel=sp, dtype=dtype, key=qkey,
            )  # fmt: skip
        else:
            # The query and key/value projections draw from the key of the fused one.
            q_key, kv_key = jax.random.split(qkey)
            # Both read the input the layer gathers (or copies in) once (`qkv_heads`).
            self.q = ColumnParallelLinear(
                d_model, d_model, axis_name=axis_name, bias=in_bias, gather_output=False,
                init_type=init_type, dtype=dtype, key=q_key,
            )  # fmt: skip
            if kv_replicated:
                self.kv = SharedKVLinear(
                    d_model, n_kv_heads, head_dim, axis_name=axis_name, bias=in_bias,
                    init_type=init_type, dtype=dtype, key=kv_key,
                )  # fmt: skip
            else:
                self.kv = ColumnParallelLinear(
                    d_model, 2 * n_kv_heads * head_dim, axis_name=axis_name, bias=in_bias,
                    gather_output=False, init_type=init_type, stride=2, dtype=dtype, key=kv_key,
                )  # fmt: skip
        self.proj = RowParallelLinear(
            d_model, d_model, axis_name=axis_name, bias=bias, input_is_parallel=True,
            init_type=init_type, sequence_parallel=sp, dtype=dtype, key=pkey,
        )  # fmt: skip
        self.lora = attention_adapters(
            lora, d_model, n_heads, n_kv_heads, kv_replicated=kv_replicated, axis_name=axis_name,
            sequence_parallel=sp, dtype=dtype, key=key,
        )  # fmt: skip
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.axis_name = axis_name
        self.style = style
        self.rotary = rotary
        self.rotary_base = rotary_base
        self.rotary_scaling = None if rotary_scaling is None else (
            float(rotary_scaling[0]), float(rotary_scaling[1]), float(rotary_scaling[2]), float(rotary_scaling[3])
        )  # fmt: skip
        self.context_axis_name = context_axis_name
        self.context_impl = context_impl

    def _check_axis(self, n: int) -> None:
        name = "ParallelAttention"
        check_divisible(name, "n_heads", self.n_heads, self.axis_name, n)
        if isinstance(self.kv, ColumnParallelLinear) and self.n_kv_heads % n:
            raise LayerConfigError(
                f"{name}: n_kv_heads={self.n_kv_heads} is not divisible by {n}, the size of "
                f"mesh axis {self.axis_name!r}; build the layer with kv_replicated=True to "
                f"replicate the key/value heads over the axis (Megatron's rule)."
            )
        if isinstance(self.kv, SharedKVLinear) and n % self.n_kv_heads and self.n_kv_heads % n:
            raise LayerConfigError(
                f"{name}: n_kv_heads={self.n_kv_heads} and the size {n} of mesh axis "
                f"{self.axis_name!r} do not divide one another."
            )

    def qkv_heads(
        self, x: Float[Array, "... tokens d_model"], lora_dropout: LoRADropout | None = None
    ) -> tuple[Array, Array, Array]:
        """This device's queries `[..., T, H/n, hd]` and keys, values `[..., T, Hkv_local, hd]`.

        `Hkv_local` is `n_kv_heads / n`, or 1 when the axis outnumbers the key/value
        heads. No rotary embedding is applied. `lora_dropout`: as `__call__`'s.
        """
        n = axis_size(self.axis_name)
        self._check_axis(n)
        heads = self.n_heads // n
        head_dim = self.d_model // self.n_heads
        x0 = x  # the adapters' input, as the block holds it
        if self.qkv is not None:
            # f32[..., T(/n), D] -> q, k, v f32[..., T, D/n] -> f32[..., T, H/n, hd]: one
            # product each (`split`: no concatenation of their gradients).
            parts = self.qkv.split(x)
            if self.lora is not None:
                parts = tuple(adapted(self.lora, t, y, x0, lora_dropout) for t, y in zip(("q", "k", "v"), parts))
            q, k, v = (checkpoint_name(y, QKV_PROJ).reshape(*y.shape[:-1], heads, head_dim) for y in parts)
            return q, k, v
        assert self.q is not None and self.kv is not None
        if is_bound(self.axis_name):
            # One gather (or copy) of the input for both projections: its gradient is
            # then reduced once, not once per projection.
            if self.style == "sequence":
                x = gather_tokens(x, self.axis_name)  # f32[..., T/n, D] -> f32[..., T, D]
            else:
                x = mp_copy(x, axis_name=self.axis_name)
        # f32[..., T, D] @ f32[D, D/n] -> f32[..., T, H/n, hd]
        q, kv = self.q(x), self.kv(x)
        if self.lora is not None:
            q, kv = adapted(self.lora, "q", q, x0, lora_dropout), self._adapted_kv(kv, x0, lora_dropout)
        q = checkpoint_name(q, QKV_PROJ)
        q = q.reshape(*q.shape[:-1], heads, head_dim)
        # f32[..., T, D] @ f32[D, 2 Hkv_local hd] -> f32[..., T, 2, Hkv_local, hd]
        kv = checkpoint_name(kv, QKV_PROJ)
        kv = kv.reshape(*kv.shape[:-1], 2, -1, head_dim)
        return q, kv[..., 0, :, :], kv[..., 1, :, :]

    def _adapted_kv(self, kv: Array, x: Array, lora_dropout: LoRADropout | None = None) -> Array:
        """The key/value projection's output `[..., T, 2 h hd]` (keys, then values) with
        the k and v adapters' additions for the same heads."""
        k, v = jnp.split(kv, 2, axis=-1)
        k, v = adapted(self.lora, "k", k, x, lora_dropout), adapted(self.lora, "v", v, x, lora_dropout)
        return jnp.concatenate([k, v], axis=-1)

    def __call__(
        self,
        x: Float[Array, "... tokens d_model"],
        *,
        positions: Int[Array, "... seq"] | None = None,
        segment_ids: Int[Array, "... seq"] | None = None,
        key: PRNGKeyArray | None = None,
        lora_dropout: LoRADropout | None = None,
    ) -> Float[Array, "... tokens d_model"]:
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron") or this device's `[..., T/n, d_model]`
          ("sequence").
        - `positions`: the integer positions of the `T` tokens, `[T]` or `[..., T]`
          (for rotary embeddings and the causal mask); default `0, ..., T - 1`. With a
          bound context axis, the global positions of this device's `T` tokens
          (required). For packed documents, each token's position in its document.
        - `segment_ids`: the document of each of the `T` tokens, `[T]` or `[..., T]`
          (the same tokens as `positions`, all `T` even under sequence parallelism): a
          query attends only to keys of its own document (document masking); default:
          one document.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.
        - `lora_dropout`: the draw of the adapters' dropout masks for this layer
          (`x` is then `[B, T(/n), d_model]`; see `LoRA`), or `None`: no dropout.

        **Returns:**

        The attention output, laid out like `x`.
        """
        q, k, v = self.qkv_heads(x, lora_dropout)
        if self.rotary:
            # One table, f32[..., T, 1, hd/2] each, broadcast once for q and k alike.
            table = _rotary_table(q.shape[-3], q.shape[-1], self.rotary_base, positions, self.rotary_scaling)
            q_table = _table_for(q, *table)
            same = k.shape == q.shape and varying_axes(k) == varying_axes(q)
            q, k = _rotate(q, *q_table), _rotate(k, *(q_table if same else table))
        cp = self.context_axis_name
        if cp is not None and is_bound(cp):
            if positions is None:
                raise LayerConfigError(
                    f"ParallelAttention: the sequence is split over the context axis {cp!r}; "
                    f"pass the global positions of this device's tokens (positions=...)."
                )
            # f32[..., S/cp, H/n, hd] attends over all S tokens of the cp axis.
            split = ring_attention if self.context_impl == RING else alltoall_attention
            out = split(q, k, v, cp, mask=AttentionMask(True, positions, positions, segment_ids, segment_ids), layout=ZIGZAG)
        else:
            # f32[..., T, H/n, hd], f32[..., T, Hkv_local, hd] -> f32[..., T, H/n, hd]
            out = attention_kernel(q, k, v, mask=AttentionMask(True, positions, positions, segment_ids, segment_ids))
        out = checkpoint_name(out.reshape(*out.shape[:-2], -1), CONTEXT)
        # f32[..., T, D/n] @ f32[D/n, D] -> f32[..., T(/n), D]
        return checkpoint_name(adapted_row(self.lora, "o", self.proj(out), out, lora_dropout), OUT_PROJ)

    def cached(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        positions: Int[Array, "batch seq"],
        cache: tuple[Array, Array] | None = None,
        slot: Int[Array, ""] | None = None,
        seen: Bool[Array, "batch seq cache"] | None = None,
    ) -> tuple[Float[Array, "batch seq d_model"], tuple[Array, Array]]:
        """Attention for generation, with a key/value cache ("megatron" style, no context axis).

        Without `cache` (the prefill), the tokens attend causally among themselves, as
        in `__call__`, and their keys and values are returned for the caller to cache.
        With it (a decode step), the new tokens' keys and values are written into the
        cache's slots from `slot` on (the same slots in every row: one in-place update),
        and each token attends to the cached slots `seen` marks and, causally, to the
        new tokens. Keys are rotated by their
        positions before they are cached, so a slot's place in the cache does not
        matter. Each projection is one product here (a stride's pieces split from its
        output, not its weight): a decode step reads every weight once.

        **Arguments:**

        - `x`: `[B, S, d_model]`, replicated over the axis.
        - `positions`: `[B, S]`, the tokens' positions (rotary embeddings; the causal
          mask of the prefill).
        - `cache`: `(keys, values)`, each this device's `[B, Hkv_local, L, head_dim]`
          (head-major, so that the scores read it without a transpose), or `None`.
        - `slot`: with `cache`, the first slot written (an `int32` scalar).
        - `seen`: with `cache`, `bool[B, S, L]`: the cached slots each new token
          attends to (not the slots being written).

        **Returns:**

        `(y, kv)`: the output `[B, S, d_model]` and, without `cache`, the tokens'
        rotated keys and values `[B, S, Hkv_local, head_dim]` each; with it, the cache
        with them written.

        **Raises:**

        `LayerConfigError` for a sequence-parallel layer, one with a bound context axis,
        or a `cache` without `slot` and `seen`.
        """
        cp = self.context_axis_name
        if self.style == "sequence" or (cp is not None and is_bound(cp)):
            raise LayerConfigError(
                f"ParallelAttention.cached: generation runs with style='megatron' and no "
                f"context axis; this layer has style={self.style!r}, context axis {cp!r}."
            )
        q, k, v = self._qkv_one_product(x)
        if self.rotary:
            table = _rotary_table(q.shape[-3], q.shape[-1], self.rotary_base, positions, self.rotary_scaling)
            q, k = _rotate(q, *table), _rotate(k, *table)
        if cache is None:
            # f32[B, S, H/n, hd], f32[B, S, Hkv_local, hd] -> f32[B, S, H/n, hd]
            out = attention_kernel(q, k, v, mask=AttentionMask(True, positions, positions))
            kv = (k, v)
        else:
            if slot is None or seen is None:
                raise LayerConfigError("ParallelAttention.cached: a cache needs slot= and seen=.")
            # The cached slots (read before the update, so that the update is one in
            # place: XLA fuses an update that is read into each reader, copying the
            # cache for each), merged with the new tokens' causal attention to their own.
            past, past_lse = _attend_cache(q, cache[0], cache[1], seen)
            own, own_lse = dense_attention(q, k, v, mask=AttentionMask(True, positions, positions))
            out = merge_attention(past, past_lse, own, own_lse)[0]
            # f32[B, S, Hkv, hd] -> f32[B, Hkv, S, hd], written at slots [slot, slot + S)
            # once the cache has been read (`after`: a data dependency, else XLA copies the
            # cache to keep the read's values)
            k, v = after((k, v), out, unboxed=True)
            kv = tuple(
                jax.lax.dynamic_update_slice(c, _head_major(n).astype(c.dtype), (0, 0, slot, 0))
                for c, n in zip(cache, (k, v))
            )
        # f32[B, S, D/n] @ f32[D/n, D] -> f32[B, S, D]
        out = out.reshape(*out.shape[:-2], -1)
        return adapted_row(self.lora, "o", self.proj(out), out), (kv[0], kv[1])

    def _qkv_one_product(self, x: Array) -> tuple[Array, Array, Array]:
        """`qkv_heads`'s queries, keys and values, one product per projection."""
        n = axis_size(self.axis_name)
        self._check_axis(n)
        heads, head_dim = self.n_heads // n, self.d_model // self.n_heads
        if self.qkv is not None:
            # f32[B, S, D] @ f32[D, 3 D/n] -> q, k, v f32[B, S, H/n, hd]
            parts = jnp.split(self.qkv(x), 3, axis=-1)
            parts = [adapted(self.lora, t, y, x) for t, y in zip(("q", "k", "v"), parts)]
            q, k, v = (y.reshape(*y.shape[:-1], heads, head_dim) for y in parts)
            return q, k, v
        assert self.q is not None and self.kv is not None
        q = adapted(self.lora, "q", self.q(x), x)
        q = q.reshape(*q.shape[:-1], heads, head_dim)
        if isinstance(self.kv, SharedKVLinear):
            kv = self.kv.all_heads(x)  # f32[B, S, 2, Hkv_local, hd]
            if self.lora is not None:
                kv = self._adapted_kv(kv.reshape(*kv.shape[:-3], -1), x)
                kv = kv.reshape(*kv.shape[:-1], 2, -1, head_dim)
        else:
            kv = self.kv(x)
            if self.lora is not None:
                kv = self._adapted_kv(kv, x)
            kv = kv.reshape(*kv.shape[:-1], 2, -1, head_dim)
        return q, kv[..., 0, :, :], kv[..., 1, :, :]


def _head_major(x: Array) -> Array:
    """`[B, S, H, hd] -> [B, H, S, hd]` (a reshape for one token: no transpose to fuse)."""
    if x.shape[1] == 1:
        return x.reshape(x.shape[0], x.shape[2], 1, x.shape[3])
    return jnp.swapaxes(x, 1, 2)


def _attend_cache(q: Array, keys: Array, values: Array, seen: Array) -> tuple[Array, Array]:
    """Softmax attention of `q` `[B, S, H, hd]` over a cache `[B, Hkv, L, hd]`, the slots
    `seen` (`bool[B, S, L]`) marks: the output `[B, S, H, hd]` and the log-sum-exp
    `f32[B, S, H]` (`-inf` for a query that sees no slot), for `merge_attention`."""
    b, s, h, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = h // hkv
    # f32[B, S, Hkv G, hd] -> f32[B, Hkv, G S, hd] (query heads of a key/value head together)
    qg = jnp.transpose(q.reshape(b, s, hkv, g, d), (0, 2, 3, 1, 4)).reshape(b, hkv, g * s, d)
    # f32[B, Hkv, G S, hd] x f32[B, Hkv, L, hd] -> f32[B, Hkv, G S, L]
    scores = jnp.einsum("bhqd,bhkd->bhqk", qg, keys, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = jnp.broadcast_to(seen[:, None, None], (b, hkv, g, s, length)).reshape(scores.shape)
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(mask, jnp.exp(scores - top), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top, -jnp.inf)[..., 0]
    weights = (p / jnp.where(total > 0, total, 1.0)).astype(values.dtype)
    # f32[B, Hkv, G S, L] x f32[B, Hkv, L, hd] -> f32[B, Hkv, G S, hd]
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, values, preferred_element_type=jnp.float32)
    out = jnp.transpose(out.reshape(b, hkv, g, s, d), (0, 3, 1, 2, 4)).reshape(b, s, h, d)
    lse = jnp.transpose(lse.reshape(b, hkv, g, s), (0, 3, 1, 2)).reshape(b, s, h)
    return out.astype(q.dtype), lse


class ParallelMLP(eqx.Module):
    """The transformer's MLP: column-parallel up-projection, activation, row-parallel down.

    With `swiglu=True` the up-projection is `[W_gate; W_up]` (`2 * d_ff` outputs,
    `stride=2`, so each device holds its slice of both) and the hidden activation is
    `silu(gate) * up`; otherwise `activation(up)`.
    """

    up: ColumnParallelLinear
    down: RowParallelLinear
    lora: dict[str, LoRAAdapter] | None
    d_model: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    swiglu: bool = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)
    style: str = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        axis_name: str = "tp",
        style: str = "megatron",
        swiglu: bool = False,
        activation: Callable[[Array], Array] = jax.nn.gelu,
        bias: bool = False,
        init_type: str = "xavier_normal",
        dtype: Any = None,
        lora: LoRA | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `d_model`: the model width.
        - `d_ff`: the hidden width; must be divisible by the size of the axis.
        - `axis_name`: the tensor-parallel mesh axis.
        - `style`: `"megatron"` or `"sequence"`.
        - `swiglu`: use the SwiGLU gated hidden layer.
        - `activation`: the hidden activation without `swiglu` (default GELU).
        - `bias`: biases in the projections.
        - `init_type`: the projections' init type.
        - `dtype`: the parameters' dtype.
        - `lora`: LoRA adapters on its targets among gate (SwiGLU's), up and down (as
          `ParallelAttention`'s).
        - `key`: a PRNG key.
        """
        name = "ParallelMLP"
        check_positive(name, "d_model", d_model)
        check_positive(name, "d_ff", d_ff)
        _check_style(name, style)
        sp = style == "sequence"
        ukey, dkey = jax.random.split(key)
        self.up = ColumnParallelLinear(
            d_model, 2 * d_ff if swiglu else d_ff, axis_name=axis_name, bias=bias,
            gather_output=False, init_type=init_type, stride=2 if swiglu else 1,
            sequence_parallel=sp, dtype=dtype, key=ukey,
        )  # fmt: skip
        self.down = RowParallelLinear(
            d_ff, d_model, axis_name=axis_name, bias=bias, input_is_parallel=True,
            init_type=init_type, sequence_parallel=sp, dtype=dtype, key=dkey,
        )  # fmt: skip
        self.lora = mlp_adapters(
            lora, d_model, d_ff, swiglu=swiglu, axis_name=axis_name, sequence_parallel=sp,
            dtype=dtype, key=key,
        )  # fmt: skip
        self.d_model = d_model
        self.d_ff = d_ff
        self.swiglu = swiglu
        self.activation = activation
        self.style = style

    def __call__(
        self, x: Float[Array, "... tokens d_model"], *, key: PRNGKeyArray | None = None,
        lora_dropout: LoRADropout | None = None,
    ) -> Float[Array, "... tokens d_model"]:  # fmt: skip
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron") or `[..., T/n, d_model]` ("sequence").
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.
        - `lora_dropout`: the draw of the adapters' dropout masks for this layer (as
          `ParallelAttention`'s), or `None`: no dropout.

        **Returns:**

        `[..., T(/n), d_model]`, laid out like `x`.
        """
        drop = lora_dropout
        if self.swiglu:
            # f32[..., T(/n), D] -> gate, up f32[..., T, F/n]: one product each against
            # this device's gate block and up block of the stride-2 weight (`split`: no
            # concatenation of their gradients in the backward pass).
            gate, up = self.up.split(x)
            gate, up = adapted(self.lora, "gate", gate, x, drop), adapted(self.lora, "up", up, x, drop)
            gate, up = checkpoint_name(gate, MLP_IN), checkpoint_name(up, MLP_IN)
            # silu(gate) as `jax.nn.silu` computes it, unstaged (that one is a nested jit).
            h = gate * jax.lax.logistic(gate) * up
        else:
            # f32[..., T(/n), D] -> f32[..., T, F/n]
            h = self.activation(checkpoint_name(adapted(self.lora, "up", self.up(x), x, drop), MLP_IN))
        # f32[..., T, F/n] @ f32[F/n, D] -> f32[..., T(/n), D]
        return checkpoint_name(adapted_row(self.lora, "down", self.down(h), h, drop), MLP_OUT)


class TransformerBlock(eqx.Module):
    """A pre-norm transformer block with tensor parallelism.

    `x + attn(norm1(x))`, then `+ mlp(norm2(.))`. `style="megatron"` keeps activations
    replicated over the axis; `style="sequence"` keeps them split over the sequence
    (see the module documentation). The parameters are the same in both styles (the
    same key gives the same block), so a model can switch style with `eqx.tree_at` on
    the static fields, or simply be rebuilt.

    With `moe=` the feed-forward sub-layer is that mixture-of-experts layer: call the
    block through `call_with_aux`, which also returns the layer's `MoEAux`.
    """

    norm1: RMSNorm
    attn: ParallelAttention
    norm2: RMSNorm
    mlp: ParallelMLP | MoE
    style: str = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        swiglu: bool = False,
        activation: Callable[[Array], Array] = jax.nn.gelu,
        eps: float = 1e-6,
        moe: MoE | None = None,
        key: PRNGKeyArray,
        **attention: Any,
    ):
        """**Arguments:**

        - `d_model`: the model width.
        - `n_heads`: the number of attention heads (divisible by the axis size).
        - `d_ff`: the MLP's hidden width (divisible by the axis size); unused with `moe`.
        - `swiglu`: a SwiGLU MLP instead of `activation`.
        - `activation`: the MLP's activation without `swiglu`.
        - `eps`: the norms' epsilon.
        - `moe`: a mixture-of-experts layer to use as the feed-forward sub-layer
          instead of the MLP (its width must be `d_model`).
        - `key`: a PRNG key.
        - `attention`: the attention's options, as `ParallelAttention` takes them
          (`n_kv_heads`, `kv_replicated`, `axis_name`, `context_axis_name`,
          `context_impl`, `style`, `rotary`, `rotary_base`, `rotary_scaling`, `bias`,
          `qkv_bias`, `init_type`, `dtype`, `lora`); the MLP shares `axis_name` (the
          tensor-parallel axis, default `"tp"`), `style` (`"megatron"`: activations
          replicated over the axis, or `"sequence"`: split over the sequence between
          sub-layers), `bias`, `init_type`, `dtype` and `lora` (its gate, up and down
          targets), and the norms `dtype`.
        """
        known = set(inspect.signature(ParallelAttention.__init__).parameters) - {"self", "d_model", "n_heads", "key"}
        unknown = sorted(set(attention) - known)
        if unknown:
            raise LayerConfigError(
                f"TransformerBlock: {', '.join(unknown)} is no option of the block or of its "
                f"attention; the attention takes {', '.join(sorted(known))}."
            )
        axis_name, style = attention.get("axis_name", "tp"), attention.get("style", "megatron")
        _check_style("TransformerBlock", style)
        if moe is not None and moe.hidden != d_model:
            raise LayerConfigError(
                f"TransformerBlock: the MoE layer's hidden={moe.hidden} is not d_model={d_model}."
            )
        shared = {k: attention[k] for k in ("bias", "init_type", "dtype", "lora") if k in attention}
        lora = attention.get("lora")
        if moe is not None and lora is not None and any(t in MLP_TARGETS for t in lora.targets):
            raise LayerConfigError(
                f"LoRA: targets {[t for t in lora.targets if t in MLP_TARGETS]} are not in this "
                f"block: its feed-forward layer is a mixture of experts (no gate, up or down "
                f"projection); adapt q, k, v or o."
            )
        akey, mkey = jax.random.split(key)
        self.norm1 = RMSNorm(d_model, eps=eps, dtype=shared.get("dtype"))
        self.attn = ParallelAttention(d_model, n_heads, **attention, key=akey)
        self.norm2 = RMSNorm(d_model, eps=eps, dtype=shared.get("dtype"))
        self.mlp = moe if moe is not None else ParallelMLP(
            d_model, d_ff, axis_name=axis_name, style=style, swiglu=swiglu, activation=activation,
            key=mkey, **shared,
        )  # fmt: skip
        self.style = style
        self.axis_name = axis_name

    def __call__(
        self,
        x: Float[Array, "... tokens d_model"],
        *,
        positions: Int[Array, "... seq"] | None = None,
        segment_ids: Int[Array, "... seq"] | None = None,
        key: PRNGKeyArray | None = None,
        lora_dropout: LoRADropout | None = None,
    ) -> Float[Array, "... tokens d_model"]:
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron", replicated over the axis) or this
          device's `[..., T/n, d_model]` ("sequence").
        - `positions`: the tokens' integer positions (see `ParallelAttention`).
        - `segment_ids`: the tokens' documents (see `ParallelAttention`).
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.
        - `lora_dropout`: the draw of the adapters' dropout masks for this block (see
          `ParallelAttention`), or `None`: no dropout.

        **Returns:**

        The block's output, laid out like `x`.

        **Raises:**

        `LayerConfigError` for a block with an MoE layer, whose auxiliary losses this
        call would drop: use `call_with_aux`.
        """
        if isinstance(self.mlp, MoE):
            raise LayerConfigError(
                "TransformerBlock: this block's feed-forward layer is an MoE, whose "
                "auxiliary losses a plain call would drop; call block.call_with_aux(x)."
            )
        return self.call_with_aux(x, positions=positions, segment_ids=segment_ids, lora_dropout=lora_dropout)[0]

    def call_with_aux(
        self,
        x: Float[Array, "... tokens d_model"],
        *,
        positions: Int[Array, "... seq"] | None = None,
        segment_ids: Int[Array, "... seq"] | None = None,
        lora_dropout: LoRADropout | None = None,
    ) -> tuple[Float[Array, "... tokens d_model"], MoEAux | None]:
        """The block's output and, with an MoE layer, its `MoEAux` (else `None`).

        **Arguments:**

        - `x`: as for `__call__` (`[batch, seq/ep, d_model]` with an MoE layer).
        - `positions`, `segment_ids`, `lora_dropout`: as for `__call__`.

        **Returns:**

        `(y, aux)`: the block's output laid out like `x`, and the MoE layer's
        auxiliary losses and statistics or `None`.
        """
        x = x + self.attn(self.norm1(x), positions=positions, segment_ids=segment_ids, lora_dropout=lora_dropout)
        h = self.norm2(x)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(h)
            return x + y, aux
        return x + self.mlp(h, lora_dropout=lora_dropout), None

    def cached(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        positions: Int[Array, "batch seq"],
        cache: tuple[Array, Array] | None = None,
        slot: Int[Array, ""] | None = None,
        seen: Bool[Array, "batch seq cache"] | None = None,
    ) -> tuple[Float[Array, "batch seq d_model"], tuple[Array, Array]]:
        """The block for generation: its attention reads a key/value cache
        (`ParallelAttention.cached`, whose arguments these are); every projection is
        one product.

        **Returns:**

        `(y, kv)`: the block's output `[B, S, d_model]` and, as
        `ParallelAttention.cached` returns them, the new keys and values or the cache
        with them written.

        **Raises:**

        `LayerConfigError` for a block with an MoE layer or sequence parallelism.
        """
        if isinstance(self.mlp, MoE):
            raise LayerConfigError(
                "TransformerBlock.cached: generation with a mixture-of-experts block is "
                "not supported."
            )
        a, kv = self.attn.cached(self.norm1(x), positions=positions, cache=cache, slot=slot, seen=seen)
        x = x + a
        mlp, h = self.mlp, self.norm2(x)
        # f32[B, S, D] @ f32[D, (2) F/n]: one product, its pieces split from the output
        if mlp.swiglu:
            gate, up = jnp.split(mlp.up(h), 2, axis=-1)
            gate, up = adapted(mlp.lora, "gate", gate, h), adapted(mlp.lora, "up", up, h)
            h = gate * jax.lax.logistic(gate) * up
        else:
            h = mlp.activation(adapted(mlp.lora, "up", mlp.up(h), h))
        return x + adapted_row(mlp.lora, "down", mlp.down(h), h), kv
