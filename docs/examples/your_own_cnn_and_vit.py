"""Your own Equinox model, round 2: a CNN with batch norms (a model state) and a Vision
Transformer with dropout under a tensor-parallel plan, on one device and on 8.

The code of the guide `docs/guides/your-own-model.md` (its last two sections). Run it
on a laptop CPU:

    python docs/examples/your_own_cnn_and_vit.py
"""

# --8<-- [start:cnn-setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import example_keys
from equishard.train import LocalView, init_train_state, make_train_step

# --8<-- [end:cnn-setup]


# --8<-- [start:cnn-model]
class ConvBlock(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm

    def __init__(self, cin, cout, *, key):
        self.conv = eqx.nn.Conv2d(cin, cout, 3, padding=1, use_bias=False, key=key)
        self.norm = eqx.nn.BatchNorm(cout, axis_name="batch", mode="batch")

    def __call__(self, x, state):  # x: f32[C, H, W], one image
        h, state = self.norm(self.conv(x), state)
        return jax.nn.relu(h), state


class CNN(eqx.Module):
    stem: ConvBlock
    block: ConvBlock
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = ConvBlock(3, 16, key=k1)
        self.block = ConvBlock(16, 64, key=k2)
        self.head = eqx.nn.Linear(64, 10, key=k3)

    def __call__(self, x, state):
        h, state = self.stem(x, state)
        h, state = self.block(h, state)
        return self.head(h.mean(axis=(1, 2))), state


def cnn_loss(model, state, batch, key):  # the stateful form, written as on one device
    images, labels = batch
    forward = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    logits, state = forward(images, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), ({}, state)
# --8<-- [end:cnn-model]


# --8<-- [start:cnn-train]
rng = np.random.default_rng(0)
images = [(rng.normal(size=(16, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32)) for _ in range(4)]
optimizer = optax.adamw(3e-3)


def train_cnn(layout, grad_accum=1, batch_stats="global"):
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))

    def make(key):
        model, state = eqx.nn.make_with_state(CNN)(key=key)  # as Equinox prescribes
        if "fsdp" in mesh.axis_names:
            model = es.nn.fsdp_wrap(model, "fsdp", policy=lambda path, m: path == "block")
        return model, state

    state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(cnn_loss, optimizer, mesh=mesh, batch_spec=P(data),
                           grad_accum=grad_accum, view=LocalView(batch_stats=batch_stats))  # fmt: skip
    losses = []
    for batch in images:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def running_mean(state):
    """The first batch norm's running mean, after the steps."""
    model = es.unbox(es.gather(state.model))
    return np.asarray(state.model_state.get(model.stem.norm.batch_state_index)[0])


cnn_runs = {layout: train_cnn(layout) for layout in ["dp=1", "dp=8", "fsdp=8", "dp=4,fsdp=2"]}
one_state = cnn_runs["dp=1"][0]
for layout, (state, losses) in cnn_runs.items():
    err = np.linalg.norm(running_mean(state) - running_mean(one_state)) / np.linalg.norm(running_mean(one_state))
    print(f"{layout:12} losses", " ".join(f"{x:.6f}" for x in losses), f"running mean {err:.1e}")
# --8<-- [end:cnn-train]


# --8<-- [start:cnn-device]
state, losses = train_cnn("dp=8", batch_stats="device")
print("dp=8 per-device statistics: losses", " ".join(f"{x:.6f}" for x in losses))
# --8<-- [end:cnn-device]


# --8<-- [start:cnn-inference]
state, _ = cnn_runs["fsdp=8"]
model, model_state = es.unbox(es.gather((state.model, state.model_state)))  # plain Equinox
model = eqx.nn.inference_mode(model)  # the running statistics, not the batch's
logits, _ = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(images[0][0], model_state)
print("inference on one device:", logits.shape)
# --8<-- [end:cnn-inference]


# --8<-- [start:vit-model]
class Mlp(eqx.Module):
    """timm's ViT MLP: fc1, GELU, dropout, fc2, dropout."""

    fc1: eqx.nn.Linear
    drop1: eqx.nn.Dropout
    fc2: eqx.nn.Linear
    drop2: eqx.nn.Dropout

    def __init__(self, dim, hidden, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = eqx.nn.Linear(dim, hidden, key=k1), eqx.nn.Linear(hidden, dim, key=k2)
        self.drop1, self.drop2 = eqx.nn.Dropout(0.1), eqx.nn.Dropout(0.1)

    def __call__(self, x, *, key):  # x: f32[D], one token
        k1, k2 = jax.random.split(key)
        h = self.drop1(jax.nn.gelu(self.fc1(x)), key=k1)
        return self.drop2(self.fc2(h), key=k2)


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: Mlp

    def __init__(self, dim, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, use_query_bias=True, use_key_bias=True,
                                              use_value_bias=True, use_output_bias=True, key=k1)  # fmt: skip
        self.mlp = Mlp(dim, 4 * dim, key=k2)

    def __call__(self, x, *, key):  # x: f32[T, D]
        k1, k2 = jax.random.split(key)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, key=k1)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x), key=jax.random.split(k2, x.shape[0]))


class ViT(eqx.Module):
    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, dim=32, depth=2, heads=4, patch=4, image=16, classes=10, *, key):
        kp, kc, kb, kh = jax.random.split(key, 4)
        self.patch = eqx.nn.Conv2d(3, dim, patch, stride=patch, key=kp)
        self.cls = 0.02 * jax.random.normal(kc, (1, dim))
        self.pos = jnp.zeros(((image // patch) ** 2 + 1, dim))
        self.blocks = [Block(dim, heads, key=k) for k in jax.random.split(kb, depth)]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=kh)

    def __call__(self, x, *, key):  # x: f32[3, H, W] -> f32[classes]
        tokens = self.patch(x).reshape(self.cls.shape[1], -1).T  # [patches, D]
        x = jnp.concatenate([self.cls, tokens]) + self.pos
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k)
        return self.head(self.norm(x[0]))


def vit_loss(model, batch, key, *, index):  # as on one device: the step averages it
    images, labels = batch
    logits = jax.vmap(model)(images, key=example_keys(key, index))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}
# --8<-- [end:vit-model]


# --8<-- [start:vit-plan]
plan = {
    r"blocks\[\d+\]\.attn": "heads",  # eqx.nn.MultiheadAttention: its heads split over tp
    r"blocks\[\d+\]\.mlp\.fc1": "column",  # hidden features split over tp ...
    r"blocks\[\d+\]\.mlp\.fc2": "row",  # ... and summed back
}
pictures = [(rng.normal(size=(16, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32)) for _ in range(3)]


def train_vit(layout, plan=None):
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))

    def make(key):
        model = ViT(key=key)
        return model if plan is None else es.parallelize(model, plan, mesh)

    state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(vit_loss, optimizer, mesh=mesh, batch_spec=P(data))
    losses = []
    for batch in pictures:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


try:
    train_vit("dp=4,tp=2", plan)
except es.LayerConfigError as err:
    print(str(err).replace(". ", ".\n"))
# --8<-- [end:vit-plan]


# --8<-- [start:vit-fix]
plan[r"blocks\[\d+\]\.mlp\.drop1"] = es.nn.DropoutParallel(dim=-1)  # its block of the mask
print(f"{'one device':12} losses", " ".join(f"{x:.6f}" for x in train_vit("dp=1")))
print(f"{'dp=4,tp=2':12} losses", " ".join(f"{x:.6f}" for x in train_vit("dp=4,tp=2", plan)))
# --8<-- [end:vit-fix]
