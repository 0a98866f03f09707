"""Training on your own data: tokenize text, read packed batches, train with document masking.

The code of the guide `docs/guides/your-data.md`. Run it on a laptop CPU:

    python docs/examples/your_data.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import dataclasses
import json
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np
import optax

import equishard as es
from equishard._app import stdlib_files
from equishard._app._tokenize import tokenize
from equishard.models import GPT, GPTConfig
from equishard.train import TokenFiles, batch_at, init_train_state, make_train_step

work = pathlib.Path(tempfile.mkdtemp())
# --8<-- [end:setup]

# --8<-- [start:tokenize]
# Any text: here 20 files of Python's standard library, each one document.
inputs = list(stdlib_files())[:20]
manifest = tokenize(inputs, work / "data", train_bpe_vocab=512, val_every=10, progress=False)
train = manifest["splits"]["train"]
print(f"dtype {manifest['dtype']}, vocabulary {manifest['tokenizer']['vocab_size']}")
print(f"train: {train['documents']} documents, {train['tokens']} tokens, {train['bytes']} bytes")
print(f"val: {manifest['splits']['val']['documents']} documents")
print("files:", sorted(p.name for p in (work / "data").iterdir()))
# --8<-- [end:tokenize]

# --8<-- [start:packed]
source = TokenFiles(work / "data", seq_len=128)
batch = batch_at(source, position=0, batch_size=8, seed=0)  # rows 0..7 of epoch 0
print(f"{len(source)} sequences per epoch; fields:", sorted(batch))
# A sequence where one document ends and the next begins:
example = next(source[i] for i in range(len(source)) if source[i]["segment_ids"].max() > 0)
cut = int(np.argmax(example["segment_ids"] == 1))
for name in ("inputs", "labels", "segment_ids", "document_positions"):
    print(f"{name:18s}", example[name][cut - 3 : cut + 3].tolist())

config = GPTConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128)
rows = {k: jnp.asarray(v[None]) for k, v in example.items()}  # one row
for masking in (True, False):
    model = GPT(dataclasses.replace(config, document_masking=masking), key=jax.random.key(0))
    print(f"document_masking={masking}: loss {float(model.loss(rows)[0]):.6f}")
# --8<-- [end:packed]

# --8<-- [end:packed]

# --8<-- [start:train]
def train_on(spec, layout_options=None, steps=4):
    layout = es.Layout(spec, **(layout_options or {}))
    mesh, par = layout.mesh(), layout.resolve()
    files = TokenFiles(work / "data", seq_len=128, cp=par.size(par.context))
    optimizer = optax.adamw(3e-3)
    state = init_train_state(lambda k: GPT(config, par, key=k), optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(lambda m, b, k: m.loss(b, k), optimizer, mesh=mesh, batch_spec=layout.resolve().batch_spec)
    sharding = jax.sharding.NamedSharding(mesh, layout.resolve().batch_spec)
    losses = []
    for i in range(steps):
        state, metrics = step(state, batch_at(files, 8 * i, 8, seed=0, sharding=sharding))
        losses.append(float(metrics["loss"]))
    return losses


one = train_on("dp=1")
for spec, options in (("dp=2,cp=2", {"cp_impl": "ring"}), ("dp=2,pp=2", {})):
    losses = train_on(spec, options)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, one))
    print(f"{spec:10s} losses {' '.join(f'{x:.4f}' for x in losses)}  max relative difference {worst:.1e}")
print(json.dumps({"dp=1": [round(x, 4) for x in one]}))
# --8<-- [end:train]
