"""Your own Equinox model beyond transformers: a convolutional net and a Mamba-style
selective state-space model (a depthwise causal convolution and `jax.lax.associative_scan`),
under data parallelism, FSDP and tensor parallelism by path rules in the global view.

The code of the guide `docs/guides/your-own-model.md` ("Beyond transformers"). Run it on
a laptop CPU:

    python docs/examples/your_own_conv_and_scan.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.train import init_train_state, make_train_step

# --8<-- [end:setup]


# --8<-- [start:conv-model]
class ConvNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 32, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(32, 32, 3, padding=1, stride=2, key=k2)
        self.head = eqx.nn.Linear(32, 10, key=k3)

    def __call__(self, x):  # x: f32[3, H, W], one image -> f32[10]
        h = jax.nn.gelu(self.conv1(x))
        h = jax.nn.gelu(self.conv2(h))
        return self.head(h.mean(axis=(1, 2)))


def conv_rules(layout):
    """conv1's output channels and conv2's input channels over tp (XLA sums conv2's
    partial products); the other channel dimension over fsdp."""
    tp = "tp" if "tp" in layout else None
    fsdp = "fsdp" if "fsdp" in layout else None
    return [
        (r"conv1\.weight", P(tp, None)),  # f32[32 out, 3 in, 3, 3]
        (r"conv1\.bias", P(tp)),  # f32[32, 1, 1]
        (r"conv2\.weight", P(fsdp, tp)),  # f32[32 out, 32 in, 3, 3]
    ]
# --8<-- [end:conv-model]


# --8<-- [start:scan-model]
class Mamba(eqx.Module):
    """A selective state-space block: in-projection to x and gate z, a depthwise causal
    convolution, input-dependent step sizes Δ and matrices B, C, a linear recurrence
    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t solved by an associative scan, out-projection."""

    in_proj: eqx.nn.Linear
    conv: eqx.nn.Conv1d
    x_proj: eqx.nn.Linear
    dt_proj: eqx.nn.Linear
    A_log: jax.Array
    D: jax.Array
    out_proj: eqx.nn.Linear
    state: int = eqx.field(static=True)
    rank: int = eqx.field(static=True)

    def __init__(self, dim, inner, state, rank, *, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.in_proj = eqx.nn.Linear(dim, 2 * inner, use_bias=False, key=k1)
        self.conv = eqx.nn.Conv1d(inner, inner, 4, padding=((3, 0),), groups=inner, key=k2)
        self.x_proj = eqx.nn.Linear(inner, rank + 2 * state, use_bias=False, key=k3)
        self.dt_proj = eqx.nn.Linear(rank, inner, key=k4)
        self.A_log = jnp.log(jnp.tile(jnp.arange(1.0, state + 1), (inner, 1)))  # f32[E, N]
        self.D = jnp.ones(inner)
        self.out_proj = eqx.nn.Linear(inner, dim, use_bias=False, key=k5)
        self.state, self.rank = state, rank

    def __call__(self, u):  # u: f32[S, D], one sequence
        x, z = jnp.split(jax.vmap(self.in_proj)(u), 2, axis=-1)  # f32[S, E] each
        x = jax.nn.silu(self.conv(x.T).T)  # depthwise, causal: f32[S, E]
        dt, B, C = jnp.split(jax.vmap(self.x_proj)(x), [self.rank, self.rank + self.state], axis=-1)
        dt = jax.nn.softplus(jax.vmap(self.dt_proj)(dt))  # f32[S, E]
        A = -jnp.exp(self.A_log)  # f32[E, N]
        decay = jnp.exp(dt[:, :, None] * A[None])  # f32[S, E, N]
        drive = (dt * x)[:, :, None] * B[:, None, :]  # f32[S, E, N]

        def combine(a, b):  # (decay, state) pairs: a before b
            return a[0] * b[0], b[0] * a[1] + b[1]

        _, h = jax.lax.associative_scan(combine, (decay, drive))  # f32[S, E, N]
        y = jnp.einsum("sen,sn->se", h, C) + self.D[None] * x
        return jax.vmap(self.out_proj)(y * jax.nn.silu(z))


class MambaLM(eqx.Module):
    embed: eqx.nn.Embedding
    norms: list
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, vocab=64, dim=32, depth=2, *, key):
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.norms = [eqx.nn.RMSNorm(dim) for _ in range(depth)]
        self.blocks = [Mamba(dim, 2 * dim, 8, 4, key=k) for k in jax.random.split(kb, depth)]
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=kh)

    def __call__(self, tokens):  # int32[S] -> f32[S, vocab]
        h = jax.vmap(self.embed)(tokens)
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(jax.vmap(norm)(h))
        return jax.vmap(self.head)(h)


def mamba_rules(layout):
    """The inner channels E over tp, wherever they appear: the in-projection's outputs,
    the convolution's channels, Δ's projection, A and D, the out-projection's inputs."""
    tp = "tp" if "tp" in layout else None
    fsdp = "fsdp" if "fsdp" in layout else None
    return [
        (r"blocks\[\d+\]\.in_proj\.weight", P(tp, fsdp)),  # f32[2E, D]
        (r"blocks\[\d+\]\.conv\.(weight|bias)", P(tp)),  # f32[E, 1, 4], f32[E, 1]
        (r"blocks\[\d+\]\.x_proj\.weight", P(None, tp)),  # f32[R + 2N, E]
        (r"blocks\[\d+\]\.dt_proj\.(weight|bias)", P(tp)),  # f32[E, R], f32[E]
        (r"blocks\[\d+\]\.(A_log|D)", P(tp)),  # f32[E, N], f32[E]
        (r"blocks\[\d+\]\.out_proj\.weight", P(fsdp, tp)),  # f32[D, E]
        (r"embed\.weight|head\.weight", P(fsdp)),  # f32[V, D]
    ]
# --8<-- [end:scan-model]


# --8<-- [start:train]
optimizer = optax.adamw(3e-3)
rng = np.random.default_rng(0)
images = [(rng.normal(size=(16, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32)) for _ in range(3)]
tokens = [rng.integers(0, 64, (16, 17)).astype(np.int32) for _ in range(3)]


def classify(model, batch, key):  # the global view: the whole batch, the global mean
    x, labels = batch
    logits = jax.vmap(es.unbox(model))(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}


def next_token(model, batch, key):
    logits = jax.vmap(es.unbox(model))(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), {}


def train(Model, rules, loss, batches, layout):
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))
    make = lambda key: es.apply_rules(Model(key=key), rules(layout), strict=True)  # noqa: E731
    state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(loss, optimizer, mesh=mesh, batch_spec=P(data), view="global")
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


for name, Model, rules, loss, batches in [
    ("conv net", ConvNet, conv_rules, classify, images),
    ("mamba", MambaLM, mamba_rules, next_token, tokens),
]:
    _, reference = train(Model, rules, loss, batches, "dp=1")  # one device
    print(f"{name:8} {'one device':12} losses", " ".join(f"{x:.6f}" for x in reference))
    for layout in ["dp=8", "fsdp=8", "fsdp=4,tp=2"]:
        state, losses = train(Model, rules, loss, batches, layout)
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        print(f"{name:8} {layout:12} losses", " ".join(f"{x:.6f}" for x in losses), f"max rel. err {err:.0e}")
        assert err <= 1e-5, (name, layout, losses, reference)
# --8<-- [end:train]


# --8<-- [start:placed]
# The Mamba block's arrays on fsdp=4,tp=2: the inner channels split over tp.
block = state.model.blocks[0]
for path, box in [("in_proj.weight", block.in_proj.weight), ("conv.weight", block.conv.weight),
                  ("A_log", block.A_log), ("out_proj.weight", block.out_proj.weight)]:  # fmt: skip
    print(f"{path:16} {box.global_shape} {box.spec} per device {box.value.sharding.shard_shape(box.global_shape)}")
# --8<-- [end:placed]


# --8<-- [start:refusals]
mesh = es.make_mesh("dp=4,tp=2")
try:  # a plan for a convolution
    es.parallelize(ConvNet(key=jax.random.key(0)), {"conv1": "column", "conv2": "row"}, mesh)
except es.LayerConfigError as err:
    print(str(err).replace("; ", ";\n"))
try:  # a transformer-style plan for a Mamba block: its convolution stays whole
    plan = {r"blocks\[\d+\]\.in_proj": "column", r"blocks\[\d+\]\.out_proj": "row"}
    es.parallelize(MambaLM(key=jax.random.key(0)), plan, mesh, probe=lambda m: jax.vmap(m)(tokens[0][:2, :8]))
except es.LayerConfigError as err:
    message = str(err)  # after the probe's own failure, the cause:
    print(message[message.index("The plan leaves") : message.index(" For such a model")])
# --8<-- [end:refusals]
