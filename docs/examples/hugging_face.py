"""From a Hugging Face checkpoint: load a Llama-family model under a layout, each device
reading its own blocks, fine-tune it, export it back; and a user's own Equinox model
filled from safetensors with a map of its own.

The code of the guide `docs/guides/hugging-face.md`. Run it on a laptop CPU:

    python docs/examples/hugging_face.py

The checkpoint is a tiny random Llama 3.1 (llama3 rotary scaling, two key/value heads)
that `transformers` saved in two safetensors files (tests/fixtures/hf/llama3, with the
logits `transformers` computed for it).
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import pathlib
import re
import tempfile

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import from_last_stage
from equishard.models import export_hf, load_hf, read_hf_config
from equishard.train import (
    Stacked,
    Tensor,
    Transposed,
    checkpoint_tensors,
    load_safetensors,
    source_tensors,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "fixtures" / "hf" / "llama3"  # config.json + safetensors
# --8<-- [end:setup]


# --8<-- [start:load]
def logits_under(layout: es.Layout, model, ids):
    """The logits `[B, T, V]` of `model` on `ids` in the local view of `layout`."""
    par = layout.resolve()  # axes, roles, batch spec, mesh: one value
    batch = par.batch_spec
    vocab = "tp" if "tp" in par.axes else None

    def body(model, ids):
        logits = model(ids.value)  # f32[B/data, T, V/tp]
        return from_last_stage(logits, par.pipeline) if par.pipeline else logits

    call = es.filter_shard_map(body, mesh=par.mesh(), out_specs=P(batch[0] if len(batch) else None, None, vocab))
    return np.asarray(eqx.filter_jit(call)(model, es.Sharded(jnp.asarray(ids), batch)))


expected = np.load(SOURCE / "expected.npz")  # what transformers computed
for spec in ("fsdp=8", "tp=4", "fsdp=4,tp=2", "pp=2,dp=2,tp=2"):
    layout = es.Layout(spec)
    model = load_hf(str(SOURCE), layout.resolve(), layout.mesh())
    logits = logits_under(layout, model, expected["ids"])
    error = np.abs(logits - expected["logits"]).max()
    print(f"{spec:16s} max |logits - transformers'| = {error:.1e}")
# --8<-- [end:load]


# --8<-- [start:finetune]
layout = es.Layout("fsdp=4,tp=2")
model = load_hf(str(SOURCE), layout.resolve(), layout.mesh())
batch_spec = layout.resolve().batch_spec


@eqx.filter_jit
def sgd_step(model, windows):
    def loss(model, windows):  # the global loss (each device's mean, averaged)
        return model.loss(windows.value)[0]

    grad = es.filter_shard_map(
        eqx.filter_value_and_grad(loss), mesh=layout.mesh(), out_specs=(P(), None)
    )
    value, grads = grad(model, es.Sharded(windows, batch_spec))
    return value, jax.tree.map(lambda p, g: p - 0.5 * g, model, grads)


windows = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
for step in range(3):
    value, model = sgd_step(model, windows)
    print(f"step {step}: loss {float(value):.4f}")
# --8<-- [end:finetune]


# --8<-- [start:export]
out = pathlib.Path(tempfile.mkdtemp()) / "llama3-finetuned"
export_hf(model, str(out), hf_config=read_hf_config(str(SOURCE)), tokenizer_from=str(SOURCE))
print(sorted(p.name for p in out.iterdir()))
again = load_hf(str(out), es.Layout("tp=4").resolve(), es.Layout("tp=4").mesh())
print("exported and reloaded under tp=4: logits max difference",
      f"{np.abs(logits_under(es.Layout('tp=4'), again, expected['ids']) - logits_under(layout, model, expected['ids'])).max():.1e}")
# --8<-- [end:export]

# --8<-- [start:transformers]
try:
    import torch  # pyright: ignore[reportMissingImports]
    import transformers  # pyright: ignore[reportMissingImports]
except ImportError:
    print("transformers is not installed: skipping the comparison")
else:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf_model(torch.tensor(expected["ids"], dtype=torch.long)).logits.numpy()
    print(f"transformers on the export: max difference {np.abs(theirs - logits_under(layout, model, expected['ids'])).max():.1e}")
# --8<-- [end:transformers]


# --8<-- [start:lora]
import optax

from equishard.models import LoRA, add_lora, export_peft, gpt_training, load_peft, merge_lora
from equishard.train import Checkpointer

lora = LoRA(8, alpha=16.0, targets=("q", "v"))  # rank 8 on the attention's q and v
par, mesh = layout.resolve(), layout.mesh()  # fsdp=4,tp=2, as above
base = load_hf(str(SOURCE), par, mesh)
training = gpt_training(base.config, par, mesh, optax.adamw(1e-2), lora=lora)  # trains the adapters only
state = training.init_state(jax.random.key(0))  # the optimizer state: the adapters' moments
state = eqx.tree_at(lambda s: s.model, state, add_lora(base, lora, key=jax.random.key(1)))  # B = 0: the base itself
for step in range(5):
    state, metrics = training.step(state, windows)
    print(f"LoRA step {step}: loss {float(metrics['loss']):.4f}")

workdir = pathlib.Path(tempfile.mkdtemp())
size = lambda folder: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())  # noqa: E731
with Checkpointer(workdir / "adapters") as ckpt:  # the adapters, their moments, the base's fingerprint
    ckpt.save(5, state, trainable=training.step.trainable, base_source=str(SOURCE))
with Checkpointer(workdir / "whole") as ckpt:
    ckpt.save(5, state)
print(f"adapter checkpoint {size(workdir / 'adapters'):,} bytes, whole state {size(workdir / 'whole'):,} bytes")
like = eqx.filter_eval_shape(lambda: state)
fresh = training.init_state(jax.random.key(0))  # a new run: its base is random
try:
    Checkpointer(workdir / "adapters").restore(like, mesh=mesh, base=fresh.model)
except es.CheckpointError as err:
    message = re.sub(r"[0-9a-f]{32}", "<hash>", str(err).split(" was ", 1)[1]).replace(str(SOURCE), "SOURCE")
    print("refused:", message)
loaded = load_hf(str(SOURCE), par, mesh)  # the base again: the adapters restore onto it
restored = Checkpointer(workdir / "adapters").restore(like, mesh=mesh, base=add_lora(loaded, lora, key=jax.random.key(1)))
print("restored onto the base at step", int(restored.step))

adapted = logits_under(layout, state.model, expected["ids"])
export_peft(state.model, str(workdir / "peft"), base_model_name_or_path=str(SOURCE))  # PEFT's layout
print(sorted(p.name for p in (workdir / "peft").iterdir()), f"{size(workdir / 'peft'):,} bytes")
peft = load_peft(load_hf(str(SOURCE), par, mesh), str(workdir / "peft"))
print(f"PEFT adapters loaded onto the base: logits max difference {np.abs(logits_under(layout, peft, expected['ids']) - adapted).max():.1e}")
export_hf(merge_lora(state.model), str(workdir / "merged"), hf_config=read_hf_config(str(SOURCE)))
merged = load_hf(str(workdir / "merged"), es.Layout("tp=4").resolve(), es.Layout("tp=4").mesh())
print(f"merged, exported, loaded under tp=4: logits max difference {np.abs(logits_under(es.Layout('tp=4'), merged, expected['ids']) - adapted).max():.1e}")
# --8<-- [end:lora]


# --8<-- [start:own]
class TwoLayers(eqx.Module):
    """A user's own model: two dense layers, [in, out] weights, split by their specs."""

    w1: es.Sharded
    w2: es.Sharded

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1.value) @ self.w2.value


skeleton = eqx.filter_eval_shape(
    lambda: TwoLayers(
        es.Sharded(jnp.zeros((32, 48)), P("fsdp", "tp")),  # f32[32, 48]: [in, out]
        es.Sharded(jnp.zeros((2, 48, 32)), P(None, "tp", "fsdp")),
    )
)
mapping = {
    # The checkpoint's [out, in] weights, transposed; the second stacks two tensors.
    ".w1": Transposed(Tensor("model.layers.0.mlp.gate_proj.weight")),
    ".w2": Stacked((
        Transposed(Tensor("model.layers.0.mlp.down_proj.weight")),
        Transposed(Tensor("model.layers.1.mlp.down_proj.weight")),
    )),
}  # fmt: skip
try:  # every tensor the map leaves unused is named (with its shape and file) first
    load_safetensors(skeleton, mapping, str(SOURCE), mesh=es.make_mesh("fsdp=2,tp=4"))
except es.CheckpointError as err:
    lines = str(err).splitlines()
    print(lines[0], f"{len(lines) - 1} problems, the first:", lines[1].strip().rsplit(" (", 1)[0])
used = {name for source in mapping.values() for name in source_tensors(source)}
own = load_safetensors(
    skeleton, mapping, str(SOURCE), mesh=es.make_mesh("fsdp=2,tp=4"),
    ignore=set(checkpoint_tensors(str(SOURCE))) - used,  # the rest of the checkpoint
)  # fmt: skip
print("w1", own.w1.value.shape, own.w1.value.sharding.spec, "w2", own.w2.value.shape, own.w2.value.sharding.spec)
# --8<-- [end:own]
