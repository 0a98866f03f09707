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
import json
import os
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from .._errors import CheckpointError, LayerConfigError
from ..core import pipeline_layer_order
from ..nn import LoRA, LoRAAdapter, ParallelAttention, ParallelMLP, PipelineModule
from ..nn._internal import lora_of
from ..sharding import is_sharded, sharded_init
from ..train import (
    OutTensor,
    Stacked,
    Tensor,
    Trainable,
    array_paths,
    load_safetensors,
    source_tensors,
    tensor_of,
)
from ._gpt import GPT, canonical_path
from ._hf import _DTYPES, _claim, _to_host, write_folder

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

    - `model`: a `GPT` (global arrays, on a mesh or one device), without adapters. Its
      arrays may be abstract (`eqx.filter_eval_shape`): the adapters are real.
    - `lora`: the rank, alpha and targets.
    - `key`: draws the adapters.

    **Returns:**

    The adapted `GPT`, its adapters placed on `model`'s mesh by their specs.

    **Raises:**

    `LayerConfigError` naming a target the model lacks (gate, up or down on a
    mixture-of-experts model), a rank above a layer's width, or a model that has
    adapters already.
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


ADAPTER_PATHS = r"\.lora\['"
"""What the paths of a GPT's adapter arrays hold (`units.blocks[0].attn.lora['q'].a`)."""


def adapters_trainable(freeze: str | None = None) -> Trainable:
    """The train step's filter for a GPT with adapters, before the model exists: the
    adapters' arrays are trained (`lora_trainable` marks the same arrays of a model).

    **Arguments:**

    - `freeze`: a regular expression of paths frozen too (`None`: none).

    **Returns:**

    A `Trainable` (`make_train_step(..., trainable=)`), printable and comparable.
    """
    return Trainable.matching(train=ADAPTER_PATHS, freeze=freeze)


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
    fields: list[tuple[Any, tuple[str, ...]]]
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


# ------------------------------------------------------------------------------ PEFT

_TARGET_OF = {module.split(".")[-1]: t for t, module in _MODULES.items()}
_PATH = re.compile(r"\.units\.blocks\[0\]\.(?:attn|mlp)\.lora\['(\w+)'\]\.(a|b)")


def _peft_name(layer: int, target: str, factor: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_MODULES[target]}.lora_{factor.upper()}.weight"


def _adapters_only(model: GPT) -> Any:
    return eqx.filter(model, lora_trainable(model))


def peft_mapping(model: GPT) -> dict[str, Any]:
    """The map of `equishard.train.load_safetensors` from the adapter arrays of `model`
    (an adapted `GPT`, any layout) to the tensors of a PEFT adapter of its Llama
    equivalent: each stacked adapter array `Stacked` over the layers in the order the
    layout stores them.

    **Raises:**

    `CheckpointError` for a model with mixture-of-experts layers (no Llama equivalent).
    """
    config, par = model.config, model.parallelism
    if config.moe_every:
        raise CheckpointError(
            f"PEFT: a GPT with mixture-of-experts layers (moe_every={config.moe_every}) has no "
            f"LlamaForCausalLM equivalent to adapt."
        )
    order = (
        pipeline_layer_order(config.n_layers, par.num_stages, par.pipeline_repeats)
        if par.pipeline else range(config.n_layers)
    )  # fmt: skip
    out: dict[str, Any] = {}
    for path in array_paths(_adapters_only(model)):
        match = _PATH.fullmatch(canonical_path(canonical_path(path)))
        if match is None:  # not reached for a GPT: every adapter sits in a block
            raise CheckpointError(f"PEFT: adapter array {path} has no PEFT tensor.")
        target, factor = match.groups()
        out[path] = Stacked(tuple(Tensor(_peft_name(i, target, factor)) for i in order))
    return out


def _peft_config(lora: LoRA, base_model_name_or_path: str) -> dict[str, Any]:
    alpha: float | int = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(_MODULES[t].split(".")[-1] for t in lora.targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "lora_bias": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path, "revision": None,
    }  # fmt: skip


def export_peft(model: GPT, folder: str, *, base_model_name_or_path: str, dtype: Any = None) -> str:
    """Write the adapters of `model` as a PEFT LoRA adapter folder.

    `adapter_config.json` (`peft_type` `"LORA"`, `task_type` `"CAUSAL_LM"`, `r`,
    `lora_alpha`, `lora_dropout`, `target_modules`, `bias` `"none"`, ...) and
    `adapter_model.safetensors` (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
    `[r, in]`, `...lora_B.weight` `[out, r]`, ...), loadable by `peft.PeftModel.from_pretrained`
    onto the model's Llama equivalent (`export_hf` of its base). Written one tensor at a
    time into a temporary folder beside `folder`, renamed once complete; in a
    multi-process run every process calls it and process 0 writes.

    **Arguments:**

    - `model`: an adapted `GPT` (global arrays, any layout).
    - `folder`: the target (must not exist, or be empty).
    - `base_model_name_or_path`: the base model's name or folder, recorded in the config.
    - `dtype`: the tensors' dtype (NumPy's or `"bfloat16"`); default the adapters' own.

    **Returns:**

    `folder`.

    **Raises:**

    `CheckpointError` for a target that is not empty, a model without adapters or with
    mixture-of-experts layers.
    """
    _claim(folder)
    lora = lora_of(model)
    if lora is None:
        raise CheckpointError("export_peft: the model has no LoRA adapters (add_lora, load_peft).")
    mapping = peft_mapping(model)
    arrays = {p: v for p, (v, _) in array_paths(_adapters_only(model)).items()}
    tensors = []
    for path, source in mapping.items():
        value = arrays[path]
        out = np.dtype(_DTYPES.get(str(dtype), dtype) if dtype is not None else value.dtype)
        for tensor in source_tensors(source):
            make = lambda s=source, t=tensor, v=value: _to_host(tensor_of(s, t, v, {}))  # noqa: E731
            tensors.append(OutTensor(tensor, tuple(value.shape[-2:]), out, make))

    def beside(tmp: str) -> None:
        with open(os.path.join(tmp, PEFT_CONFIG), "w") as f:
            json.dump(_peft_config(lora, base_model_name_or_path), f, indent=2, sort_keys=True)
            f.write("\n")

    return write_folder(folder, tensors, beside, max_shard_bytes=2**62, single=PEFT_WEIGHTS)


def read_peft_config(folder: str) -> LoRA:
    """The `LoRA` of the PEFT adapter folder `folder` (its `adapter_config.json`).

    The file's `lora_dropout` (an option of training with PEFT) is not kept: the adapters
    are read without dropout (to train them with some, load them onto a model whose
    adapters `add_lora` made with it).

    **Raises:**

    `CheckpointError` naming the file and the option the GPT cannot take: another
    `peft_type`, `use_rslora`, `use_dora`, `modules_to_save`, a `bias` other than
    `"none"`, `fan_in_fan_out`, per-layer ranks or alphas, `layers_to_transform`, a
    target module other than Llama's q/k/v/o/gate/up/down projections.
    """
    path = os.path.join(folder, PEFT_CONFIG)
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the adapter's configuration ({err}).") from None
    checks = [
        (hf.get("peft_type") != "LORA", f"peft_type={hf.get('peft_type')!r} (only LoRA)"),
        (bool(hf.get("use_rslora")), "use_rslora=true (rank-stabilised scaling)"),
        (bool(hf.get("use_dora")), "use_dora=true"),
        (bool(hf.get("modules_to_save")), f"modules_to_save={hf.get('modules_to_save')!r}"),
        (hf.get("bias", "none") != "none", f"bias={hf.get('bias')!r} (only 'none')"),
        (bool(hf.get("lora_bias")), "lora_bias=true"),
        (bool(hf.get("fan_in_fan_out")), "fan_in_fan_out=true"),
        (bool(hf.get("rank_pattern")) or bool(hf.get("alpha_pattern")), "rank_pattern or alpha_pattern"),
        (hf.get("layers_to_transform") is not None, "layers_to_transform"),
    ]  # fmt: skip
    modules = hf.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in _TARGET_OF]
    checks.append((bool(unknown) or not modules, f"target_modules {unknown or modules!r} (the GPT adapts {', '.join(_TARGET_OF)})"))
    for bad, what in checks:
        if bad:
            raise CheckpointError(f"{path}: the GPT cannot take {what}.")
    return LoRA(int(hf["r"]), float(hf.get("lora_alpha", 8)), targets=tuple(_TARGET_OF[m] for m in modules))


def load_peft(model: GPT, folder: str) -> GPT:
    """`model` with the adapters of the PEFT LoRA adapter folder `folder`, each device
    reading its own blocks of them (`equishard.train.load_safetensors`).

    **Arguments:**

    - `model`: the base `GPT` (global arrays, any layout; e.g. from `load_hf` of the
      adapter's base model), or one adapted with the adapter's rank, alpha and targets
      (its adapters are replaced).
    - `folder`: `adapter_config.json` and `adapter_model.safetensors`.

    **Returns:**

    The adapted `GPT`, its adapters placed as `add_lora` places them.

    **Raises:**

    `CheckpointError` naming what the GPT cannot take (`read_peft_config`), a model
    whose adapters differ from the file's (rank, alpha, targets), a missing or extra
    tensor or one of the wrong shape (before any tensor data is read).
    """
    _check_gpt(model, "load_peft")
    lora = read_peft_config(folder)
    present = lora_of(model)
    if present is None:
        if model.config.moe_every:
            peft_mapping(model)  # raises: no Llama equivalent
        adapted = add_lora(model, lora, key=jax.random.key(0))
    elif (present.rank, present.alpha, present.targets) != (lora.rank, lora.alpha, lora.targets):
        raise CheckpointError(
            f"load_peft: {folder} holds adapters of rank {lora.rank}, alpha {lora.alpha} on "
            f"{list(lora.targets)}; the model's have rank {present.rank}, alpha "
            f"{present.alpha} on {list(present.targets)}."
        )
    else:
        adapted = model
    skeleton = _adapters_only(adapted)
    mesh = _mesh_of(adapted)
    if mesh is None:  # one device: its specs name no axis
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("_",))
    loaded = load_safetensors(skeleton, peft_mapping(adapted), folder, mesh=mesh, single=PEFT_WEIGHTS)
    return eqx.combine(loaded, eqx.filter(adapted, lora_trainable(adapted), inverse=True))
