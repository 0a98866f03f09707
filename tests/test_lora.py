"""LoRA adapters on the reference GPT: exact at initialisation, equal to one device under
every layout (logits and the adapters' gradients), merged into the base weights, and
written and read in PEFT's layout."""

import functools
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import from_last_stage
from equishard.models import (
    GPT,
    GPTConfig,
    LoRA,
    add_lora,
    export_hf,
    export_peft,
    generate,
    load_hf,
    load_peft,
    lora_trainable,
    merge_lora,
)
from equishard.models._internal import to_single_device
from equishard.train import checkpoint_tensors

from .helpers import assert_tree_allclose

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MHA = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=48)
GQA = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48)
ALL = LoRA(4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
# "+sp": Megatron sequence parallelism over tp. tp=4 on GQA: the key/value heads (2) are
# replicated over the axis.
LAYOUTS = [
    ("dp=8", MHA), ("fsdp=8", MHA), ("pp=2,dp=2,tp=2", MHA),
    ("tp=2", GQA), ("tp=4", GQA), ("fsdp=4,tp=2+sp", GQA), ("fsdp=4,tp=2+sp", MHA),
]  # fmt: skip
WINDOWS = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)


def _nonzero_b(model):
    """`model` with every adapter's `B` set to a non-zero value that depends only on the
    global arrays (the same on every layout)."""

    def fill(x):
        if not isinstance(x, es.nn.LoRAAdapter):
            return x
        a, b = jnp.asarray(x.a.value), x.b.value
        out, r = jnp.shape(b)[-2:]
        # one value per unit, from its A (layout-independent), times a fixed pattern
        seed = jnp.mean(a, axis=(-2, -1), keepdims=True) * 3.0 + 1.0
        shape, dtype = jnp.shape(b), jnp.result_type(b)
        pattern = jnp.broadcast_to(jnp.arange(out * r, dtype=dtype).reshape(out, r), shape)
        new = 0.05 * jnp.sin(pattern + jnp.broadcast_to(seed, shape))
        if isinstance(b, jax.Array) and isinstance(b.sharding, jax.sharding.NamedSharding):
            new = jax.device_put(new, b.sharding)
        return eqx.tree_at(lambda y: y.b.value, x, new)

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, es.nn.LoRAAdapter))


def _is_node(x):
    return isinstance(x, (es.nn.ParallelAttention, es.nn.ParallelMLP))


def _adapters(model):
    """The `lora` fields of the attentions and MLPs of `model` (its adapters), in order."""
    return [n.lora for n in jax.tree.leaves(model, is_leaf=_is_node) if _is_node(n)]


@functools.cache
def _layout(layout: str):
    spec, sp = layout.split("+")[0], layout.endswith("+sp")
    resolved = es.Layout(spec, sequence_parallel=sp).resolve()
    return resolved.mesh(), resolved, resolved.batch_spec


@functools.cache
def _reference(config: GPTConfig):
    """The adapted model on one device, its loss, logits and the adapters' gradients."""
    model = _nonzero_b(add_lora(GPT(config, key=jax.random.key(0)), ALL, key=jax.random.key(1)))
    trainable, frozen = eqx.partition(model, lora_trainable(model))

    @eqx.filter_jit
    def run(trainable, windows):
        loss_fn = lambda tr: eqx.combine(tr, frozen).loss(windows)[0]  # noqa: E731
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        return loss, grads, eqx.combine(trainable, frozen)(windows[:, :-1])

    return model, run(trainable, jnp.asarray(WINDOWS))


@functools.cache
def _sharded_step(layout: str, config: GPTConfig):
    mesh, par, batch = _layout(layout)
    vocab = "tp" if "tp" in mesh.axis_names else None

    def body(trainable, frozen, windows):
        windows = windows.value
        loss_fn = lambda tr: eqx.combine(tr, frozen).loss(windows)[0]  # noqa: E731
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        logits = eqx.combine(trainable, frozen)(windows[:, :-1])  # f32[B/data, T, V/tp]
        logits = from_last_stage(logits, par.pipeline) if par.pipeline else logits
        return loss, _adapters(grads), logits

    out = (P(), None, P(batch[0] if len(batch) else None, None, vocab))
    call = es.filter_shard_map(body, mesh=mesh, out_specs=out)
    return eqx.filter_jit(lambda tr, fr, w: call(tr, fr, es.Sharded(w, batch)))


def _adapted_on(layout: str, config: GPTConfig):
    mesh, par, _ = _layout(layout)
    base = es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(0), mesh=mesh)
    return base, _nonzero_b(add_lora(base, ALL, key=jax.random.key(1)))


def _single(model):
    return to_single_device(es.gather(model))


def test_adapted_equals_base_exactly_at_init():
    mesh, par, batch = _layout("fsdp=4,tp=2+sp")
    base = es.sharded_init(lambda k: GPT(GQA, par, key=k), jax.random.key(0), mesh=mesh)
    adapted = add_lora(base, ALL, key=jax.random.key(1))
    step = _sharded_step("fsdp=4,tp=2+sp", GQA)
    trainable, frozen = eqx.partition(adapted, lora_trainable(adapted))
    loss, _, logits = step(trainable, frozen, jnp.asarray(WINDOWS))
    base_tr, base_fr = eqx.partition(base, lambda x: False)
    base_loss, _, base_logits = step(base_tr, base_fr, jnp.asarray(WINDOWS))
    assert np.array_equal(np.asarray(logits), np.asarray(base_logits))
    assert float(loss) == float(base_loss)
    # The adapters are the only trainable arrays, and the base ones are the model's own.
    leaves = jax.tree.leaves(trainable)
    assert leaves and all(x.shape[-1] == 4 or x.shape[-2] == 4 for x in leaves)
    assert all(x is y for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)))


@pytest.mark.parametrize("layout, config", LAYOUTS, ids=[f"{l}-{'gqa' if c.n_kv_heads else 'mha'}" for l, c in LAYOUTS])
def test_adapters_equal_one_device(layout, config):
    ref_model, (ref_loss, ref_grads, ref_logits) = _reference(config)
    _, adapted = _adapted_on(layout, config)
    # The adapters drawn on the layout are those drawn on one device.
    assert_tree_allclose(_single(adapted), ref_model)
    trainable, frozen = eqx.partition(adapted, lora_trainable(adapted))
    loss, grads, logits = _sharded_step(layout, config)(trainable, frozen, jnp.asarray(WINDOWS))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_tree_allclose(np.asarray(logits), np.asarray(ref_logits))
    # The gradients in the adapters' places, brought to one device's layout.
    grads = _single(eqx.tree_at(_adapters, adapted, grads, is_leaf=lambda x: x is None))
    grads = eqx.filter(grads, lora_trainable(grads))
    assert_tree_allclose(grads, ref_grads)


def test_merged_equals_adapted():
    ref_model, (_, _, ref_logits) = _reference(GQA)
    merged = merge_lora(ref_model)
    assert es.nn.LoRAAdapter not in {type(x) for x in jax.tree.leaves(merged, is_leaf=lambda x: isinstance(x, es.nn.LoRAAdapter))}
    logits = eqx.filter_jit(lambda m, w: m(w[:, :-1]))(merged, jnp.asarray(WINDOWS))
    assert_tree_allclose(np.asarray(logits), np.asarray(ref_logits))
    # On a layout: each merged weight stays where its base weight was.
    _, adapted = _adapted_on("fsdp=4,tp=2+sp", GQA)
    merged_there = merge_lora(adapted)
    for new, old in zip(jax.tree.leaves(merged_there), jax.tree.leaves(eqx.filter(adapted, lora_trainable(adapted), inverse=True))):
        assert new.sharding == old.sharding
    assert_tree_allclose(_single(merged_there), merged)


def test_bad_adapters_are_named():
    model = GPT(GQA, key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="'qq' is no target"):
        LoRA(4, targets=("q", "qq"))
    with pytest.raises(es.LayerConfigError, match="rank must be a positive integer"):
        LoRA(0)
    with pytest.raises(es.LayerConfigError, match=r"rank 20 on k is above the layer's width \(in 32, out 16\)"):
        add_lora(model, LoRA(20, targets=("q", "k")), key=jax.random.key(1))
    adapted = add_lora(model, LoRA(4), key=jax.random.key(1))
    with pytest.raises(es.LayerConfigError, match="has adapters already"):
        add_lora(adapted, LoRA(4), key=jax.random.key(1))
    moe = GPT(GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=48, moe_every=2, num_experts=2), key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="no 'gate' projection in its mixture-of-experts blocks"):
        add_lora(moe, LoRA(4, targets=("q", "gate")), key=jax.random.key(1))
    for rate in (-0.1, 1.0):
        with pytest.raises(es.LayerConfigError, match=rf"LoRA: dropout must be in \[0, 1\), got {rate}"):
            LoRA(4, dropout=rate)
    with pytest.raises(es.LayerConfigError, match="no LoRA adapters"):
        merge_lora(model)


def _peft_logits(model, layout):
    from .test_hf_llama import _logits

    return _logits(model, np.load(FIXTURES / "llama3_lora" / "expected.npz")["ids"], layout)


@pytest.mark.parametrize("layout", ["tp=4", "pp=2,fsdp=2,tp=2+r2"])
def test_peft_adapter_loads_against_peft(layout, tmp_path):
    """The adapter `peft` saved on the Llama 3.1 fixture gives the logits `peft`
    recorded (also from a circular pipeline of FSDP units, its layers stored dealt over
    the stages); export writes PEFT's tensors byte for byte; merged, it exports as Llama."""
    from .test_hf_llama import _forward, _tensor_bytes

    folder = FIXTURES / "llama3_lora"
    expected = np.load(folder / "expected.npz")
    mesh, par, _, _ = _forward(layout)
    adapted = load_peft(load_hf(str(FIXTURES / "llama3"), par, mesh), str(folder))
    np.testing.assert_allclose(_peft_logits(adapted, layout), expected["logits"], atol=1e-5, rtol=0)
    export_peft(adapted, str(tmp_path / "peft"), base_model_name_or_path="llama3")
    assert _tensor_bytes_of(tmp_path / "peft") == _tensor_bytes_of(folder)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    original = json.loads((folder / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora"):
        assert config[key] == original[key], key
    assert sorted(config["target_modules"]) == sorted(original["target_modules"])
    if layout != "tp=4":
        merged = merge_lora(adapted)  # the pipeline's stacked weights, each where it was
        np.testing.assert_allclose(_peft_logits(merged, layout), expected["logits"], atol=1e-5, rtol=0)
    else:
        # Read back (onto the adapted model too): the same bytes again.
        again = load_peft(adapted, str(tmp_path / "peft"))
        export_peft(again, str(tmp_path / "again"), base_model_name_or_path="llama3")
        assert _tensor_bytes_of(tmp_path / "again") == _tensor_bytes_of(folder)
        # Merged, then a plain Hugging Face folder: the adapted model's logits.
        export_hf(merge_lora(adapted), str(tmp_path / "merged"))
        merged = load_hf(str(tmp_path / "merged"), par, mesh)
        np.testing.assert_allclose(_peft_logits(merged, layout), expected["logits"], atol=1e-5, rtol=0)
        assert _tensor_bytes(tmp_path / "merged").keys() == _tensor_bytes(FIXTURES / "llama3").keys()
        # Generation (its cached attention) runs the adapters: as the merged model does.
        prompts = [list(map(int, expected["ids"][i, :5])) for i in range(2)]
        run = lambda m: generate(m, mesh, prompts, max_len=16, max_new_tokens=8).tokens  # noqa: E731
        assert run(adapted) == run(merged) != run(load_hf(str(FIXTURES / "llama3"), par, mesh))


def _tensor_bytes_of(folder):
    from safetensors.numpy import load_file

    return {n: a.tobytes() for n, a in load_file(str(folder / "adapter_model.safetensors")).items()}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"peft_type": "IA3"}, "peft_type='IA3'"),
        ({"use_rslora": True}, "use_rslora=true"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
        ({"bias": "all"}, "bias='all'"),
        ({"target_modules": ["q_proj", "c_attn"]}, r"target_modules \['c_attn'\]"),
        ({"r": 2}, "holds adapters of rank 2"),
    ],
)
def test_a_peft_config_the_gpt_cannot_take_is_named(change, match, tmp_path):
    folder = FIXTURES / "llama3_lora"
    (tmp_path / "a").mkdir()
    config = {**json.loads((folder / "adapter_config.json").read_text()), **change}
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    base = GPT(GQA, key=jax.random.key(0))
    model = add_lora(base, LoRA(4, targets=("q", "k", "v", "o", "gate", "up", "down")), key=jax.random.key(1))
    with pytest.raises(es.CheckpointError, match=match):
        load_peft(model, str(tmp_path / "a"))


def test_peft_folders_and_dtypes(tmp_path):
    base = GPT(GQA, key=jax.random.key(0))
    model = add_lora(base, LoRA(4, targets=("q", "k", "v", "o", "gate", "up", "down")), key=jax.random.key(1))
    with pytest.raises(es.CheckpointError, match="adapter_config.json: cannot read"):
        load_peft(base, str(tmp_path))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(es.CheckpointError, match="exists and is not empty"):
        export_peft(model, str(tmp_path / "taken"), base_model_name_or_path="x")
    with pytest.raises(es.CheckpointError, match="no LoRA adapters"):
        export_peft(base, str(tmp_path / "none"), base_model_name_or_path="x")
    # In another dtype (a bf16 model's adapters, as PEFT saves them), read back cast.
    model = _nonzero_b(model)
    export_peft(model, str(tmp_path / "bf16"), base_model_name_or_path="x", dtype="bfloat16")
    assert {i.dtype for i in checkpoint_tensors(str(tmp_path / "bf16"), single="adapter_model.safetensors").values()} == {"BF16"}
    again = load_peft(model, str(tmp_path / "bf16"))
    assert_tree_allclose(eqx.filter(again, lora_trainable(again)), eqx.filter(model, lora_trainable(model)), rtol=1e-2)


def test_live_against_peft(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (the hf-oracle extra)")
    torch = pytest.importorskip("torch", reason="torch is not installed (the hf-oracle extra)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

    from .test_hf_llama import _forward

    mesh, par, _, _ = _forward("fsdp=4,tp=2")
    adapted = _nonzero_b(add_lora(load_hf(str(FIXTURES / "qwen2"), par, mesh), ALL, key=jax.random.key(3)))
    export_peft(adapted, str(tmp_path / "peft"), base_model_name_or_path=str(FIXTURES / "qwen2"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(FIXTURES / "qwen2"), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    ids = np.load(FIXTURES / "qwen2" / "expected.npz")["ids"]
    with torch.no_grad():
        logits = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(_peft_logits(adapted, "fsdp=4,tp=2"), logits, atol=1e-5, rtol=0)
