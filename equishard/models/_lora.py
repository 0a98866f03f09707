"""LoRA on the reference GPT: adapters added to a model that has its weights, folded back
into them, marked for the train step, and written and read in PEFT's layout.

The adapters are `equishard.nn.LoRAAdapter`s in the `lora` field of each block's
attention and MLP (one per target, see `equishard.nn.LoRA`), split as the projections
they adapt under every layout the GPT supports; under FSDP they are split over the
data axis by the rule every unit array follows (`fsdp_min_weight_size`). A PEFT adapter
folder (`adapter_config.json` + `adapter_model.safetensors`) maps one to one onto them:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` is layer `i`'s
q adapter's `A` `[r, in]`, `...lora_B.weight` its `B` `[out, r]` (the GPT's heads are
laid out as Hugging Face's, so no rows are permuted).
"""

from __future__ import annotations

import copy
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from .._errors import LayerConfigError
from ..nn import LoRA, LoRAAdapter, ParallelAttention, ParallelMLP, PipelineModule
from ..nn._internal import lora_of
from ..sharding import is_sharded, sharded_init
from ._gpt import GPT

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip
"""Each target's module in a Llama decoder layer (PEFT's `target_modules` are the last names)."""


def _is_node(x: Any) -> bool:
    return isinstance(x, (ParallelAttention, ParallelMLP))


def _nodes(model: Any) -> list[Any]:
    """The attentions and MLPs of `model`, in order."""
    return [x for x in jax.tree.leaves(model, is_leaf=_is_node) if _is_node(x)]


def _lora_fields(model: Any) -> list[Any]:
    return [n.lora for n in _nodes(model)]


def _check_gpt(model: Any, fn: str) -> None:
    if not isinstance(model, GPT):
        raise LayerConfigError(f"{fn}: expected the reference GPT, got {type(model).__name__}.")


def _mesh_of(model: Any) -> Any:
    """The mesh `model`'s arrays are placed on (`None`: not on a mesh)."""
    for x in jax.tree.leaves(model):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _remarked(model: GPT, adding: bool) -> GPT:
    """`model` with its pipeline's marker of plain arrays (`PipelineModule.was_plain`, one
    entry per array of a layer) made for its adapters' arrays: `adding`, entries for the
    adapters `model` holds inserted; else theirs removed (for the model without them)."""
    pipe = model.units
    if not isinstance(pipe, PipelineModule):
        return model
    leaves = jax.tree_util.tree_flatten_with_path(pipe.layers, is_leaf=is_sharded)[0]
    flags = [".lora[" in jax.tree_util.keystr(path) for path, _ in leaves]
    if adding:
        old = iter(pipe.was_plain)
        marker = tuple(False if f else next(old) for f in flags)
    else:
        marker = tuple(m for m, f in zip(pipe.was_plain, flags) if not f)
    new = copy.copy(pipe)
    object.__setattr__(new, "was_plain", marker)  # a static field: not reachable by tree_at
    return eqx.tree_at(lambda m: m.units, model, new)


def add_lora(model: GPT, lora: LoRA, *, key: PRNGKeyArray) -> GPT:
    """`model` with LoRA adapters on `lora.targets` of every block.

    Each adapter's `A` is drawn from `key` as a global array (the same on every layout),
    its `B` is zero: the adapted model computes exactly what `model` does until `B`
    is trained. The base arrays are `model`'s own (not copied).

    **Arguments:**

    - `model`: a `GPT` (global arrays, on a mesh or one device), without adapters.
    - `lora`: the rank, alpha and targets.
    - `key`: draws the adapters.

    **Returns:**

    The adapted `GPT`, its adapters placed on `model`'s mesh by their specs.

    **Raises:**

    `LayerConfigError` naming a target the model lacks (gate, up or down on a
    mixture-of-experts model), a rank above a layer's width, dropout, or a model that
    has adapters already.
    """
    _check_gpt(model, "add_lora")
    present = lora_of(model)
    if present is not None:
        raise LayerConfigError(
            f"add_lora: the model has adapters already ({present}); merge them first "
            f"(merge_lora) or add none."
        )
    config, par = model.config, model.parallelism
    lacking = [t for t in lora.targets if config.moe_every and t in ("gate", "up", "down")]
    if lacking:
        raise LayerConfigError(
            f"add_lora: the model has no {', '.join(map(repr, lacking))} projection in its "
            f"mixture-of-experts blocks (moe_every={config.moe_every}); adapt q, k, v or o."
        )

    def make(k: PRNGKeyArray) -> list[Any]:
        # Only the adapters are returned: the base arrays' initialisation is dead code.
        return _lora_fields(GPT(config, par, key=k, lora=lora))

    mesh = _mesh_of(model)
    fresh = sharded_init(make, key, mesh=mesh) if mesh is not None else eqx.filter_jit(make)(key)
    return _remarked(eqx.tree_at(_lora_fields, model, fresh, is_leaf=lambda x: x is None), adding=True)


def lora_trainable(model: GPT) -> PyTree[bool]:
    """The filter that marks exactly the adapters' arrays of `model`.

    **Returns:**

    A pytree of the structure of `model` (an `eqx.partition` filter spec): `True` at
    every leaf of a `LoRAAdapter`, `False` at every other leaf.
    """
    return jax.tree.map(
        lambda x: jax.tree.map(lambda _: True, x) if isinstance(x, LoRAAdapter) else False,
        model,
        is_leaf=lambda x: isinstance(x, LoRAAdapter),
    )


def _delta(adapter: LoRAAdapter, like: Any) -> Any:
    """`scale * B @ A` of a (global, possibly stacked) adapter: `[..., out, in]` in `like`'s dtype."""
    a, b = jnp.asarray(adapter.a.value), jnp.asarray(adapter.b.value)
    # f32[..., out, r] @ f32[..., r, in] -> f32[..., out, in]
    product = jnp.einsum("...or,...ri->...oi", b, a, precision=jax.lax.Precision.HIGHEST)
    return (adapter.scale * product).astype(like.dtype)


def _fold(w: Any, adapters: dict[str, LoRAAdapter], targets: tuple[str, ...]) -> Any:
    """`w` with the adapters of `targets` folded in: a stacked `[..., s, out/s, in]` weight
    takes target `i` into piece `i`; a plain one (one target) as it is."""
    present = [(i, t) for i, t in enumerate(targets) if t in adapters]
    if len(targets) == 1:
        return w + _delta(adapters[targets[0]], w) if present else w
    for i, t in present:
        w = w.at[..., i, :, :].add(_delta(adapters[t], w))
    return w


def _merged_node(node: Any) -> Any:
    """An attention or MLP (global arrays) with its adapters folded in and removed."""
    ad = node.lora
    if isinstance(node, ParallelAttention):
        fields = [(lambda n: n.proj.weight.value, ("o",))]
        if node.qkv is not None:
            fields.append((lambda n: n.qkv.weight.value, ("q", "k", "v")))
        else:
            fields += [(lambda n: n.q.weight.value, ("q",)), (lambda n: n.kv.weight.value, ("k", "v"))]
    else:
        fields = [(lambda n: n.down.weight.value, ("down",))]
        fields.append((lambda n: n.up.weight.value, ("gate", "up") if node.swiglu else ("up",)))
    for where, targets in fields:
        if any(t in ad for t in targets):
            node = eqx.tree_at(where, node, _fold(jnp.asarray(where(node)), ad, targets))
    return eqx.tree_at(lambda n: n.lora, node, None)


def merge_lora(model: GPT) -> GPT:
    """`model` with each adapter's `scale * B @ A` added to the weight it adapts, and the
    adapters removed: a plain `GPT` that computes what the adapted one does (within
    float32 rounding), e.g. for `export_hf`.

    **Arguments:**

    - `model`: an adapted `GPT` (global arrays, any layout).

    **Returns:**

    The merged `GPT`, each weight placed as it was.

    **Raises:**

    `LayerConfigError` for a model without adapters.
    """
    _check_gpt(model, "merge_lora")
    if lora_of(model) is None:
        raise LayerConfigError("merge_lora: the model has no LoRA adapters.")
    model = _remarked(model, adding=False)
    nodes = [n for n in _nodes(model) if n.lora is not None]
    merged = eqx.filter_jit(lambda ns: [_merged_node(n) for n in ns])(nodes)
    # Each merged weight where its base weight was (the jit may place it otherwise).
    merged = jax.tree.map(
        lambda new, old: jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new,
        merged, [eqx.tree_at(lambda n: n.lora, n, None) for n in nodes],
    )  # fmt: skip

    def where(m: Any) -> list[Any]:
        return [n for n in _nodes(m) if n.lora is not None]

    return eqx.tree_at(where, model, merged)
