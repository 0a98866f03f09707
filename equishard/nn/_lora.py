"""LoRA adapters on the projections of a transformer block, one per target.

A `LoRAAdapter` adds `scale * (x @ A.T) @ B.T` to one projection's output, where `A` is
`[r, in]` and `B` is `[out, r]` (PEFT's `lora_A.weight` and `lora_B.weight`). It is
applied beside the projection, not inside it: a fused projection (the stride-3 q/k/v
layer, SwiGLU's stride-2 gate/up layer, a grouped-query attention's stride-2 k/v layer)
gets one adapter per target, each added to that target's part of the output before any
head split, so that the adapters map one to one onto PEFT's `q_proj`, `k_proj`, ...

Each adapter is split over the tensor axis as the layer it adapts:

- a column target (q, k, v, gate, up): `A` replicated, `B` split over its rows (the
  outputs) like the weight; the input's rank-`r` projection enters the parallel region
  (`mp_copy`, or with sequence parallelism an all-gather of `[T/n, r]` over the tokens).
- a row target (o, down): `A` split over its columns (the inputs) like the weight, `B`
  replicated; the rank-`r` partial sums leave the region with an all-reduce (or a
  reduce-scatter over the tokens) of `[T, r]`, before `B`.
- k and v of a grouped-query attention whose key/value heads are replicated over the axis
  (`SharedKVLinear`): both replicated, each device taking the rows of the heads its
  query heads read.

Dropout (`LoRA(dropout=p)`, PEFT's `lora_dropout`) drops the adapter's input, `scale *
B(A(dropout(x)))`, the projection itself seeing `x` whole; each target draws its own
mask. The mask is a counter-based hash (MurmurHash3's mixing) of the step's key,
the block's global layer index, the target and each element's global coordinates: the
example's index in the global batch, the token's position (and document), the feature's
index in the whole activation (a row adapter's input is split over the tensor axis, a
sequence-parallel column adapter's over the tokens). Every device computes its block of
the one-device mask, with no communication, under any layout and micro-batching
(`LoRADropout`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt32

from .._axes import is_bound
from .._errors import LayerConfigError
from ..core import gather_tokens, mp_copy, mp_reduce, scatter_tokens
from ..core._internal import hash_bits, hash_keep, hash_seed
from ..sharding import Sharded
from ._initializers import axis_size, check_positive, init_weight, value_of
from ._linear import matmul_t

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections a `LoRA` can adapt, in this order (PEFT's `q_proj`, `k_proj`, `v_proj`,
`o_proj`, `gate_proj`, `up_proj`, `down_proj`)."""
TARGETS = LORA_TARGETS

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
KINDS = ("column", "row", "shared")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on a transformer's projections (a value: what to add, not the arrays).

    **Fields:**

    - `rank`: the adapters' rank `r` (PEFT's `r`), a positive integer no larger than
      the width of any layer it adapts.
    - `alpha`: the update is scaled by `alpha / rank` (PEFT's `lora_alpha` and its
      default scaling; rank-stabilised scaling is not implemented).
    - `dropout`: the probability of dropping each element of an adapter's input
      (PEFT's `lora_dropout`; inverted dropout: the kept ones are scaled by `1 / (1 -
      dropout)`), drawn only where the model is given a key (`GPT.loss(batch, key)`):
      evaluation and generation run without it. The mask does not depend on the layout.
    - `targets`: the projections to adapt, a subset of `TARGETS`; kept in `TARGETS`' order.

    **Raises:**

    `LayerConfigError` naming a target outside `TARGETS`, a rank that is not a positive
    integer, a non-positive `alpha` or a `dropout` outside `[0, 1)`.
    """

    rank: int
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    def __post_init__(self) -> None:
        check_positive("LoRA", "rank", self.rank)
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise LayerConfigError(
                f"LoRA: targets {list(targets)!r}: "
                + (f"{', '.join(map(repr, unknown))} is no target" if unknown else "none given")
                + f"; choose among {', '.join(TARGETS)}."
            )
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
        if not float(self.alpha) > 0:
            raise LayerConfigError(f"LoRA: alpha must be positive, got {self.alpha!r}.")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not 0.0 <= float(self.dropout) < 1.0:
            raise LayerConfigError(f"LoRA: dropout must be in [0, 1), got {self.dropout!r}.")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """`alpha / rank`, the factor of `B @ A`."""
        return self.alpha / self.rank


class LoRADropout(eqx.Module):
    """Where the adapters' dropout masks come from in one forward pass (local view).

    A mask element is `hash_keep(seed, p, *where, example, token, feature)`: `seed` from
    the step's key, `where` the coordinates folded in on the way down (the block's layer
    index, then the target), and the element's global coordinates. Built by the model
    for a batch (`GPT.loss` with a key), passed down the blocks; `None` means no dropout.

    **Fields:**

    - `seed`: `uint32[2]`, with the layer and target folded in by `at`.
    - `examples`: `int32[B]`, the global indices of the local examples.
    - `positions`: `int32[B, T]` (or `[1, T]`, `[T]`: the same for every example), the
      global positions of the `T` tokens a block's attention sees (all of them under
      sequence parallelism; the device's part of the sequence under context
      parallelism).
    - `segments`: the tokens' documents (a packed batch), as `positions`, or `None`.
    """

    seed: UInt32[Array, "2"]
    examples: Int[Array, " batch"]
    positions: Int[Array, "..."]
    segments: Int[Array, "..."] | None = None

    @staticmethod
    def from_key(
        key: PRNGKeyArray, examples: Int[Array, " batch"], positions: Int[Array, "..."],
        segments: Int[Array, "..."] | None = None,
    ) -> "LoRADropout":  # fmt: skip
        """The masks of the batch whose global example indices are `examples`, drawn from `key`."""
        return LoRADropout(hash_seed(key), examples, positions, segments)

    def at(self, *where: Int[Array, ""] | int) -> "LoRADropout":
        """This draw with global coordinates (a layer index, a target) folded into the seed."""
        seed = jnp.stack([hash_bits(self.seed, *where), hash_bits(self.seed[::-1], *where)])
        return dataclasses.replace(self, seed=seed)

    def rows(self, rows: slice) -> "LoRADropout":
        """The draw of the examples `rows` of the local batch (a piece of it)."""

        def take(a: Array) -> Array:
            return a if a.ndim < 2 or a.shape[0] == 1 else a[rows]

        segments = None if self.segments is None else take(self.segments)
        return LoRADropout(self.seed, self.examples[rows], take(self.positions), segments)

    def apply(
        self, x: Float[Array, "batch tokens features"], rate: float, *, tokens_axis: str | None = None,
        features_axis: str | None = None,
    ) -> Float[Array, "batch tokens features"]:  # fmt: skip
        """`x` with dropout at `rate` (the kept elements scaled by `1 / (1 - rate)`).

        **Arguments:**

        - `x`: this device's `[B, t, f]` block of the global `[B, T, F]` activation.
        - `rate`: the probability of dropping an element.
        - `tokens_axis`: the mesh axis `x`'s tokens are split over (`t = T/n`, blocks in
          the axis' order), or `None`.
        - `features_axis`: the mesh axis its features are split over, or `None`.
        """
        t, f = x.shape[-2:]
        positions, segments = self.positions, self.segments
        if tokens_axis is not None and is_bound(tokens_axis):
            start = jax.lax.axis_index(tokens_axis) * t
            positions = jax.lax.dynamic_slice_in_dim(positions, start, t, axis=-1)
            if segments is not None:
                segments = jax.lax.dynamic_slice_in_dim(segments, start, t, axis=-1)
        features = jnp.arange(f, dtype=jnp.int32)
        if features_axis is not None and is_bound(features_axis):
            features = features + jax.lax.axis_index(features_axis).astype(jnp.int32) * f
        # int32[B, 1], int32[B|1, t] -> the token coordinates [B, t, 1]; the features [f]
        coords = [self.examples[:, None], positions] + ([] if segments is None else [segments])
        keep = hash_keep(self.seed, rate, *(c[..., None] for c in coords), features)
        return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


class LoRAAdapter(eqx.Module):
    """One projection's adapter: `scale * (x @ A.T) @ B.T`, split like the projection.

    Fields: `a` (`Sharded`, `[r, in]`: replicated for a column or shared target, split
    `P(None, axis)` for a row target) and `b` (`[out, r]`: split `P(axis, None)` for a
    column target, replicated otherwise); `kind` (`"column"`, `"row"` or `"shared"`, see
    the module documentation), `scale`, `alpha`, `dropout` (the rate on its input), the
    tensor axis, whether its input is split over the tokens (`sequence_parallel`), and
    for a shared target the key/value heads and their size.
    """

    a: Sharded
    b: Sharded
    kind: str = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(
        self, in_features: int, out_features: int, lora: LoRA, *, kind: str, axis_name: str = "tp",
        sequence_parallel: bool = False, heads: int = 1, name: str = "LoRAAdapter", dtype: Any = None,
        key: PRNGKeyArray,
    ):  # fmt: skip
        """**Arguments:**

        - `in_features`, `out_features`: the adapted projection's global sizes (of the
          target's part of a fused projection).
        - `lora`: the rank, alpha and dropout rate.
        - `kind`: `"column"`, `"row"` or `"shared"`.
        - `axis_name`: the tensor-parallel axis.
        - `sequence_parallel`: the column adapter's input is split over the tokens (a
          row adapter's output is then too).
        - `heads`: a shared adapter's key/value heads (its outputs are `heads` heads).
        - `name`: the target's name in messages.
        - `dtype`: the arrays' dtype.
        - `key`: draws `A` (kaiming-uniform, as PEFT's); `B` is zero, so that a fresh
          adapter adds exactly nothing.

        **Raises:**

        `LayerConfigError` for a rank above the layer's width.
        """
        if kind not in KINDS:
            raise LayerConfigError(f"LoRAAdapter: kind must be one of {KINDS}, got {kind!r}.")
        if lora.rank > min(in_features, out_features):
            raise LayerConfigError(
                f"LoRA: rank {lora.rank} on {name} is above the layer's width "
                f"(in {in_features}, out {out_features}); use a rank of at most "
                f"{min(in_features, out_features)}."
            )
        # f32[r, in] and f32[out, r] (global); the factor on the split features split too.
        a = init_weight(key, (lora.rank, in_features), "kaiming_uniform", dtype=dtype)
        b = jnp.zeros((out_features, lora.rank), a.dtype)
        self.a = Sharded(a, P(None, axis_name) if kind == "row" else P())
        self.b = Sharded(b, P(axis_name, None) if kind == "column" else P())
        self.kind, self.alpha, self.scale, self.dropout = kind, lora.alpha, lora.scale, lora.dropout
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        self.heads, self.head_dim = heads, out_features // heads

    @property
    def rank(self) -> int:
        """The adapter's rank `r` (`A`'s rows)."""
        return value_of(self.a).shape[-2]

    def column(
        self, x: Float[Array, "... in_features"], dropout: LoRADropout | None = None
    ) -> Float[Array, "... out_local"]:
        """A column or shared adapter's addition to this device's part of the outputs.

        **Arguments:**

        - `x`: the projection's input as the block holds it: `[..., T, in]` replicated
          over the axis, or with `sequence_parallel` this device's `[..., T/n, in]`.
        - `dropout`: where this target's dropout mask comes from (`x` is `[B, T(/n),
          in]`), or `None`: no dropout.

        **Returns:**

        `[..., T, out/n]` (a shared adapter: `[..., T, h * head_dim]`, the `h` key/value
        heads this device's query heads read), for every token.
        """
        if dropout is not None and self.dropout:
            x = dropout.apply(x, self.dropout, tokens_axis=self.axis_name if self.sequence_parallel else None)
        # f32[..., T(/n), in] @ f32[in, r] -> f32[..., T(/n), r]
        xa = matmul_t(x, value_of(self.a))
        b = value_of(self.b)
        if is_bound(self.axis_name):
            if self.sequence_parallel:
                xa = gather_tokens(xa, self.axis_name)  # f32[..., T/n, r] -> f32[..., T, r]
            else:
                xa = mp_copy(xa, axis_name=self.axis_name)  # its gradient summed over the axis
            if self.kind == "shared":
                n = axis_size(self.axis_name)
                local = max(self.heads // n, 1)
                start = jax.lax.axis_index(self.axis_name) * self.heads // n
                # f32[Hkv hd, r] -> f32[h hd, r]: the rows of this device's heads
                b = jax.lax.dynamic_slice_in_dim(b, start * self.head_dim, local * self.head_dim, axis=0)
        # f32[..., T, r] @ f32[r, out/n] -> f32[..., T, out/n]
        return self.scale * matmul_t(xa, b)

    def row(
        self, h: Float[Array, "... in_local"], dropout: LoRADropout | None = None
    ) -> Float[Array, "... out_features"]:
        """A row adapter's addition to the projection's (reduced) output.

        **Arguments:**

        - `h`: this device's `[..., T, in/n]`, the row projection's split input.
        - `dropout`: where this target's dropout mask comes from (`h` is `[B, T, in/n]`),
          or `None`: no dropout.

        **Returns:**

        `[..., T, out]` replicated over the axis (with `sequence_parallel`, this
        device's `[..., T/n, out]`), laid out as the row projection's output.
        """
        if dropout is not None and self.dropout:
            h = dropout.apply(h, self.dropout, features_axis=self.axis_name)
        # f32[..., T, in/n] @ f32[in/n, r] -> f32[..., T, r] (a partial sum)
        xa = matmul_t(h, value_of(self.a))
        if is_bound(self.axis_name):
            if self.sequence_parallel:
                xa = scatter_tokens(xa, self.axis_name)  # -> f32[..., T/n, r]
            else:
                xa = mp_reduce(xa, axis_name=self.axis_name)  # -> f32[..., T, r]
        # f32[..., T(/n), r] @ f32[r, out] -> f32[..., T(/n), out]
        return self.scale * matmul_t(xa, value_of(self.b))


def _adapter_keys(key: PRNGKeyArray) -> dict[str, PRNGKeyArray]:
    """One key per target, independent of the keys the layer's own arrays draw."""
    base = jax.random.fold_in(key, 0x10A)
    return {t: jax.random.fold_in(base, i) for i, t in enumerate(TARGETS)}


def attention_adapters(
    lora: LoRA | None, d_model: int, n_heads: int, n_kv_heads: int, *, kv_replicated: bool,
    axis_name: str, sequence_parallel: bool, dtype: Any, key: PRNGKeyArray,
) -> dict[str, LoRAAdapter] | None:  # fmt: skip
    """The adapters of an attention's targets among `lora.targets` (`None`: none)."""
    if lora is None or not any(t in ATTENTION_TARGETS for t in lora.targets):
        return None
    keys = _adapter_keys(key)
    kv = n_kv_heads * (d_model // n_heads)
    shared = n_kv_heads < n_heads and kv_replicated
    sizes = {"q": (d_model, d_model), "k": (d_model, kv), "v": (d_model, kv), "o": (d_model, d_model)}
    out = {}
    for t in (t for t in lora.targets if t in ATTENTION_TARGETS):
        kind = "row" if t == "o" else "shared" if shared and t in ("k", "v") else "column"
        out[t] = LoRAAdapter(
            *sizes[t], lora, kind=kind, axis_name=axis_name, sequence_parallel=sequence_parallel,
            heads=n_kv_heads if kind == "shared" else 1, name=t, dtype=dtype, key=keys[t],
        )  # fmt: skip
    return out


def mlp_adapters(
    lora: LoRA | None, d_model: int, d_ff: int, *, swiglu: bool, axis_name: str,
    sequence_parallel: bool, dtype: Any, key: PRNGKeyArray,
) -> dict[str, LoRAAdapter] | None:  # fmt: skip
    """The adapters of an MLP's targets among `lora.targets` (`None`: none)."""
    if lora is None or not any(t in MLP_TARGETS for t in lora.targets):
        return None
    if "gate" in lora.targets and not swiglu:
        raise LayerConfigError("LoRA: target 'gate': the MLP has no gate (it is not SwiGLU).")
    keys = _adapter_keys(key)
    sizes = {"gate": (d_model, d_ff), "up": (d_model, d_ff), "down": (d_ff, d_model)}
    return {
        t: LoRAAdapter(
            *sizes[t], lora, kind="row" if t == "down" else "column", axis_name=axis_name,
            sequence_parallel=sequence_parallel, name=t, dtype=dtype, key=keys[t],
        )  # fmt: skip
        for t in lora.targets
        if t in MLP_TARGETS
    }


def _for_target(dropout: LoRADropout | None, target: str) -> LoRADropout | None:
    """The draw of `target`'s mask: its index in `TARGETS` folded in."""
    return None if dropout is None else dropout.at(TARGETS.index(target))


def adapted(
    adapters: dict[str, LoRAAdapter] | None, target: str, y: Array, x: Array,
    dropout: LoRADropout | None = None,
) -> Array:  # fmt: skip
    """`y` plus the column adapter of `target` applied to `x` (its input dropped as
    `dropout` draws), or `y` without one."""
    if adapters is None or target not in adapters:
        return y
    return y + adapters[target].column(x, _for_target(dropout, target))


def adapted_row(
    adapters: dict[str, LoRAAdapter] | None, target: str, y: Array, h: Array,
    dropout: LoRADropout | None = None,
) -> Array:  # fmt: skip
    """`y` plus the row adapter of `target` applied to `h` (its input dropped as
    `dropout` draws), or `y` without one."""
    if adapters is None or target not in adapters:
        return y
    return y + adapters[target].row(h, _for_target(dropout, target))


def adapter_dropout(tree: Any) -> float:
    """The largest dropout rate of the adapters `tree` holds (0 without any)."""
    adapters = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LoRAAdapter))
    return max((a.dropout for a in adapters if isinstance(a, LoRAAdapter)), default=0.0)


def lora_of(tree: Any) -> LoRA | None:
    """The `LoRA` whose adapters `tree` holds (in dicts keyed by target), or `None`.

    **Raises:**

    `LayerConfigError` if its adapters disagree on the rank, alpha or dropout.
    """
    found: dict[str, LoRAAdapter] = {}
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, LoRAAdapter))[0]
    for path, leaf in leaves:
        if isinstance(leaf, LoRAAdapter):
            found.setdefault(str(getattr(path[-1], "key", "")), leaf)
    if not found:
        return None
    kinds = {(a.rank, a.alpha, a.dropout) for a in found.values()}
    if len(kinds) > 1:
        raise LayerConfigError(f"LoRA: the model's adapters disagree on (rank, alpha, dropout): {sorted(kinds)}.")
    (rank, alpha, dropout), = kinds
    return LoRA(rank, alpha, dropout, targets=tuple(found))
