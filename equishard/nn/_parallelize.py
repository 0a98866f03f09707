"""Tensor parallelism for a model written without equishard: `parallelize(model, plan, mesh)`.

What torchtitan's `parallelize_module` is for PyTorch: a plan maps path patterns to
styles, and the `eqx.nn.Linear` / `eqx.nn.Embedding` at matching paths become
equishard's column-, row- and vocabulary-parallel layers holding the original weights.
The model's code is not edited: it calls its layers as before, and inside `shard_map`
those layers communicate. Attention modules get their head counts divided over the
axis at call time, and the dropout on their split activations draws the one-device
mask. See the "Your own model" guide.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from equinox.nn._attention import dot_product_attention
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import axis_size, is_bound, varying_axes
from .._errors import EquishardError, LayerConfigError, SpecError
from .._text import first_line
from .._warn import warn
from ..core import bernoulli_block
from ..sharding import Sharded, filter_shard_map
from ..sharding._internal import compile_pattern, is_tracer, map_modules
from ._embedding import ParallelEmbedding
from ._linear import ColumnParallelLinear, RowParallelLinear

# ---------------------------------------------------------------------------------------
# Styles: what a plan entry does to the module at a matching path.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ColwiseParallel:
    """Split an `eqx.nn.Linear` over its output features (`ColumnParallelLinear`).

    **Arguments:**

    - `gather_output`: all-gather the outputs (a replicated result, e.g. an untied LM
      head whose logits the loss reads whole); default `False`: the output stays split,
      for the head-split attention or the row-parallel layer after it.
    - `sequence_parallel`: the input arrives split over its token dimension (-2) and
      is all-gathered first (Megatron sequence parallelism).
    """

    gather_output: bool = False
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class RowwiseParallel:
    """Split an `eqx.nn.Linear` over its input features (`RowParallelLinear`).

    **Arguments:**

    - `input_is_parallel`: the input is already split (the output of a column layer or
      of head-split attention); default `True`. `False`: each device takes its slice.
    - `sequence_parallel`: reduce-scatter the output over its token dimension (-2)
      instead of all-reducing it.
    """

    input_is_parallel: bool = True
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class EmbeddingParallel:
    """Split an `eqx.nn.Embedding` (`ParallelEmbedding`).

    **Arguments:**

    - `partition`: `"vocab"` (default: rows split, partial lookups summed) or
      `"embedding"` (features split, lookups all-gathered).
    - `sequence_parallel`: return this device's tokens only.
    """

    partition: str = "vocab"
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """A norm applied to activations split over their tokens (Megatron sequence parallelism).

    The module's arrays stay replicated and it needs no communication: it normalises
    each token on its own, and JAX sums its parameters' gradients over the axis. The
    entry documents the plan and is checked: the module must hold no `eqx.nn.Linear`
    or `eqx.nn.Embedding`.
    """


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Keep the module whole on every device (its arrays replicated); stops the plan's
    other entries from converting anything inside it."""


@dataclasses.dataclass(frozen=True, init=False)
class HeadParallel:
    """An attention module whose heads are split over the axis.

    Its linear layers are split by their own plan entries (q, k, v column-wise, the
    output row-wise); this entry divides the named head-count fields by the axis size
    whenever the module is called inside `shard_map`, so code such as
    `q.reshape(seq, self.n_heads, self.head_dim)` sees the local head count. For
    `eqx.nn.MultiheadAttention` the fields (`num_heads`) and the projections are
    handled without further entries, and its dropout (`dropout_p > 0`) draws each
    head's one-device mask.

    **Arguments:**

    - `*fields`: the names of the module's head-count fields, e.g. `"n_heads",
      "n_kv_heads"` (each must be divisible by the axis size).
    - `dropout_dim`: the dimension of the head-split activation that the module's own
      `eqx.nn.Dropout` fields act on (attention weights `[heads, q, k]`: `0`); they
      then draw their block of the one-device mask. `None`: the module has no dropout
      on split activations.
    """

    fields: tuple[str, ...]
    dropout_dim: int | None

    def __init__(self, *fields: str, dropout_dim: int | None = None):
        object.__setattr__(self, "fields", tuple(fields))
        object.__setattr__(self, "dropout_dim", dropout_dim)


@dataclasses.dataclass(frozen=True)
class DropoutParallel:
    """An `eqx.nn.Dropout` whose input is split over the axis along `dim` (e.g. after a
    column-parallel layer, the features: `dim=-1`): it becomes a `SplitDropout`, each
    device drawing its block of the one-device mask.

    **Arguments:**

    - `dim`: the dimension of the dropout's input (as the module sees it, inside the
      model's own `vmap`s) that the axis splits.
    """

    dim: int = -1


Style = ColwiseParallel | RowwiseParallel | EmbeddingParallel | SequenceParallel | Replicate | HeadParallel | DropoutParallel

STYLE_NAMES: dict[str, Style] = {
    "column": ColwiseParallel(),
    "row": RowwiseParallel(),
    "vocab": EmbeddingParallel("vocab"),
    "embedding": EmbeddingParallel("embedding"),
    "sequence_parallel": SequenceParallel(),
    "replicate": Replicate(),
    "heads": HeadParallel(),
}


# ---------------------------------------------------------------------------------------
# Layers made from Equinox's, which `unbox` turns back into Equinox's.
# ---------------------------------------------------------------------------------------


def rebuild(cls: type, source: Any, **fields: Any) -> Any:
    """An instance of `cls` with the dataclass fields of `source`, some replaced.

    Built without calling `cls.__init__` (no initialisation, no key), as Equinox's own
    `tree_unflatten` builds modules.
    """
    out = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(out, f.name, fields[f.name] if f.name in fields else getattr(source, f.name))
    return out


def plain_linear(weight: Any, bias: Any) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` holding `weight` `[out, in]` and `bias` `[out]` (or `None`)."""
    fields = {
        "weight": weight,
        "bias": bias,
        "in_features": int(weight.shape[1]),
        "out_features": int(weight.shape[0]),
        "use_bias": bias is not None,
    }
    return rebuild(eqx.nn.Linear, None, **fields)


class PlannedColumnLinear(ColumnParallelLinear):
    """A `ColumnParallelLinear` that `parallelize` made from an `eqx.nn.Linear`."""

    def __unbox__(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` it was made from, for `equishard.unbox`."""
        return plain_linear(self.master_weight, self.master_bias)


class PlannedRowLinear(RowParallelLinear):
    """A `RowParallelLinear` that `parallelize` made from an `eqx.nn.Linear`."""

    def __unbox__(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` it was made from, for `equishard.unbox`."""
        return plain_linear(self.master_weight, self.master_bias)


class PlannedEmbedding(ParallelEmbedding):
    """A `ParallelEmbedding` that `parallelize` made from an `eqx.nn.Embedding`."""

    def __unbox__(self) -> eqx.nn.Embedding:
        """The `eqx.nn.Embedding` it was made from, for `equishard.unbox`."""
        return eqx.nn.Embedding(weight=self.master_weight)


class SplitDropout(eqx.Module):
    """`eqx.nn.Dropout` on an activation split over `axis_name` along `dim`.

    Each device draws its block of the one-device mask (`equishard.core.bernoulli_block`),
    so the masks do not depend on the layout. Outside `shard_map` it is
    `eqx.nn.Dropout`; `equishard.unbox` gives that back.
    """

    p: float
    inference: bool
    axis_name: str = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __call__(self, x: Any, *, key: Any = None, inference: bool | None = None) -> Any:
        """As `eqx.nn.Dropout.__call__`: `x` with elements zeroed with probability `p`."""
        if inference is None:
            inference = self.inference
        if isinstance(self.p, (int, float)) and self.p == 0:
            inference = True
        if inference:
            return x
        if key is None:
            raise LayerConfigError("Dropout requires a key when running in non-deterministic mode.")
        q = 1 - jax.lax.stop_gradient(self.p)
        axis = self.axis_name if is_bound(self.axis_name) else None
        mask = bernoulli_block(key, q, x.shape, axis_name=axis, dim=self.dim)
        return jnp.where(mask, x / q, 0)

    def __unbox__(self) -> eqx.nn.Dropout:
        """The `eqx.nn.Dropout` it was made from, for `equishard.unbox`."""
        return eqx.nn.Dropout(self.p, inference=self.inference)


class GuardedDropout(eqx.nn.Dropout):
    """An `eqx.nn.Dropout` of a parallelised model that no plan entry converted.

    On an input that does not vary over `axis_name` it is `eqx.nn.Dropout` (every
    device draws the same, one-device mask); on an input split over `axis_name` it
    raises a `LayerConfigError` naming its `path` when traced, instead of drawing each
    device's block from the whole mask's key. `equishard.unbox` gives the
    `eqx.nn.Dropout` back.
    """

    axis_name: str = eqx.field(static=True)
    path: str = eqx.field(static=True)

    def __call__(self, x: Any, *, key: Any = None, inference: bool | None = None) -> Any:
        """As `eqx.nn.Dropout.__call__`; raises on an input split over `axis_name`."""
        active = not (self.inference if inference is None else inference)
        if active and is_bound(self.axis_name) and self.axis_name in varying_axes(x):
            pattern = re.escape(self.path)
            raise LayerConfigError(
                f"parallelize: the eqx.nn.Dropout at `{self.path}` acts on an activation split "
                f"over {self.axis_name!r} (local shape {tuple(x.shape)}): each device would draw "
                f"its block's mask from the whole mask's key, not its block of the one-device "
                f"mask. Add the plan entry `r\"{pattern}\": es.nn.DropoutParallel(dim=...)`, "
                f"dim the dimension of its input that {self.axis_name!r} splits (the features "
                f"after a column-parallel layer: -1), or apply the dropout where the activation "
                f"is whole."
            )
        return eqx.nn.Dropout.__call__(self, x, key=key, inference=inference)

    def __unbox__(self) -> eqx.nn.Dropout:
        """The `eqx.nn.Dropout` it was made from, for `equishard.unbox`."""
        return eqx.nn.Dropout(self.p, inference=self.inference)


def _guard(path: str, module: eqx.nn.Dropout, axis_name: str) -> GuardedDropout:
    return rebuild(GuardedDropout, module, axis_name=axis_name, path=path)


def _dropout(path: str, module: Any, style: DropoutParallel, axis_name: str) -> SplitDropout:
    if not isinstance(module, eqx.nn.Dropout):
        raise _refuse(path, module, style, "an eqx.nn.Dropout")
    return SplitDropout(module.p, module.inference, axis_name, style.dim)


_HEAD_CLASSES: dict[tuple[type, tuple[str, ...], str], type] = {}


def head_parallel_class(cls: type, fields: tuple[str, ...], axis_name: str) -> type:
    """A subclass of `cls` (same name, fields and paths) whose call divides `fields`.

    Inside `shard_map` over `axis_name` it calls `cls.__call__` on a copy of itself with
    each named field divided by the axis size; outside, `cls.__call__` as it is.
    `eqx.nn.MultiheadAttention` (its own `__call__`) gets `multihead_attention_local`
    instead, which keeps its dropout masks and per-head masks those of the one-device
    heads.
    `equishard.unbox` gives the plain `cls` instance back.
    """
    cache_key = (cls, fields, axis_name)
    if cache_key not in _HEAD_CLASSES:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_bound(axis_name):
                return cls.__call__(self, *args, **kwargs)
            n = axis_size(axis_name)
            local = rebuild(cls, self, **{f: getattr(self, f) // n for f in fields})
            if cls.__call__ is eqx.nn.MultiheadAttention.__call__:
                return multihead_attention_local(local, self.num_heads, axis_name, *args, **kwargs)
            return cls.__call__(local, *args, **kwargs)

        def __unbox__(self: Any) -> Any:
            return rebuild(cls, self)

        namespace = {
            "__call__": __call__,
            "__unbox__": __unbox__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        _HEAD_CLASSES[cache_key] = type(cls.__name__, (cls,), namespace)
    return _HEAD_CLASSES[cache_key]


def multihead_attention_local(
    local: eqx.nn.MultiheadAttention,
    num_heads: int,
    axis_name: str,
    query: Array,
    key_: Array,
    value: Array,
    mask: Array | None = None,
    *,
    key: PRNGKeyArray | None = None,
    inference: bool | None = None,
    deterministic: bool | None = None,
    process_heads: Callable[[Array, Array, Array], tuple[Array, Array, Array]] | None = None,
) -> Array:
    """`eqx.nn.MultiheadAttention.__call__` for this device's heads, inside `shard_map`.

    `local` holds this device's `num_heads / n` heads (its projections split over
    `axis_name`). Equinox splits the dropout key into one key per head; here it is split
    into `num_heads` keys, one per *global* head, and this device takes its heads' keys
    (and, for a per-head mask `[num_heads, q, kv]`, its heads' masks), so every head
    draws the dropout mask it draws on one device, whatever the layout.
    """
    if deterministic is not None:
        inference = deterministic
    heads = local.num_heads
    # Global heads [start, start + heads) are this device's.
    start = jax.lax.axis_index(axis_name) * heads
    if mask is not None and mask.ndim == 3:
        # bool[H, q, kv] -> bool[H/n, q, kv]
        mask = jax.lax.dynamic_slice_in_dim(mask, start, heads, axis=0)
    # f32[S, D] @ f32[D, H/n * h] -> f32[S, H/n, h]
    q_heads = local._project(local.query_proj, query)
    k_heads = local._project(local.key_proj, key_)
    v_heads = local._project(local.value_proj, value)
    if process_heads is not None:
        shapes = (q_heads.shape, k_heads.shape, v_heads.shape)
        q_heads, k_heads, v_heads = process_heads(q_heads, k_heads, v_heads)
        if (q_heads.shape, k_heads.shape, v_heads.shape) != shapes:
            raise LayerConfigError("MultiheadAttention: process_heads must not change the shape of the heads.")
    # One key per global head (as on one device), this device's heads' keys: key[H/n].
    keys = None if key is None else jax.lax.dynamic_slice_in_dim(jax.random.split(key, num_heads), start, heads)
    attend = functools.partial(dot_product_attention, dropout=local.dropout, inference=inference)
    if mask is not None and mask.ndim == 3:
        out = jax.vmap(attend, in_axes=1, out_axes=1)(q_heads, k_heads, v_heads, mask=mask, key=keys)
    else:
        out = jax.vmap(functools.partial(attend, mask=mask), in_axes=1, out_axes=1)(q_heads, k_heads, v_heads, key=keys)
    # f32[S, H/n, h] -> f32[S, H/n * h] @ f32[H/n * h, D] (partial) -> f32[S, D]
    return jax.vmap(local.output_proj)(out.reshape(query.shape[0], -1))


# ---------------------------------------------------------------------------------------
# Converting one module.
# ---------------------------------------------------------------------------------------


def _array(x: Any) -> Any:
    return x.value if isinstance(x, Sharded) else x


# What a plan cannot split, and the route that does: for the refusals and the probe.
_PATH_RULE_ROUTE = (
    "split its channels by path rules instead (`es.apply_rules(model, [(r\"<path>\\.weight\", "
    "P(\"tp\"))])`, the arrays that follow those channels too) and train in the global view "
    "(`make_train_step(..., view=\"global\")`), where XLA inserts the collectives (see the "
    "\"Your own model\" guide, \"Beyond transformers\")"
)


def _is_conv(module: Any) -> bool:
    return isinstance(module, (eqx.nn.Conv, eqx.nn.ConvTranspose))


def _refuse(path: str, module: Any, style: Style, expected: str) -> LayerConfigError:
    route = ""
    if _is_conv(module):
        route = f"; parallelize has no style for a convolution: {_PATH_RULE_ROUTE.replace('<path>', re.escape(path))}"
    return LayerConfigError(
        f"parallelize: the plan gives `{path or '<root>'}` ({type(module).__name__}) the style "
        f"{style!r}, which applies to {expected}{route}."
    )


def _whole_convolutions(parallel: PyTree) -> str:
    """The probe's first suspect when the parallel model has convolutions: each stays
    whole under a plan, and one after a column-parallel layer (a depthwise convolution
    over a split activation, as in a Mamba block) sees this device's channels only."""
    convs: list[str] = []

    def visit(path: str, module: Any, descend: Callable[[Any], Any]) -> Any:
        if _is_conv(module):
            convs.append(f"`{path}` ({type(module).__name__}, {module.in_channels} channels, groups={module.groups})")
            return module
        return descend(module)

    map_modules(parallel, visit)
    if not convs:
        return ""
    return (
        f"The plan leaves the convolution(s) {', '.join(convs)} whole: a convolution after "
        f"a column-parallel layer (a depthwise one over a split activation, as in a Mamba "
        f"block) is given this device's channels only, and so are the per-channel arrays "
        f"used with it. For such a model, {_PATH_RULE_ROUTE.replace('<path>', '<conv path>')}. "
    )


def _check_split(path: str, what: str, size: int, axis_name: str, n: int) -> None:
    if size % n:
        raise LayerConfigError(
            f"parallelize: `{path}` has {what} = {size}, not divisible by the size {n} of "
            f"axis {axis_name!r}."
        )


def _linear_features(path: str, module: Any, style: Style) -> tuple[int, int]:
    if not isinstance(module, eqx.nn.Linear):
        raise _refuse(path, module, style, "an eqx.nn.Linear")
    if module.in_features == "scalar" or module.out_features == "scalar":
        raise LayerConfigError(
            f"parallelize: `{path}` is an eqx.nn.Linear with scalar features; there is "
            f"nothing to split."
        )
    return int(module.in_features), int(module.out_features)


def _linear(path: str, module: Any, style: ColwiseParallel | RowwiseParallel, axis_name: str, n: int) -> Any:
    """The column- or row-parallel layer holding `module`'s arrays."""
    in_features, out_features = _linear_features(path, module, style)
    column = isinstance(style, ColwiseParallel)
    _check_split(path, "out_features" if column else "in_features", out_features if column else in_features, axis_name, n)
    # f32[out, in] split P(tp, None) (each device its out/tp rows) or P(None, tp) (its
    # in/tp columns); the bias split like the outputs, or added once after the sum.
    weight = Sharded(_array(module.weight), P(axis_name, None) if column else P(None, axis_name))
    bias = None if module.bias is None else Sharded(_array(module.bias), P(axis_name) if column else P())
    fields: dict[str, Any] = {
        "weight": weight,
        "bias": bias,
        "lora_a": None,
        "lora_b": None,
        "in_features": in_features,
        "out_features": out_features,
        "axis_name": axis_name,
        "init_type": "xavier_normal",
        "stride": 1,
        "lora_rank": None,
        "lora_scale": 0.0,
        "sequence_parallel": style.sequence_parallel,
    }
    if isinstance(style, ColwiseParallel):
        return rebuild(PlannedColumnLinear, None, gather_output=style.gather_output, **fields)
    return rebuild(PlannedRowLinear, None, input_is_parallel=style.input_is_parallel, **fields)


def _embedding(path: str, module: Any, style: EmbeddingParallel, axis_name: str, n: int) -> Any:
    if not isinstance(module, eqx.nn.Embedding):
        raise _refuse(path, module, style, "an eqx.nn.Embedding")
    if style.partition not in ("vocab", "embedding"):
        raise LayerConfigError(
            f"parallelize: EmbeddingParallel(partition={style.partition!r}) at `{path}`; "
            f"the partition is 'vocab' or 'embedding'."
        )
    vocab, dim = int(module.num_embeddings), int(module.embedding_size)
    split = "num_embeddings" if style.partition == "vocab" else "embedding_size"
    _check_split(path, split, vocab if style.partition == "vocab" else dim, axis_name, n)
    spec = P(axis_name, None) if style.partition == "vocab" else P(None, axis_name)
    fields = {
        "weight": Sharded(_array(module.weight), spec),
        "lora_a": None,
        "lora_b": None,
        "lora_scale": 0.0,
        "num_embeddings": vocab,
        "embedding_dim": dim,
        "axis_name": axis_name,
        "partition": style.partition,
        "padding_idx": None,
        "init_type": "xavier_normal",
        "sequence_parallel": style.sequence_parallel,
    }
    return rebuild(PlannedEmbedding, None, **fields)


def _split_dropouts(module: Any, axis_name: str, dim: int) -> Any:
    """`module` with each `eqx.nn.Dropout` field replaced by a `SplitDropout` over `dim`."""
    replace = {
        f.name: SplitDropout(getattr(module, f.name).p, getattr(module, f.name).inference, axis_name, dim)
        for f in dataclasses.fields(module)
        if isinstance(getattr(module, f.name), eqx.nn.Dropout)
    }
    return rebuild(type(module), module, **replace)


def _heads(path: str, module: Any, style: HeadParallel, axis_name: str, n: int) -> Any:
    if not isinstance(module, eqx.Module):
        raise _refuse(path, module, style, "an eqx.Module")
    fields = style.fields
    if isinstance(module, eqx.nn.MultiheadAttention):
        fields = fields or ("num_heads",)
        if style.dropout_dim is not None:
            raise LayerConfigError(
                f"parallelize: HeadParallel(dropout_dim={style.dropout_dim}) at `{path}`, an "
                f"eqx.nn.MultiheadAttention: its dropout already draws each head's "
                f"one-device mask; leave dropout_dim out."
            )
        dropout = module.dropout
        own_call = type(module).__call__ is not eqx.nn.MultiheadAttention.__call__
        if own_call and not dropout.inference and not (isinstance(dropout.p, (int, float)) and dropout.p == 0):
            raise LayerConfigError(
                f"parallelize: `{path}` is a {type(module).__name__} (an eqx.nn."
                f"MultiheadAttention with its own __call__) with dropout_p={dropout.p}: "
                f"splitting its key by the local head count would make its masks depend "
                f"on the tensor-parallel layout. Build it with dropout_p=0 and apply "
                f"dropout outside, or mark it inference=True."
            )
        columns = {
            name: _linear(f"{path}.{name}", getattr(module, name), ColwiseParallel(), axis_name, n)
            for name in ("query_proj", "key_proj", "value_proj")
        }
        row = _linear(f"{path}.output_proj", module.output_proj, RowwiseParallel(), axis_name, n)
        module = rebuild(type(module), module, output_proj=row, **columns)
    if not fields:
        raise LayerConfigError(
            f"parallelize: HeadParallel at `{path}` ({type(module).__name__}) names no "
            f"head-count field; give them, e.g. HeadParallel('n_heads', 'n_kv_heads')."
        )
    names = {f.name for f in dataclasses.fields(module)}
    for name in fields:
        value = getattr(module, name, None) if name in names else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise LayerConfigError(
                f"parallelize: HeadParallel at `{path}` names the field {name!r}, but "
                f"{type(module).__name__} has no integer field of that name (its fields: "
                f"{sorted(names)})."
            )
        _check_split(path, name, value, axis_name, n)
    if style.dropout_dim is not None:
        module = _split_dropouts(module, axis_name, style.dropout_dim)
    return rebuild(head_parallel_class(type(module), fields, axis_name), module)


def _holds_layers(module: Any) -> bool:
    return any(
        isinstance(m, (eqx.nn.Linear, eqx.nn.Embedding))
        for m in jax.tree.leaves(module, is_leaf=lambda x: isinstance(x, eqx.Module) and x is not module)
    )


# ---------------------------------------------------------------------------------------
# The plan and the probe.
# ---------------------------------------------------------------------------------------

Plan = Mapping[str, Style | str]


def _compile_plan(plan: Plan) -> list[tuple[re.Pattern[str], Style]]:
    if not isinstance(plan, Mapping):
        raise LayerConfigError(
            f"parallelize: the plan is a mapping from path patterns to styles, got {type(plan).__name__}."
        )
    compiled = []
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLE_NAMES:
                raise LayerConfigError(
                    f"parallelize: unknown style {style!r} for {pattern!r}; the named styles "
                    f"are {sorted(STYLE_NAMES)}, or give a style object (ColwiseParallel(...))."
                )
            style = STYLE_NAMES[style]
        if not isinstance(style, Style):
            raise LayerConfigError(f"parallelize: {pattern!r} maps to {style!r}, which is not a style.")
        compiled.append((compile_pattern(pattern, "parallelize"), style))
    return compiled


def _convert(model: PyTree, compiled: list[tuple[re.Pattern[str], Style]], axis_name: str, n: int) -> tuple[PyTree, list[bool]]:
    used = [False] * len(compiled)

    def visit(path: str, module: Any, descend: Callable[[Any], Any]) -> Any:
        for i, (pattern, style) in enumerate(compiled):
            if pattern.fullmatch(path):
                used[i] = True
                return _apply(path, module, style, descend)
        if type(module) is eqx.nn.Dropout:  # no entry: refused on a split input
            return _guard(path, module, axis_name)
        return descend(module)

    def _apply(path: str, module: Any, style: Style, descend: Callable[[Any], Any]) -> Any:
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            return _linear(path, module, style, axis_name, n)
        if isinstance(style, EmbeddingParallel):
            return _embedding(path, module, style, axis_name, n)
        if isinstance(style, SequenceParallel) and _holds_layers(module):
            raise _refuse(path, module, style, "a norm (a module without linear or embedding layers)")
        if isinstance(style, DropoutParallel):
            return _dropout(path, module, style, axis_name)
        if isinstance(style, HeadParallel):
            converted = descend(module)
            if isinstance(module, eqx.nn.MultiheadAttention):  # its own dropout draws per head
                converted = eqx.tree_at(lambda m: m.dropout, converted, module.dropout)
            return _heads(path, converted, style, axis_name, n)
        return module  # Replicate, SequenceParallel: whole on every device

    return map_modules(model, visit), used


def _report_unused(model: PyTree, compiled: list[tuple[re.Pattern[str], Style]], used: list[bool], strict: bool) -> None:
    unused = [pattern.pattern for (pattern, _), hit in zip(compiled, used) if not hit]
    if not unused:
        return
    paths: list[str] = []
    map_modules(model, lambda path, m, descend: (paths.append(path), descend(m))[1])
    message = (
        f"parallelize: the plan's pattern(s) {unused} match no module path of "
        f"{type(model).__name__} (patterns match a whole path; paths look like {paths[1:5]}); "
        f"the modules they were meant for stay replicated."
    )
    if strict:
        raise SpecError(message)
    warn(message)


def _is_traced(tree: PyTree) -> bool:
    return any(is_tracer(x) for x in jax.tree.leaves(tree))


def _stand_in(model: PyTree) -> PyTree:
    """`model` with every array replaced by a concrete NumPy one of its shape and dtype."""
    rng = np.random.default_rng(0)

    def fill(leaf: Any) -> Any:
        if not eqx.is_array(leaf):
            return leaf
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return (0.5 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        return np.zeros(leaf.shape, leaf.dtype)

    return jax.tree.map(fill, model)


def _run_compiled(fn: Callable[[PyTree], Any], tree: PyTree) -> Any:
    """`fn(tree)`, compiled and run on concrete arrays, also while an outer function is
    being traced (under `init_train_state`, of a model built beforehand): the program
    is called, not traced into the outer one, and its arguments placed on its devices
    eagerly. It runs once, so on the CPU it is compiled without the backend's
    optimisation passes (LLVM's take seconds per random-number kernel of a dropout)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    jitted = jax.jit(lambda a: fn(eqx.combine(a, static)), compiler_options=options)
    compiled = jitted.lower(arrays).compile()
    with jax.ensure_compile_time_eval():
        return compiled(arrays)


def _rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _probe(original: PyTree, parallel: PyTree, probe: Callable[[PyTree], Any], mesh: Mesh, axis_name: str, rtol: float) -> None:
    """Run `probe` on the original on one device and on `parallel` inside `shard_map`."""
    hint = (
        "Usual causes: a size computed from a layer's global fields next to a divided head "
        "count (store the head size as a field), a head-count field the plan does not "
        "name (HeadParallel(...)), an attention module's own dropout on its head-split "
        "weights (HeadParallel(..., dropout_dim=...)), a linear layer the plan leaves "
        "whole between split ones."
    )
    hint = _whole_convolutions(parallel) + hint
    want = _run_compiled(probe, original)
    try:
        got = _run_compiled(filter_shard_map(probe, mesh=mesh, out_specs=P()), parallel)
    except EquishardError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the user's code under the plan
        raise LayerConfigError(
            f"parallelize: the probe forward of the parallelised model fails inside "
            f"shard_map over {axis_name!r} ({first_line(err)}); the "
            f"model computes shapes, or returns values split over {axis_name!r}, in a way "
            f"the plan does not fix. {hint}"
        ) from None
    want_leaves, got_leaves = jax.tree.leaves(want), jax.tree.leaves(got)
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        if np.shape(a) != np.shape(b):
            raise LayerConfigError(
                f"parallelize: output {i} of the probe has shape {np.shape(a)} under the "
                f"plan but {np.shape(b)} on one device. {hint}"
            )
        err = _rel_err(a, b)
        if not err <= rtol:
            raise LayerConfigError(
                f"parallelize: output {i} of the probe differs from the one-device model "
                f"by {err:.2e} (relative; allowed {rtol:.0e}): the parallelised model computes "
                f"something else. {hint}"
            )


_PROBED: set[Any] = set()


def parallelize(
    model: PyTree,
    plan: Plan,
    mesh: Mesh,
    *,
    axis_name: str = "tp",
    probe: Callable[[PyTree], Any] | None = None,
    rtol: float = 1e-5,
    strict: bool = False,
) -> PyTree:
    """Tensor parallelism for an unmodified Equinox model, by a plan of path patterns.

    ```python
    plan = {
        r"embed": "vocab",
        r"blocks\\[\\d+\\]\\.attn": HeadParallel("n_heads", "n_kv_heads", dropout_dim=0),
        r"blocks\\[\\d+\\]\\.attn\\.w[qkv]|blocks\\[\\d+\\]\\.w[13]": "column",
        r"blocks\\[\\d+\\]\\.attn\\.wo|blocks\\[\\d+\\]\\.w2": "row",
        r"head": ColwiseParallel(gather_output=True),
    }
    model = es.parallelize(model, plan, mesh, probe=lambda m: m(tokens, key=key))
    ```

    Each module whose path matches a pattern (`re.fullmatch`, the first matching entry
    wins) is converted by its style: `eqx.nn.Linear` to a column- or row-parallel
    layer, `eqx.nn.Embedding` to a parallel embedding, each holding the original
    arrays at the original paths (checkpoints and path rules see the same names);
    attention modules get their head counts divided inside `shard_map`; an
    `eqx.nn.Dropout` on a split activation draws its block of the one-device mask
    (`DropoutParallel` at its path). Every other `eqx.nn.Dropout` raises a
    `LayerConfigError` naming its path when it is traced on an input split over
    `axis_name` (with or without a probe), rather than drawing other masks. Outside
    `shard_map` the result computes what the model computed. `equishard.unbox`
    (after `equishard.gather`) gives the original classes back. See the "Your own
    model" guide.

    **Arguments:**

    - `model`: any pytree of Equinox modules, written without equishard.
    - `plan`: `{pattern: style}`; a style is a `ColwiseParallel`, `RowwiseParallel`,
      `EmbeddingParallel`, `SequenceParallel`, `Replicate`, `HeadParallel` or
      `DropoutParallel`, or one of the names `"column"`, `"row"`, `"vocab"`, `"embedding"`,
      `"sequence_parallel"`, `"replicate"`, `"heads"`. Paths are written as
      `blocks[3].attn.wq`; the root's is `""`.
    - `mesh`: the mesh (the size of `axis_name` decides divisibility; the probe runs
      on it).
    - `axis_name`: the tensor-parallel axis.
    - `probe`: `probe(model) -> outputs`, e.g. `lambda m: m(tokens, key=key)`: run on
      the original on one device and on the parallelised model inside `shard_map`
      (outputs replicated); they must agree within `rtol`. When `model` is being traced
      (under `sharded_init`), the probe runs once on stand-in weights of the same
      shapes.
    - `rtol`: the probe's tolerance, per output ‖a − b‖ / ‖b‖.
    - `strict`: raise, instead of warning, when a pattern matches no module.

    **Returns:**

    The parallelised model.

    **Raises:**

    `LayerConfigError` when a style does not fit the module at its path, a size does
    not divide by the axis, or the probe fails or differs (the model computes shapes
    from local arrays in a way the plan cannot fix); `SpecError` when the axis is not
    on the mesh, a pattern is invalid, or (with `strict=True`) matches nothing.
    """
    if axis_name not in mesh.axis_names:
        raise SpecError(f"parallelize: axis {axis_name!r} is not on the mesh {dict(mesh.shape)}.")
    n = int(mesh.shape[axis_name])
    compiled = _compile_plan(plan)
    parallel, used = _convert(model, compiled, axis_name, n)
    _report_unused(model, compiled, used, strict)
    if probe is None:
        return parallel
    if not _is_traced(model):
        _probe(model, parallel, probe, mesh, axis_name, rtol)
        return parallel
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype) if eqx.is_array(x) else None, model)
    plan_key = tuple((pattern.pattern, style) for pattern, style in compiled)
    cache_key = (probe, mesh, axis_name, plan_key, rtol, str(jax.tree.structure(model)), str(shapes))
    if cache_key not in _PROBED:
        stand_in = _stand_in(model)
        _probe(stand_in, _convert(stand_in, compiled, axis_name, n)[0], probe, mesh, axis_name, rtol)
        _PROBED.add(cache_key)
    return parallel
