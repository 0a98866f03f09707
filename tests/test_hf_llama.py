"""Hugging Face checkpoints of the Llama family onto the reference GPT under every layout,
against the logits, loss and greedy continuation `transformers` recorded
(`scripts/make_hf_fixtures.py`), and back out again."""

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

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
    _hf,
    export_hf,
    gpt_config_from_hf,
    load_hf,
    read_hf_config,
)
from equishard.train import _safetensors, checkpoint_tensors

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["llama3", "llama32_bf16", "mistral", "qwen2"]
# "+sp": Megatron sequence parallelism over tp; "+r2": a circular pipeline, 2 stages a device.
LAYOUTS = ["dp=8", "fsdp=8", "tp=2", "tp=4", "fsdp=4,tp=2", "pp=2,dp=2,tp=2", "dp=2,tp=4+sp", "pp=2,fsdp=2,tp=2+r2"]


@functools.cache
def _forward(layout: str):
    """The jitted sharded forward pass of a GPT under `layout`: global `int32[8, 16]` ids
    in, global float32 logits `[8, 16, V]` out."""
    spec, sp, repeats = layout.split("+")[0], layout.endswith("+sp"), 2 if layout.endswith("+r2") else 1
    resolved = es.Layout(spec, sequence_parallel=sp, pipeline_repeats=repeats).resolve()
    mesh, batch, par = resolved.mesh(), resolved.batch_spec, resolved
    vocab_axis = "tp" if "tp" in mesh.axis_names else None

    def body(model, ids):
        logits = model(ids.value)  # f32[B/data, T, V/tp]
        return from_last_stage(logits, par.pipeline) if par.pipeline else logits

    call = es.filter_shard_map(body, mesh=mesh, out_specs=P(batch[0] if len(batch) else None, None, vocab_axis))
    return mesh, par, batch, eqx.filter_jit(lambda m, ids: call(m, es.Sharded(ids, batch)))


def _logits(model, ids, layout):
    _, _, _, fn = _forward(layout)
    out = np.asarray(fn(model, jnp.asarray(ids)))
    real = model.config.real_vocab_size or model.config.vocab_size
    assert (out[..., real:] == np.finfo(np.float32).min).all()  # padded ids never win
    return out[..., :real]


def _greedy(model, prompt, layout, n):
    """The greedy continuation of `prompt` by `n` tokens (one compiled forward pass of a
    fixed window, the causal mask making the tokens after the cursor irrelevant)."""
    window = np.zeros((8, 16), np.int32)
    window[:, : len(prompt)] = prompt
    out = []
    for i in range(n):
        at = len(prompt) + i
        token = int(np.argmax(_logits(model, window, layout)[0, at - 1]))
        window[:, at] = token
        out.append(token)
    return np.array(out, np.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_loads_under_every_layout(family, layout):
    folder = FIXTURES / family
    expected = np.load(folder / "expected.npz")
    mesh, par, _, _ = _forward(layout)
    model = load_hf(str(folder), par, mesh)
    logits = _logits(model, expected["ids"], layout)
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-5, rtol=0)
    # The loss, from the logits (transformers' shift: position t predicts t + 1).
    lse = jax.nn.logsumexp(logits[:, :-1], axis=-1)
    picked = np.take_along_axis(logits[:, :-1], expected["ids"][:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(float(np.mean(lse - picked)), float(expected["loss"]), rtol=1e-5)
    if layout in ("fsdp=4,tp=2", "pp=2,dp=2,tp=2"):
        greedy = _greedy(model, expected["prompt"], layout, len(expected["greedy"]))
        np.testing.assert_array_equal(greedy, expected["greedy"])


def _tensor_bytes(folder):
    infos = checkpoint_tensors(str(folder))
    read = _safetensors._reader(infos)
    return {n: read(n, tuple(slice(0, d) for d in i.shape)).tobytes() for n, i in infos.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_is_byte_identical(family, tmp_path):
    folder = FIXTURES / family
    # One family from a circular pipeline of FSDP units (its layers stored dealt).
    mesh, par, _, _ = _forward("pp=2,fsdp=2,tp=2+r2" if family == "llama3" else "fsdp=4,tp=2")
    model = load_hf(str(folder), par, mesh)
    to = tmp_path / "out"
    # Split at a small size: several files and their index.
    export_hf(model, str(to), hf_config=read_hf_config(str(folder)), max_shard_bytes=40_000, tokenizer_from=str(folder))
    assert _tensor_bytes(to) == _tensor_bytes(folder)
    assert (to / "model.safetensors.index.json").exists()
    assert json.loads((to / "config.json").read_text()) == read_hf_config(str(folder))
    assert (to / "tokenizer_config.json").read_bytes() == (folder / "tokenizer_config.json").read_bytes()
    assert (to / "generation_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_a_gpt_trained_here_exports_as_llama(tmp_path):
    config = GPTConfig(vocab_size=60, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48, norm_eps=1e-5)
    mesh, par, _, _ = _forward("tp=4")
    model = es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(1), mesh=mesh)
    model = jax.tree.map(lambda x: x + 0.3 if eqx.is_inexact_array(x) else x, model)  # norms not all ones
    export_hf(model, str(tmp_path / "llama"))
    hf = read_hf_config(str(tmp_path / "llama"))
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["vocab_size"] == 60
    again = load_hf(str(tmp_path / "llama"), par, mesh)
    ids = np.random.default_rng(0).integers(0, 60, (8, 16)).astype(np.int32)
    np.testing.assert_array_equal(_logits(again, ids, "tp=4"), _logits(model, ids, "tp=4"))
    moe = GPTConfig(moe_every=2, n_layers=2)
    with pytest.raises(es.CheckpointError, match="mixture-of-experts layers .moe_every=2."):
        export_hf(eqx.filter_eval_shape(lambda: GPT(moe, key=jax.random.key(0))), str(tmp_path / "moe"))
    with pytest.raises(es.CheckpointError, match="exists and is not empty"):
        export_hf(model, str(tmp_path / "llama"))


def test_an_interrupted_export_leaves_no_folder(tmp_path, monkeypatch):
    folder = FIXTURES / "mistral"
    mesh, par, _, _ = _forward("dp=8")
    model = load_hf(str(folder), par, mesh)
    calls = []
    real = _hf.tensor_of

    def dies_half_way(*args):
        calls.append(1)
        if len(calls) > 20:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(_hf, "tensor_of", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        export_hf(model, str(tmp_path / "out"), hf_config=read_hf_config(str(folder)), max_shard_bytes=20_000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architecture \['GPT2LMHeadModel'\] is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling of type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling of type 'linear'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 8}, "sliding_window=8"),
    ],
)
def test_what_the_gpt_cannot_represent_is_refused_by_name(change, match):
    hf = {**read_hf_config(str(FIXTURES / "llama3")), **change}
    with pytest.raises(es.CheckpointError, match=match):
        gpt_config_from_hf(hf, seq_len=16)


def test_a_bad_folder_is_named_before_anything_is_read(tmp_path):
    mesh, par, _, _ = _forward("dp=8")
    with pytest.raises(es.CheckpointError, match="config.json: cannot read"):
        load_hf(str(tmp_path), par, mesh)
    shutil.copytree(FIXTURES / "qwen2", tmp_path / "q")
    hf = read_hf_config(str(tmp_path / "q"))
    (tmp_path / "q" / "config.json").write_text(json.dumps({**hf, "intermediate_size": 64}))
    with pytest.raises(es.CheckpointError, match=r"mlp.up.weight has shape \(4, 2, 64, 32\) but its tensors"):
        load_hf(str(tmp_path / "q"), par, mesh)


def test_live_against_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the hf-oracle extra)")
    torch = pytest.importorskip("torch", reason="torch is not installed (the hf-oracle extra)")
    folder = FIXTURES / "qwen2"
    expected = np.load(folder / "expected.npz")
    mesh, par, _, _ = _forward("fsdp=4,tp=2")
    export_hf(load_hf(str(folder), par, mesh), str(tmp_path / "out"), hf_config=read_hf_config(str(folder)))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model(torch.tensor(expected["ids"], dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-5, rtol=0)


CHILD = '''
import json, sys
from equishard.distributed import initialize
initialize()  # join the other process, before any JAX computation
import jax, numpy as np
import equishard as es
from equishard.train import _safetensors
sys.path.insert(0, sys.argv[1])
from tests.test_hf_llama import _forward, FIXTURES

reads = []
make_reader = _safetensors._reader
def counting(infos):
    read = make_reader(infos)
    def wrapped(name, index):
        out = read(name, index)
        reads.append(out.nbytes)
        return out
    return wrapped
_safetensors._reader = counting

from equishard.models import load_hf
folder = FIXTURES / "llama3"
expected = np.load(folder / "expected.npz")
mesh, par, _, fn = _forward("fsdp=4,tp=2")
model = load_hf(str(folder), par, mesh)
logits = fn(model, jax.numpy.asarray(expected["ids"]))
error = max(float(np.abs(np.asarray(s.data) - expected["logits"][s.index]).max()) for s in logits.addressable_shards)
held = 0
for leaf in jax.tree.leaves(model):
    seen = {}
    for s in leaf.addressable_shards:
        seen[tuple((i.start, i.stop) for i in s.index)] = s.data.nbytes
    held += sum(seen.values())
total = sum(i.shape and int(np.prod(i.shape)) * 4 or 4 for i in _safetensors.checkpoint_tensors(str(folder)).values())
print("RESULT", json.dumps({"process": jax.process_index(), "error": error, "read": sum(reads), "held": held, "total": total}))
'''


def _launch_two(tmp_path, code: str, *args: str) -> list[dict]:
    """Run `code` as 2 processes x 4 devices (`equishard launch`); their RESULT lines."""
    root = pathlib.Path(__file__).resolve().parents[1]
    script = tmp_path / "child.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQUISHARD_")}
    argv = [sys.executable, "-m", "equishard", "launch", "-n", "2", "--devices", "8", "--",
            sys.executable, str(script), str(root), *args]  # fmt: skip
    done = subprocess.run(argv, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["process"] for r in results) == [0, 1]
    return results


def test_two_processes_each_read_only_their_blocks(tmp_path):
    results = _launch_two(tmp_path, CHILD)
    for r in results:
        assert r["error"] <= 1e-5, r
        # Each process reads exactly its devices' distinct blocks: less than the checkpoint.
        assert r["read"] == r["held"] < r["total"], r


EXPORT_CHILD = CHILD.split("from equishard.models import load_hf")[0] + '''
from equishard.models import export_hf, load_hf, read_hf_config
folder = FIXTURES / "qwen2"
mesh, par, _, fn = _forward("pp=2,dp=2,tp=2")
model = load_hf(str(folder), par, mesh)
export_hf(model, sys.argv[2], hf_config=read_hf_config(str(folder)), max_shard_bytes=60_000)
print("RESULT", json.dumps({"process": jax.process_index()}))
'''


def test_two_processes_export_one_folder(tmp_path):
    _launch_two(tmp_path, EXPORT_CHILD, str(tmp_path / "out"))
    assert _tensor_bytes(tmp_path / "out") == _tensor_bytes(FIXTURES / "qwen2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "out"]
