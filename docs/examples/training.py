"""The train step, checkpoints, and resuming on another layout (resharding on restore).

The code of the guide `docs/guides/training.md`. Run it on a laptop CPU:

    python docs/examples/training.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import pathlib
import tempfile

import equinox as eqx
import optax

from equishard import Layout, param_table
from equishard._app import get_batch, load_stdlib_corpus  # the `equishard train` demo's corpus
from equishard.models import GPT, PRESETS, count_parameters
from equishard.train import (
    Checkpointer,
    Mirror,
    ZeRO1,
    export_model,
    import_model,
    make_train_step,
    trainable_mask,
)

# --8<-- [end:setup]

# --8<-- [start:data]
corpus = load_stdlib_corpus()  # the bytes of Python's own standard library, no download
BATCH, SEQ, STEPS = 8, 32, 6
batches = [get_batch(corpus.train, i * BATCH, BATCH, SEQ, seed=0) for i in range(STEPS)]
print(f"corpus: {len(corpus.train):,} training bytes; a batch is {batches[0].dtype}{list(batches[0].shape)}")
# --8<-- [end:data]


# --8<-- [start:step]
config = PRESETS["tiny"]  # a 2-layer GPT: d_model 64, 4 heads, byte vocabulary
optimizer = optax.adamw(3e-3)


def setup(spec, zero=False):
    """Mesh, initial state and train step of the GPT under a layout."""
    # zero: optimizer state split over dp (below). resolve() checks the layout once and
    # gives the one value everything reads: axes, roles, batch spec, ZeRO axis, mesh.
    parallelism = Layout(spec, zero=zero).resolve()
    mesh = parallelism.mesh()

    def make_model(key):
        return GPT(config, parallelism, key=key)

    def loss_fn(model, batch, key):  # local view; returns the *global* loss
        return model.loss(batch, key)

    # The optimizer state's layout is one of the step's parts, a value: Mirror() (the
    # default) or ZeRO1("dp"), the state split over dp (below).
    step = make_train_step(
        loss_fn, optimizer, mesh=mesh, batch_spec=parallelism.batch_spec, clip_norm=1.0,
        opt_sharding=ZeRO1(parallelism.zero) if parallelism.zero else Mirror(),
    )

    def init():  # born sharded in the step's layout; the same parameters on every layout
        return step.init_state(make_model, jax.random.key(0))

    return mesh, init, step


mesh, init, step = setup("fsdp=8")
state = init()
print(f"GPT with {count_parameters(state.model):,} parameters on {dict(mesh.shape)}")
# --8<-- [end:step]

# --8<-- [start:train]
workdir = pathlib.Path(tempfile.mkdtemp())
# An FSDP wrapper adds `.module` to the parameter paths: store them without it, so that
# a layout without FSDP finds the same keys.
ckpt = Checkpointer(workdir / "ckpt", path_map=lambda p: p.replace(".module.", "."))
losses = []
for batch in batches:
    state, metrics = step(state, batch)  # the old state is donated
    losses.append(float(metrics["loss"]))
    if int(state.step) == 3:
        ckpt.save(3, state)  # asynchronous; returns once the arrays are off the devices
ckpt.close()  # wait for the write to finish
print("fsdp=8, steps 1-6:        ", " ".join(f"{v:.5f}" for v in losses))
# --8<-- [end:train]

# --8<-- [start:resume]
mesh2, init2, step2 = setup("dp=2,tp=4")
template = eqx.filter_eval_shape(init2)  # shapes and specs, nothing computed
with Checkpointer(workdir / "ckpt", path_map=lambda p: p.replace(".module.", ".")) as ckpt:
    resumed = ckpt.restore(template, mesh=mesh2)  # each device reads its own blocks
print("restored at step", int(resumed.step), "on", dict(mesh2.shape))
resumed_losses = []
for batch in batches[3:]:
    resumed, metrics = step2(resumed, batch)
    resumed_losses.append(float(metrics["loss"]))
print("dp=2,tp=4, steps 4-6:     ", " ".join(f"{v:.5f}" for v in resumed_losses))
same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(resumed_losses, losses[3:]))
print("resumed losses equal the uninterrupted run:", same)
# --8<-- [end:resume]

# --8<-- [start:zero]
mesh3, init3, step3 = setup("dp=8", zero=True)  # `equishard train --layout dp=8 --zero`
zstate = init3()
mu = zstate.opt_state[0].mu.embed.weight  # AdamW's first moment of the embedding
print("parameters", zstate.model.embed.weight.spec, "first moment", mu.spec,
      "block", mu.value.sharding.shard_shape(mu.value.shape))  # fmt: skip
rows = param_table(zstate.opt_state, mesh3)
held, whole = sum(r.bytes_per_device for r in rows), sum(r.total_bytes for r in rows)
print(f"optimizer state per device: {held:,} of {whole:,} bytes ({held / whole:.4f})")
zero_losses = []
for batch in batches[:3]:
    zstate, metrics = step3(zstate, batch)
    zero_losses.append(float(metrics["loss"]))
print("dp=8 --zero, steps 1-3:   ", " ".join(f"{v:.5f}" for v in zero_losses))
same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(zero_losses, losses[:3]))
print("ZeRO losses equal the fsdp=8 run:", same)
# --8<-- [end:zero]

# --8<-- [start:frozen]
# Fine-tune the attention only: the embedding, the MLPs, the norms and the head are frozen.
layout4 = Layout("fsdp=8").resolve()
attention = lambda path, leaf: ".attn." in path  # noqa: E731 - paths as param_table writes them
step4 = make_train_step(
    lambda model, batch, key: model.loss(batch, key), optimizer, mesh=layout4.mesh(),
    batch_spec=layout4.batch_spec, clip_norm=1.0, trainable=attention,
)  # fmt: skip


def make_base(key):  # in a real run: the pretrained model, e.g. loaded from a folder
    return GPT(config, layout4, key=key)


fstate = step4.init_state(make_base, jax.random.key(0))  # optimizer state: attention only
full_moments = sum(r.total_bytes for r in param_table(init().opt_state, mesh))
moments = sum(r.total_bytes for r in param_table(fstate.opt_state, layout4.mesh()))
print(f"optimizer state: {moments:,} of {full_moments:,} bytes")
for batch in batches[:3]:
    fstate, metrics = step4(fstate, batch)
base = step4.init_state(make_base, jax.random.key(0)).model  # the base, loaded again
mask = trainable_mask(base, attention)  # a flag per array; split -> (trained, frozen)
before, after = (jax.tree.leaves(mask.split(m)[1]) for m in (base, fstate.model))
kept = all(bool((a == b).all()) for a, b in zip(before, after, strict=True))
print("frozen arrays bit-identical after 3 steps:", kept)
# A checkpoint of the trained part: the attention, its optimizer state, the step, and a
# fingerprint of the base; restored onto the base, checked against the fingerprint.
with Checkpointer(workdir / "tuned", path_map=lambda p: p.replace(".module.", ".")) as tuned:
    tuned.save(3, fstate, trainable=step4.trainable, base_source="initial GPT, key 0")
    stored = len(tuned.read_metadata()["arrays"])
    again = tuned.restore(eqx.filter_eval_shape(lambda: fstate), mesh=layout4.mesh(), base=base)
print("restored onto the base at step", int(again.step), "from", stored, "stored arrays")
# --8<-- [end:frozen]

# --8<-- [start:export]
path = export_model(resumed.model, workdir / "gpt.eqx")  # gathered, unboxed, one file
plain = import_model(path, eqx.filter_eval_shape(lambda: GPT(config, key=jax.random.key(0))))
ids = batches[0][:2, :-1]
logits = eqx.filter_jit(plain)(ids)  # an ordinary one-device Equinox model
print("exported model:", path.name, "logits", logits.shape)
# --8<-- [end:export]

import shutil  # noqa: E402

shutil.rmtree(workdir)  # the checkpoint and the exported file were only for this demo
