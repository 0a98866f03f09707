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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import is_bound
from .._errors import LayerConfigError
from ..core import gather_tokens, mp_copy, mp_reduce, scatter_tokens
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
    - `dropout`: dropout on the adapters' input (PEFT's `lora_dropout`). Only `0.0` is
      implemented (the reference GPT draws no per-example keys); larger values are
      refused when adapters are built.
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


class LoRAAdapter(eqx.Module):
    """One projection's adapter: `scale * (x @ A.T) @ B.T`, split like the projection.

    Fields: `a` (`Sharded`, `[r, in]`: replicated for a column or shared target, split
    `P(None, axis)` for a row target) and `b` (`[out, r]`: split `P(axis, None)` for a
    column target, replicated otherwise); `kind` (`"column"`, `"row"` or `"shared"`, see
    the module documentation), `scale`, `alpha`, the tensor axis, whether its input is
    split over the tokens (`sequence_parallel`), and for a shared target the key/value
    heads and their size.
    """

    a: Sharded
    b: Sharded
    kind: str = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    scale: float = eqx.field(static=True)
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
        - `lora`: the rank, alpha and dropout.
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

        `LayerConfigError` for a rank above the layer's width, or dropout.
        """
        if kind not in KINDS:
            raise LayerConfigError(f"LoRAAdapter: kind must be one of {KINDS}, got {kind!r}.")
        if lora.rank > min(in_features, out_features):
            raise LayerConfigError(
                f"LoRA: rank {lora.rank} on {name} is above the layer's width "
                f"(in {in_features}, out {out_features}); use a rank of at most "
                f"{min(in_features, out_features)}."
            )
        if lora.dropout:
            raise LayerConfigError(
                f"LoRA: dropout={lora.dropout} is not implemented (the adapters' input is "
                f"not dropped); use dropout=0.0."
            )
        # f32[r, in] and f32[out, r] (global); the factor on the split features split too.
        a = init_weight(key, (lora.rank, in_features), "kaiming_uniform", dtype=dtype)
        b = jax.numpy.zeros((out_features, lora.rank), a.dtype)
        self.a = Sharded(a, P(None, axis_name) if kind == "row" else P())
        self.b = Sharded(b, P(axis_name, None) if kind == "column" else P())
        self.kind, self.alpha, self.scale = kind, lora.alpha, lora.scale
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        self.heads, self.head_dim = heads, out_features // heads

    @property
    def rank(self) -> int:
        """The adapter's rank `r` (`A`'s rows)."""
        return value_of(self.a).shape[-2]

    def column(self, x: Float[Array, "... in_features"]) -> Float[Array, "... out_local"]:
        """A column or shared adapter's addition to this device's part of the outputs.

        **Arguments:**

        - `x`: the projection's input as the block holds it: `[..., T, in]` replicated
          over the axis, or with `sequence_parallel` this device's `[..., T/n, in]`.

        **Returns:**

        `[..., T, out/n]` (a shared adapter: `[..., T, h * head_dim]`, the `h` key/value
        heads this device's query heads read), for every token.
        """
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

    def row(self, h: Float[Array, "... in_local"]) -> Float[Array, "... out_features"]:
        """A row adapter's addition to the projection's (reduced) output.

        **Arguments:**

        - `h`: this device's `[..., T, in/n]`, the row projection's split input.

        **Returns:**

        `[..., T, out]` replicated over the axis (with `sequence_parallel`, this
        device's `[..., T/n, out]`), laid out as the row projection's output.
        """
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


def adapted(adapters: dict[str, LoRAAdapter] | None, target: str, y: Array, x: Array) -> Array:
    """`y` plus the column adapter of `target` applied to `x`, or `y` without one."""
    if adapters is None or target not in adapters:
        return y
    return y + adapters[target].column(x)


def adapted_row(adapters: dict[str, LoRAAdapter] | None, target: str, y: Array, h: Array) -> Array:
    """`y` plus the row adapter of `target` applied to `h`, or `y` without one."""
    if adapters is None or target not in adapters:
        return y
    return y + adapters[target].row(h)


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
    kinds = {(a.rank, a.alpha) for a in found.values()}
    if len(kinds) > 1:
        raise LayerConfigError(f"LoRA: the model's adapters disagree on (rank, alpha): {sorted(kinds)}.")
    (rank, alpha), = kinds
    return LoRA(rank, alpha, targets=tuple(found))
