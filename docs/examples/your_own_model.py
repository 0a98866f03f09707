"""Your own Equinox model, unchanged, on one device, data parallel, FSDP and tensor
parallel: the same losses, with dropout on and an optax chain; a checkpoint restored
on another layout; the plain model back.

The code of the guide `docs/guides/your-own-model.md`. Run it on a laptop CPU:

    python docs/examples/your_own_model.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import example_keys
from equishard.train import init_train_state, make_train_step

# --8<-- [end:setup]


# --8<-- [start:model]
class Attention(eqx.Module):
    """Causal attention with grouped-query heads, written with `eqx.nn.Linear`."""

    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, dim, n_heads, n_kv_heads, *, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        head = self.head_dim = dim // n_heads
        self.wq = eqx.nn.Linear(dim, n_heads * head, use_bias=False, key=kq)
        self.wk = eqx.nn.Linear(dim, n_kv_heads * head, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(dim, n_kv_heads * head, use_bias=False, key=kv)
        self.wo = eqx.nn.Linear(n_heads * head, dim, use_bias=False, key=ko)
        self.dropout = eqx.nn.Dropout(0.1)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads

    def __call__(self, x, *, key):  # x: f32[S, D], one example
        seq, head = x.shape[0], self.head_dim
        q = jax.vmap(self.wq)(x).reshape(seq, self.n_heads, head)
        k = jax.vmap(self.wk)(x).reshape(seq, self.n_kv_heads, head)
        v = jax.vmap(self.wv)(x).reshape(seq, self.n_kv_heads, head)
        k = jnp.repeat(k, self.n_heads // self.n_kv_heads, axis=1)
        v = jnp.repeat(v, self.n_heads // self.n_kv_heads, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(head)
        causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        weights = self.dropout(weights, key=key)
        return jax.vmap(self.wo)(jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, -1))


class Block(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attn: Attention
    norm2: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    gate: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, *, key):
        ka, ku, kg, kd = jax.random.split(key, 4)
        self.norm1, self.norm2 = eqx.nn.RMSNorm(dim), eqx.nn.RMSNorm(dim)
        self.attn = Attention(dim, n_heads=4, n_kv_heads=2, key=ka)
        self.up = eqx.nn.Linear(dim, 2 * dim, use_bias=False, key=ku)
        self.gate = eqx.nn.Linear(dim, 2 * dim, use_bias=False, key=kg)
        self.down = eqx.nn.Linear(2 * dim, dim, use_bias=False, key=kd)

    def __call__(self, x, *, key):
        x = x + self.attn(jax.vmap(self.norm1)(x), key=key)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h))


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, vocab=64, dim=64, depth=2, *, key):
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.blocks = [Block(dim, key=k) for k in jax.random.split(kb, depth)]
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=kh)

    def __call__(self, tokens, *, key):  # int[S] -> f32[S, vocab]
        x = jax.vmap(self.embed)(tokens)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k)
        return jax.vmap(self.head)(x)
# --8<-- [end:model]


# --8<-- [start:loss]
def loss_fn(model, batch, key, *, index):
    # Written as on one device: the mean over the batch it is given (in the local view
    # this device's block; the step averages it over the data axes). `index`:
    # int32[B_local], where these examples sit in the global batch. One key per
    # example: the same masks on every layout. `es.unbox` gives the plain model, its
    # FSDP units gathered, in either view.
    keys = example_keys(key, index)
    logits = jax.vmap(es.unbox(model))(batch[:, :-1], key=keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), {}
# --8<-- [end:loss]


# --8<-- [start:train]
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
rng = np.random.default_rng(0)
batches = [rng.integers(0, 64, (16, 17), dtype=np.int32) for _ in range(5)]


def one_fsdp_unit_each(path, module):
    """Each block, the embedding and the head: one FSDP unit each."""
    return isinstance(module, Block) or path in ("embed", "head")


def make_model(mesh):
    def make(key):
        model = Model(key=key)
        if "tp" in mesh.axis_names:  # see "Tensor parallelism without editing the model"
            model = es.parallelize(model, plan, mesh, probe=probe)
        if "fsdp" in mesh.axis_names:
            model = es.nn.fsdp_wrap(model, "fsdp", policy=one_fsdp_unit_each)
        return model

    return make


def train(layout, grad_accum=1, steps=4):
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))
    state = init_train_state(make_model(mesh), optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(
        loss_fn, optimizer, mesh=mesh, batch_spec=P(data), grad_accum=grad_accum
    )
    losses = []
    for batch in batches[:steps]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, step
# --8<-- [end:train]


# --8<-- [start:plan]
plan = {
    r"embed": "vocab",  # rows split over tp, lookups summed
    r"blocks\[\d+\]\.attn": es.nn.HeadParallel("n_heads", "n_kv_heads", dropout_dim=0),
    r"blocks\[\d+\]\.(attn\.w[qkv]|up|gate)": "column",  # output features split
    r"blocks\[\d+\]\.(attn\.wo|down)": "row",  # input features split, outputs summed
    r"head": es.nn.ColwiseParallel(gather_output=True),  # whole logits for the loss
}


def probe(model):
    """One forward pass, dropout on: under the plan it must equal the original's."""
    return model(batches[0][0, :-1], key=jax.random.key(1))
# --8<-- [end:plan]


# --8<-- [start:run]
runs = {}
for name, layout, grad_accum in [
    ("one device", "dp=1", 1),
    ("dp=8", "dp=8", 2),
    ("fsdp=8", "fsdp=8", 2),
    ("dp=2,fsdp=4", "dp=2,fsdp=4", 1),
    ("dp=4,tp=2", "dp=4,tp=2", 2),
    ("fsdp=4,tp=2", "fsdp=4,tp=2", 2),
]:
    runs[name] = state, losses, step = train(layout, grad_accum)
    print(f"{name:12} grad_accum={grad_accum} losses", " ".join(f"{x:.6f}" for x in losses))
# --8<-- [end:run]


# --8<-- [start:global]
def tp_rules(layout):
    """The plan's splits as path rules: q, k, v, gate, up and the head by output
    features over tp, o and down by input features; fsdp (if any) on the other dimension."""
    fsdp = "fsdp" if "fsdp" in layout else None
    return [
        (r"attn\.w[qkv]\.weight|\.(up|gate)\.weight|head\.weight", P("tp", fsdp)),
        (r"attn\.wo\.weight|\.down\.weight", P(fsdp, "tp")),
        (r"embed\.weight", P(fsdp, None)),
    ]


mesh = es.make_mesh("fsdp=4,tp=2")
make = lambda k: es.apply_rules(Model(key=k), tp_rules("fsdp=4,tp=2"))  # noqa: E731
state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
step = make_train_step(loss_fn, optimizer, mesh=mesh, batch_spec=P("fsdp"), view="global")  # the same loss
losses = []
for batch in batches[:4]:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
print(f"{'global view':12} fsdp=4,tp=2  losses", " ".join(f"{x:.6f}" for x in losses))
# --8<-- [end:global]


# --8<-- [start:fused]
from equishard.nn import fused_cross_entropy


def hidden(model, tokens, *, key):  # the model's call without its head: f32[S, D]
    x = jax.vmap(model.embed)(tokens)
    for block, k in zip(model.blocks, jax.random.split(key, len(model.blocks))):
        x = block(x, key=k)
    return x


def fused_loss(model, batch, key, *, index):
    model, keys = es.unbox(model), example_keys(key, index)
    h = jax.vmap(lambda t, k: hidden(model, t, key=k))(batch[:, :-1], keys)
    # Chunks of 64 tokens; the head's rows stay split over tp, the batch over fsdp.
    sums = fused_cross_entropy(
        h, model.head.weight, batch[:, 1:], "tp", mesh=mesh, batch_axes="fsdp", chunk_size=64
    )
    return sums.loss / sums.tokens, {"accuracy": sums.correct / sums.tokens}


state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
step = make_train_step(fused_loss, optimizer, mesh=mesh, batch_spec=P("fsdp"), view="global")
losses = []
for batch in batches[:4]:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
print(f"{'fused loss':12} fsdp=4,tp=2  losses", " ".join(f"{x:.6f}" for x in losses))
# --8<-- [end:fused]


# --8<-- [start:checkpoint]
import tempfile

from equishard.train import Checkpointer

# Stored under paths without FSDP's `.module`: any layout's state can read them.
canonical = lambda path: path.replace(".module.", ".")  # noqa: E731
saved, _, tp_step = runs["fsdp=4,tp=2"]
_, _, dp_step = runs["dp=8"]
with tempfile.TemporaryDirectory() as workdir:
    with Checkpointer(workdir, path_map=canonical) as ckpt:
        ckpt.save(4, saved)  # written on fsdp=4,tp=2 ...
    dp8 = es.make_mesh("dp=8")  # ... read into a dp=8 state: plain Linear layers there
    like = eqx.filter_eval_shape(lambda: init_train_state(make_model(dp8), optimizer, jax.random.key(0), mesh=dp8))
    with Checkpointer(workdir, path_map=canonical) as ckpt:
        restored = ckpt.restore(like, mesh=dp8)
plain = es.unbox(es.gather(saved.model))  # the model as written, on one device
print("plain model back:", type(plain.embed).__name__, type(plain.blocks[0].attn.wq).__name__)
_, after_restore = dp_step(restored, batches[4])
_, after_save = tp_step(saved, batches[4])
print(f"step 5 on dp=8 after restore {float(after_restore['loss']):.6f}")
print(f"step 5 on fsdp=4,tp=2        {float(after_save['loss']):.6f}")
# --8<-- [end:checkpoint]
