"""A tensor-parallel transformer block: RMSNorm, causal attention, MLP.

Two styles over the same tensor-parallel axis, with the same parameters:

- `style="megatron"` (Megatron-LM tensor parallelism): activations `[..., T, D]` are
  replicated over the axis between sub-layers; each column layer's input is copied in
  (its gradient all-reduced), each row layer's output all-reduced.
- `style="sequence"` (tensor + sequence parallelism): activations `[..., T/n, D]` are
  split over the sequence between sub-layers, so norms and residuals run on `1/n` of
  the tokens; the input of each column layer is all-gathered over the sequence and
  the output of each row layer reduce-scattered over it.

Attention heads are split over the axis (`n_heads` must be divisible by its size); the
fused QKV projection is a `ColumnParallelLinear` with `stride=3`, so each device holds
the query, key and value columns of its own heads. Outside any `shard_map` the block is
the plain single-device block on its global parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import cast_varying, varying_axes
from .._errors import LayerConfigError
from ..sharding import Sharded
from ._init import (
    axis_size,
    check_choice,
    check_divisible,
    check_positive,
    default_dtype,
    value_of,
)
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._moe import MoE, MoEAux

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
        compute = jnp.promote_types(x.dtype, jnp.float32)
        h = x.astype(compute)
        inv = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        h = h * inv
        if self.weight is not None:
            # Vary the weight like `h` before broadcasting it, so that the gradient's sum
            # over the axes `h` varies over is one all-reduce of `f32[dim]` (not of the
            # broadcast `f32[..., dim]`, as JAX's automatic cast after the broadcast gives).
            weight = cast_varying(value_of(self.weight).astype(compute), varying_axes(h))
            h = h * jnp.broadcast_to(weight, h.shape)
        return h.astype(x.dtype)


def rotary_embedding(x: Float[Array, "... seq heads head_dim"], base: float = 10000.0) -> Float[Array, "... seq heads head_dim"]:
    """Rotate query or key features by their position (RoPE, the half-split variant).

    Position `p` (0 to `seq - 1`) and frequency `i` rotate the pair
    `(x[..., i], x[..., i + head_dim/2])` by the angle `p * base**(-2i/head_dim)`.

    **Arguments:**

    - `x`: `[..., seq, heads, head_dim]` with an even `head_dim`; all positions present.
    - `base`: the frequency base.

    **Returns:**

    The rotated array, same shape and dtype.
    """
    seq, head_dim = x.shape[-3], x.shape[-1]
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * (2.0 / head_dim))
    # f32[T, 1, hd/2]
    angles = (jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :])[:, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    cos = jnp.broadcast_to(jnp.cos(angles), x1.shape)
    sin = jnp.broadcast_to(jnp.sin(angles), x1.shape)
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


class ParallelAttention(eqx.Module):
    """Multi-head causal self-attention with the heads split over the axis.

    `qkv` is a `ColumnParallelLinear(d_model, 3 * d_model, stride=3)`: its global weight
    is `[Wq; Wk; Wv]` and each device holds the columns of its `n_heads / n` heads of
    each. `proj` is a `RowParallelLinear(d_model, d_model, input_is_parallel=True)`.
    Heads are laid out head-major in the features (`head h` is features
    `[h * head_dim, (h + 1) * head_dim)`).
    """

    qkv: ColumnParallelLinear
    proj: RowParallelLinear
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    style: str = eqx.field(static=True)
    rotary: bool = eqx.field(static=True)
    rotary_base: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        axis_name: str = "tp",
        style: str = "megatron",
        rotary: bool = False,
        rotary_base: float = 10000.0,
        bias: bool = False,
        init_type: str = "xavier_normal",
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `d_model`: the model width.
        - `n_heads`: the number of heads; divides `d_model`, and must be divisible by
          the size of the axis.
        - `axis_name`: the tensor-parallel mesh axis.
        - `style`: `"megatron"` or `"sequence"` (see the module documentation).
        - `rotary`: apply rotary position embeddings to queries and keys (needs an even
          head size).
        - `rotary_base`: the rotary frequency base.
        - `bias`: biases in the projections.
        - `init_type`: the projections' init type.
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key.
        """
        name = "ParallelAttention"
        check_positive(name, "d_model", d_model)
        check_positive(name, "n_heads", n_heads)
        _check_style(name, style)
        if d_model % n_heads:
            raise LayerConfigError(f"{name}: n_heads={n_heads} does not divide d_model={d_model}.")
        if rotary and (d_model // n_heads) % 2:
            raise LayerConfigError(
                f"{name}: rotary embeddings need an even head size, got "
                f"d_model/n_heads = {d_model // n_heads}."
            )
        sp = style == "sequence"
        qkey, pkey = jax.random.split(key)
        self.qkv = ColumnParallelLinear(
            d_model, 3 * d_model, axis_name=axis_name, bias=bias, gather_output=False,
            init_type=init_type, stride=3, sequence_parallel=sp, dtype=dtype, key=qkey,
        )  # fmt: skip
        self.proj = RowParallelLinear(
            d_model, d_model, axis_name=axis_name, bias=bias, input_is_parallel=True,
            init_type=init_type, sequence_parallel=sp, dtype=dtype, key=pkey,
        )  # fmt: skip
        self.d_model = d_model
        self.n_heads = n_heads
        self.axis_name = axis_name
        self.style = style
        self.rotary = rotary
        self.rotary_base = rotary_base

    def __call__(
        self, x: Float[Array, "... tokens d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... tokens d_model"]:
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron") or this device's `[..., T/n, d_model]`
          ("sequence").
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        The attention output, laid out like `x`.
        """
        n = axis_size(self.axis_name)
        check_divisible("ParallelAttention", "n_heads", self.n_heads, self.axis_name, n)
        heads = self.n_heads // n
        head_dim = self.d_model // self.n_heads
        # f32[..., T(/n), D] -> f32[..., T, 3 D/n], ordered (q|k|v, local head, head_dim)
        qkv = self.qkv(x)
        qkv = qkv.reshape(*qkv.shape[:-1], 3, heads, head_dim)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        if self.rotary:
            q = rotary_embedding(q, self.rotary_base)
            k = rotary_embedding(k, self.rotary_base)
        # f32[..., T, H/n, hd] -> f32[..., T, D/n]
        out = causal_attention(q, k, v)
        out = out.reshape(*out.shape[:-2], heads * head_dim)
        # f32[..., T, D/n] @ f32[D/n, D] -> f32[..., T(/n), D]
        return self.proj(out)


class ParallelMLP(eqx.Module):
    """The transformer's MLP: column-parallel up-projection, activation, row-parallel down.

    With `swiglu=True` the up-projection is `[W_gate; W_up]` (`2 * d_ff` outputs,
    `stride=2`, so each device holds its slice of both) and the hidden activation is
    `silu(gate) * up`; otherwise `activation(up)`.
    """

    up: ColumnParallelLinear
    down: RowParallelLinear
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
        self.d_model = d_model
        self.d_ff = d_ff
        self.swiglu = swiglu
        self.activation = activation
        self.style = style

    def __call__(
        self, x: Float[Array, "... tokens d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... tokens d_model"]:
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron") or `[..., T/n, d_model]` ("sequence").
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        `[..., T(/n), d_model]`, laid out like `x`.
        """
        # f32[..., T(/n), D] -> f32[..., T, F/n] (or 2 F/n with swiglu)
        h = self.up(x)
        if self.swiglu:
            h = h.reshape(*h.shape[:-1], 2, -1)
            h = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
        else:
            h = self.activation(h)
        # f32[..., T, F/n] @ f32[F/n, D] -> f32[..., T(/n), D]
        return self.down(h)


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
        axis_name: str = "tp",
        style: str = "megatron",
        rotary: bool = False,
        rotary_base: float = 10000.0,
        swiglu: bool = False,
        activation: Callable[[Array], Array] = jax.nn.gelu,
        bias: bool = False,
        eps: float = 1e-6,
        init_type: str = "xavier_normal",
        dtype: Any = None,
        moe: MoE | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `d_model`: the model width.
        - `n_heads`: the number of attention heads (divisible by the axis size).
        - `d_ff`: the MLP's hidden width (divisible by the axis size); unused with `moe`.
        - `axis_name`: the tensor-parallel mesh axis.
        - `style`: `"megatron"` (activations replicated over the axis) or `"sequence"`
          (activations split over the sequence between sub-layers).
        - `rotary`: rotary position embeddings in attention.
        - `rotary_base`: their frequency base.
        - `swiglu`: a SwiGLU MLP instead of `activation`.
        - `activation`: the MLP's activation without `swiglu`.
        - `bias`: biases in the projections.
        - `eps`: the norms' epsilon.
        - `init_type`: the projections' init type.
        - `dtype`: the parameters' dtype.
        - `moe`: a mixture-of-experts layer to use as the feed-forward sub-layer
          instead of the MLP (its width must be `d_model`).
        - `key`: a PRNG key.
        """
        _check_style("TransformerBlock", style)
        if moe is not None and moe.hidden != d_model:
            raise LayerConfigError(
                f"TransformerBlock: the MoE layer's hidden={moe.hidden} is not d_model={d_model}."
            )
        akey, mkey = jax.random.split(key)
        self.norm1 = RMSNorm(d_model, eps=eps, dtype=dtype)
        self.attn = ParallelAttention(
            d_model, n_heads, axis_name=axis_name, style=style, rotary=rotary,
            rotary_base=rotary_base, bias=bias, init_type=init_type, dtype=dtype, key=akey,
        )  # fmt: skip
        self.norm2 = RMSNorm(d_model, eps=eps, dtype=dtype)
        self.mlp = moe if moe is not None else ParallelMLP(
            d_model, d_ff, axis_name=axis_name, style=style, swiglu=swiglu,
            activation=activation, bias=bias, init_type=init_type, dtype=dtype, key=mkey,
        )  # fmt: skip
        self.style = style
        self.axis_name = axis_name

    def __call__(
        self, x: Float[Array, "... tokens d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... tokens d_model"]:
        """**Arguments:**

        - `x`: `[..., T, d_model]` ("megatron", replicated over the axis) or this
          device's `[..., T/n, d_model]` ("sequence").
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

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
        return self.call_with_aux(x)[0]

    def call_with_aux(
        self, x: Float[Array, "... tokens d_model"]
    ) -> tuple[Float[Array, "... tokens d_model"], MoEAux | None]:
        """The block's output and, with an MoE layer, its `MoEAux` (else `None`).

        **Arguments:**

        - `x`: as for `__call__` (`[batch, seq/ep, d_model]` with an MoE layer).

        **Returns:**

        `(y, aux)`: the block's output laid out like `x`, and the MoE layer's
        auxiliary losses and statistics or `None`.
        """
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(h)
            return x + y, aux
        return x + self.mlp(h), None
