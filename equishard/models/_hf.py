"""Hugging Face checkpoints of the Llama family onto the reference GPT, and back.

`LlamaForCausalLM` (Llama 2; Llama 3 / 3.1 with `llama3` rotary scaling; Llama 3.2 with
tied embeddings), `MistralForCausalLM` (no sliding window shorter than the sequence) and
`Qwen2ForCausalLM` (biases on the query, key and value projections): `config.json`
becomes a `GPTConfig` (`gpt_config_from_hf`), anything the GPT cannot represent refused
by name before a tensor is read; the weights fill a GPT built under any layout, each
device reading its own blocks (`load_hf`); a GPT is written back as a Hugging Face folder
one tensor at a time (`export_hf`).

The GPT's rotary embedding rotates the pairs `(i, i + head_dim/2)`, as `transformers`'
`rotate_half` does, so the query and key projections load as they are (no permutation
of the heads' features). Linear weights are `[out, in]` on both sides (no transposes).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from .._errors import CheckpointError
from ..core import pipeline_layer_order
from ..sharding import Parallelism
from ..train import (
    OutTensor,
    Padded,
    Stacked,
    Tensor,
    array_paths,
    checkpoint_tensors,
    load_safetensors,
    source_tensors,
    tensor_of,
    write_safetensors,
)
from ._gpt import GPT, GPTConfig, canonical_path

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The Hugging Face architectures `load_hf` reads onto the GPT."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json",
)  # fmt: skip
"""The files beside the weights that travel with the model (the tokenizer, its special
tokens and chat template)."""
_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def read_hf_config(folder: str) -> dict[str, Any]:
    """`folder/config.json` as a dict.

    **Raises:**

    `CheckpointError` naming the file if it is missing or not JSON.
    """
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the model's configuration ({err}).") from None


def _rope(hf: Mapping[str, Any]) -> tuple[float, tuple[float, float, float, float] | None]:
    """The rotary base and llama3 scaling of a config (`rope_parameters` of transformers
    5, or `rope_theta` and `rope_scaling` of older ones)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params.update(scaling)
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if scaling:  # the older `rope_scaling` names its own type
        kind = scaling.get("rope_type", scaling.get("type", kind))
    if kind == "default":
        return base, None
    if kind != "llama3":
        raise CheckpointError(
            f"config.json: rope scaling of type {kind!r} is not implemented by the GPT "
            f"(only 'default' and 'llama3')."
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return base, (
        float(params[keys[0]]), float(params[keys[1]]), float(params[keys[2]]), float(params[keys[3]])
    )  # fmt: skip


def _refuse(hf: Mapping[str, Any], seq_len: int | None) -> str:
    """The architecture of `hf`, after refusing by name what the GPT cannot represent."""
    archs = hf.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json: architecture {archs!r} is not supported; the GPT loads "
            f"{', '.join(ARCHITECTURES)}."
        )
    checks = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r} (the GPT's MLP is SwiGLU)"),
        (bool(hf.get("mlp_bias")), "mlp_bias=true"),
        (arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias")), "attention_bias=true (a bias on the output projection)"),
        (int(hf.get("pretraining_tp", 1)) != 1, f"pretraining_tp={hf.get('pretraining_tp')}"),
        (bool(hf.get("use_sliding_window")), "use_sliding_window=true"),
    ]  # fmt: skip
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM" and window is not None:
        checks.append((
            seq_len is None or window < seq_len,
            f"sliding_window={window} (the GPT attends over the whole sequence: give a "
            f"sequence length no longer than the window)",
        ))  # fmt: skip
    head_dim = hf.get("head_dim")
    heads = int(hf["num_attention_heads"])
    if head_dim is not None and int(head_dim) * heads != int(hf["hidden_size"]):
        checks.append((True, f"head_dim={head_dim} with hidden_size/num_attention_heads={int(hf['hidden_size']) // heads}"))
    for bad, what in checks:
        if bad:
            raise CheckpointError(f"config.json of {arch}: the GPT cannot represent {what}.")
    return arch


def gpt_config_from_hf(hf: Mapping[str, Any], *, vocab_multiple: int = 1, seq_len: int | None = None) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face `config.json` of the Llama family.

    **Arguments:**

    - `hf`: the parsed `config.json`.
    - `vocab_multiple`: pad the vocabulary to a multiple of this (the tensor axis): the
      padding ids' logits are masked (`GPTConfig.real_vocab_size`).
    - `seq_len`: the longest sequence the run uses (checked against a Mistral sliding window).

    **Returns:**

    The `GPTConfig`.

    **Raises:**

    `CheckpointError` naming the architecture or option the GPT cannot represent: an
    architecture outside `ARCHITECTURES`, another activation, MLP or output biases, a
    sliding window shorter than `seq_len`, a `head_dim` other than
    `hidden_size / num_attention_heads`, rope scaling other than `llama3`.
    """
    arch = _refuse(hf, seq_len)
    base, scaling = _rope(hf)
    vocab = int(hf["vocab_size"])
    padded = -(-vocab // vocab_multiple) * vocab_multiple
    return GPTConfig(
        vocab_size=padded, d_model=int(hf["hidden_size"]), n_heads=int(hf["num_attention_heads"]),
        n_layers=int(hf["num_hidden_layers"]), d_ff=int(hf["intermediate_size"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        tied=bool(hf.get("tie_word_embeddings", False)), rotary_base=base, rotary_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=arch == "Qwen2ForCausalLM",
        real_vocab_size=vocab if padded != vocab else None,
    )  # fmt: skip


def _layer_tensors(i: int) -> dict[str, str]:
    """The names of layer `i`'s tensors, by role."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    return {
        "norm1": p + "input_layernorm.weight", "norm2": p + "post_attention_layernorm.weight",
        "q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight",
        "o": a + "o_proj.weight", "q_b": a + "q_proj.bias", "k_b": a + "k_proj.bias",
        "v_b": a + "v_proj.bias", "gate": m + "gate_proj.weight", "up": m + "up_proj.weight",
        "down": m + "down_proj.weight",
    }  # fmt: skip


def _per_layer() -> dict[str, Any]:
    """`{canonical path after ".units.blocks[0]": function of a layer's names -> source}`."""
    t = Tensor
    roles: dict[str, Any] = {
        ".norm1.weight": lambda n: t(n["norm1"]),
        ".norm2.weight": lambda n: t(n["norm2"]),
        ".attn.proj.weight": lambda n: t(n["o"]),
        ".mlp.up.weight": lambda n: Stacked((t(n["gate"]), t(n["up"]))),
        ".mlp.down.weight": lambda n: t(n["down"]),
        ".attn.qkv.weight": lambda n: Stacked((t(n["q"]), t(n["k"]), t(n["v"]))),
        ".attn.qkv.bias": lambda n: Stacked((t(n["q_b"]), t(n["k_b"]), t(n["v_b"]))),
        ".attn.q.weight": lambda n: t(n["q"]),
        ".attn.q.bias": lambda n: t(n["q_b"]),
        ".attn.kv.weight": lambda n: Stacked((t(n["k"]), t(n["v"]))),
        ".attn.kv.bias": lambda n: Stacked((t(n["k_b"]), t(n["v_b"]))),
    }
    return roles


def hf_mapping(model: Any, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The map of `equishard.train.load_safetensors` from the arrays of `model` (a `GPT`
    of `gpt_config_from_hf(hf)`, abstract or not, under any layout) to the tensors of a
    Hugging Face checkpoint of the Llama family.

    **Raises:**

    `CheckpointError` naming an array of the model with no tensor (a model not built
    from `hf`, or MoE layers).
    """
    config: GPTConfig = model.config
    vocab = config.vocab_size
    real = int(hf["vocab_size"])

    def vocab_rows(name: str) -> Any:
        return Tensor(name) if real == vocab else Padded(Tensor(name), 0, vocab)

    par: Parallelism = model.parallelism
    # The stored position of each layer: a circular pipeline deals them over its stages.
    order = pipeline_layer_order(config.n_layers, par.num_stages, par.pipeline_repeats) if par.pipeline else range(config.n_layers)
    names = [_layer_tensors(i) for i in order]
    roles = _per_layer()
    out: dict[str, Any] = {}
    for path in array_paths(model):
        canon = canonical_path(path)
        if canon == ".embed.weight":
            out[path] = vocab_rows("model.embed_tokens.weight")
        elif canon == ".head.weight":
            out[path] = vocab_rows("lm_head.weight")
        elif canon == ".norm.weight":
            out[path] = Tensor("model.norm.weight")
        elif canon.startswith(".units.blocks[0].") and canon[len(".units.blocks[0]") :] in roles:
            role = roles[canon[len(".units.blocks[0]") :]]
            out[path] = Stacked(tuple(role(n) for n in names))
        else:
            raise CheckpointError(f"GPT array {path} has no tensor in a {hf.get('architectures')} checkpoint.")
    return out


def load_hf(
    folder: str, parallelism: Parallelism, mesh: Mesh, *, dtype: Any = np.float32,
    seq_len: int | None = None,
) -> GPT:  # fmt: skip
    """A `GPT` under `parallelism` on `mesh`, its weights read from the Hugging Face
    checkpoint in `folder` (each device's blocks by slice).

    **Arguments:**

    - `folder`: `config.json` and `model.safetensors` (or several files with
      `model.safetensors.index.json`).
    - `parallelism`: the layout resolved (`Layout.resolve()`); the vocabulary is padded to
      a multiple of its tensor axis.
    - `mesh`: the layout's mesh.
    - `dtype`: the parameters' dtype (bf16 tensors are cast to it).
    - `seq_len`: the longest sequence the run uses (see `gpt_config_from_hf`).

    **Returns:**

    The `GPT`, its arrays on `mesh`.

    **Raises:**

    `CheckpointError` (named architecture, option, file or tensor) before any tensor
    data is read.
    """
    hf = read_hf_config(folder)
    config = gpt_config_from_hf(hf, vocab_multiple=parallelism.size(parallelism.tensor), seq_len=seq_len)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        skeleton = eqx.filter_eval_shape(lambda: GPT(config, parallelism, key=jax.random.key(0)))
    skeleton = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype) if np.issubdtype(s.dtype, np.floating) else s, skeleton
    )
    ignore = [n for n in checkpoint_tensors(folder) if n.endswith("rotary_emb.inv_freq")]
    if config.tied:
        ignore.append("lm_head.weight")  # some tied checkpoints store the table twice
    return load_safetensors(skeleton, hf_mapping(skeleton, hf), folder, mesh=mesh, ignore=ignore)


def llama_config(config: GPTConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of `LlamaForCausalLM` for a GPT trained here.

    **Raises:**

    `CheckpointError` for an MoE model (`moe_every > 0`), which Llama cannot represent.
    """
    if config.moe_every:
        raise CheckpointError(
            f"export: a GPT with mixture-of-experts layers (moe_every={config.moe_every}) has no "
            f"LlamaForCausalLM equivalent."
        )
    rope: dict[str, Any] = {"rope_theta": config.rotary_base, "rope_type": "default"}
    if config.rotary_scaling is not None:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope = {**rope, "rope_type": "llama3", **dict(zip(keys, config.rotary_scaling))}
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "num_attention_heads": config.n_heads, "num_hidden_layers": config.n_layers,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": config.d_model // config.n_heads, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rotary_base, "rope_parameters": rope,
        "rope_scaling": None if config.rotary_scaling is None else rope,
        "tie_word_embeddings": config.tied, "attention_bias": False, "mlp_bias": False,
        "vocab_size": config.real_vocab_size or config.vocab_size, "dtype": dtype,
    }  # fmt: skip


def _claim(to: str) -> None:
    """Refuse a target that exists and is not an empty folder."""
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        raise CheckpointError(f"export: the target {to} exists and is not empty; choose a new folder.")


def export_hf(
    model: GPT, to: str, *, hf_config: Mapping[str, Any] | None = None, dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30, tokenizer_from: str | None = None,
) -> str:  # fmt: skip
    """Write `model` (global arrays, any layout) as a Hugging Face folder at `to`.

    The tensors are cut from the model one at a time and written into a temporary
    folder beside `to`, renamed to `to` once complete: the host holds one tensor (plus
    the write buffer), and an interrupted export leaves no folder at `to`. In a
    multi-process run every process calls it (each tensor is gathered from all of them)
    and process 0 writes.

    **Arguments:**

    - `model`: a `GPT` (e.g. from `load_hf` or a run's checkpoint).
    - `to`: the target folder (must not exist, or be empty).
    - `hf_config`: the `config.json` to write (that of the checkpoint the model was
      loaded from); default `llama_config(model.config)` (`LlamaForCausalLM`).
    - `dtype`: the tensors' dtype (NumPy's or `"bfloat16"`); default the config's `dtype`
      (or `torch_dtype`), else float32.
    - `max_shard_bytes`: the size limit of one safetensors file.
    - `tokenizer_from`: a folder whose tokenizer files (`TOKENIZER_FILES`) are copied.

    **Returns:**

    `to`.

    **Raises:**

    `CheckpointError` for a target that is not empty or an MoE model.
    """
    _claim(to)
    hf = dict(hf_config) if hf_config is not None else llama_config(model.config)
    name = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    np_dtype = np.dtype(_DTYPES.get(str(name), name))
    hf["dtype"] = str(np.dtype(np_dtype).name)
    mapping = hf_mapping(model, hf)
    arrays = {p: v for p, (v, _) in array_paths(model).items()}
    shapes = _tensor_shapes(model.config, hf)
    tensors = []
    for path, source in mapping.items():
        for tensor in _names_in(source):
            make = lambda s=source, t=tensor, p=path: _to_host(tensor_of(s, t, arrays[p], shapes))  # noqa: E731
            tensors.append(OutTensor(tensor, shapes[tensor], np_dtype, make))
    generation = {"do_sample": False, **{k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}}

    def beside(tmp: str) -> None:
        _write_json(os.path.join(tmp, "config.json"), hf)
        _write_json(os.path.join(tmp, "generation_config.json"), generation)
        if tokenizer_from is not None:
            copy_tokenizer(tokenizer_from, tmp)

    return write_folder(to, tensors, beside, max_shard_bytes=max_shard_bytes)


def write_folder(
    to: str, tensors: list[OutTensor], beside: Callable[[str], None], *,
    max_shard_bytes: int, single: str | None = None,
) -> str:  # fmt: skip
    """Write `tensors` (sorted by name) as safetensors into a new folder `to`, and what
    `beside(folder)` writes next to them (`single`: the name of a one-file checkpoint,
    default `write_safetensors`'): into a temporary folder beside `to`, renamed
    to `to` once complete (an interrupted export leaves no folder that looks complete).
    Every process takes part in each tensor's gather; process 0 writes.

    **Raises:**

    `CheckpointError` for a `to` that exists and is not an empty folder.
    """
    tensors = sorted(tensors, key=lambda t: t.name)
    if jax.process_index() != 0:
        for t in tensors:
            t.make()
        _sync(f"equishard-export-written-{os.path.basename(to)}")
        return to
    parent = os.path.dirname(os.path.abspath(to))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        if single is None:
            write_safetensors(tmp, tensors, max_shard_bytes=max_shard_bytes)
        else:
            write_safetensors(tmp, tensors, max_shard_bytes=max_shard_bytes, single=single)
        beside(tmp)
        _claim(to)
        if os.path.isdir(to):
            os.rmdir(to)
        os.rename(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync(f"equishard-export-written-{os.path.basename(to)}")
    return to


def _to_host(x: Any) -> np.ndarray:
    """`x` whole on this host: gathered from the other processes where some of its blocks
    are only theirs (a collective: every process calls it for the same arrays)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _sync(name: str) -> None:
    """Wait for every process (nothing with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _names_in(source: Any) -> list[str]:
    return list(dict.fromkeys(source_tensors(source)))


def _tensor_shapes(config: GPTConfig, hf: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of the checkpoint's tensors (the vocabulary unpadded)."""
    d, f, vocab = config.d_model, config.d_ff, int(hf["vocab_size"])
    kv = (config.n_kv_heads or config.n_heads) * (d // config.n_heads)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,),
    }  # fmt: skip
    for i in range(config.n_layers):
        n = _layer_tensors(i)
        shapes.update({
            n["norm1"]: (d,), n["norm2"]: (d,), n["q"]: (d, d), n["k"]: (kv, d), n["v"]: (kv, d),
            n["o"]: (d, d), n["q_b"]: (d,), n["k_b"]: (kv,), n["v_b"]: (kv,), n["gate"]: (f, d),
            n["up"]: (f, d), n["down"]: (d, f),
        })  # fmt: skip
    return shapes


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def copy_tokenizer(source: str, target: str) -> list[str]:
    """Copy the tokenizer files (`TOKENIZER_FILES`) of `source` into `target`; none is
    overwritten.

    **Returns:**

    The names copied.

    **Raises:**

    `CheckpointError` naming a file `target` already has.
    """
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(source, name)
        if os.path.isfile(src):
            dst = os.path.join(target, name)
            if os.path.exists(dst):
                raise CheckpointError(f"{dst} exists: the tokenizer files are not copied over it.")
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied

