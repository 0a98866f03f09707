"""Meshes and specs: how a module carries its specs, and the transforms that read them.

The code of the guide `docs/guides/meshes-and-specs.md`, which includes it section by
section. Run it on a laptop CPU (8 simulated devices):

    python docs/examples/meshes_and_specs.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import equishard as es

print(f"{jax.device_count()} devices")
# --8<-- [end:setup]

# --8<-- [start:mesh]
mesh = es.make_mesh("dp=2,tp=4")  # 2 x 4 devices; axis names are plain strings
print("mesh:", dict(mesh.shape))
# --8<-- [end:mesh]


# --8<-- [start:module]
class MLP(eqx.Module):
    w1: es.Sharded  # f32[D, F], split over its columns on "tp"
    w2: es.Sharded  # f32[F, D], split over its rows on "tp"
    b2: jax.Array  # f32[D], a plain array: replicated
    act: Callable  # not an array: the filter_* functions pass it through untouched

    def __init__(self, d, f, *, key):
        k1, k2 = jax.random.split(key)
        self.w1 = es.Sharded(jax.random.normal(k1, (d, f)) / d**0.5, P(None, "tp"))
        self.w2 = es.Sharded(jax.random.normal(k2, (f, d)) / f**0.5, P("tp", None))
        self.b2 = jnp.zeros(d)
        self.act = jax.nn.relu


model = es.sharded_init(lambda k: MLP(64, 256, key=k), jax.random.key(0), mesh=mesh)
print(es.specs_of(model))
# --8<-- [end:module]

# --8<-- [start:table]
print(es.format_param_table(model, mesh))
# --8<-- [end:table]

# --8<-- [start:optax]
opt_state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array))
mu_specs = es.specs_of(opt_state)[0].mu
print("adamw mu.w1:", mu_specs.w1, " mu.w2:", mu_specs.w2)
# --8<-- [end:optax]

# --8<-- [start:shard]
x = jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64)  # one device, not split
xs = es.shard(es.Sharded(x, P("dp", None)), mesh)  # split over "dp", replicated over "tp"
print("per-device block:", xs.value.addressable_shards[0].data.shape)
back = es.gather(xs)  # whole again, on one device
print("gather(shard(x)) == x:", bool(jnp.array_equal(back.value, x)))
# --8<-- [end:shard]


# --8<-- [start:local]
def reference_loss(model, x):  # the single-device computation, on global arrays
    h = model.act(x @ model.w1.value)
    y = h @ model.w2.value + model.b2[None, :]
    return jnp.mean((y - x) ** 2)


@es.filter_shard_map(mesh=mesh, in_specs=(None, P("dp")), out_specs=P())
def loss(model, x):  # the local view: every array is this device's block
    print("  inside: w1", model.w1.value.shape, " x", x.shape)
    h = model.act(x @ model.w1.value)  # f32[B/dp, D] @ f32[D, F/tp] -> f32[B/dp, F/tp]
    y = jax.lax.psum(h @ model.w2.value, "tp")  # f32[B/dp, F/tp] @ f32[F/tp, D], summed
    y = y + model.b2[None, :]
    return jax.lax.pmean(jnp.mean((y - x) ** 2), "dp")  # the global loss


x = jax.random.normal(jax.random.key(1), (16, 64))
sharded = loss(model, x)
single = reference_loss(es.gather(model), x)
print(f"loss sharded {float(sharded):.6f}  single device {float(single):.6f}")
# --8<-- [end:local]

# --8<-- [start:grad]
grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
single_grads = eqx.filter_grad(reference_loss)(es.gather(model), x)
print("grad w1 spec:", grads.w1.spec)


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


for name in ("w1", "w2"):
    got, want = getattr(grads, name).value, getattr(single_grads, name).value
    print(f"grad {name} relative error {rel_err(es.gather(got), want):.1e}")
# --8<-- [end:grad]


# --8<-- [start:global]
@eqx.filter_jit
def program(model, x):  # plain global-view JAX code ...
    x = jnp.tanh(x)
    return 3.0 * loss(model, x)  # ... calling the sharded function on global arrays


print(f"global view {float(program(model, x)):.6f}  "
      f"single device {3.0 * float(reference_loss(es.gather(model), jnp.tanh(x))):.6f}")
# --8<-- [end:global]

# --8<-- [start:rules]
rules = [
    (r"layers\[0\]\.weight", P("tp", None)),  # eqx.nn.Linear stores weight as [out, in]
    (r"layers\[0\]\.bias", P("tp")),
    (r"layers\[1\]\.weight", P(None, "tp")),
]  # first match wins; no match: replicated
mlp = es.sharded_init(
    lambda k: es.apply_rules(eqx.nn.MLP(64, 64, 256, depth=1, key=k), rules),
    jax.random.key(0),
    mesh=mesh,
)
print(es.format_param_table(mlp, mesh))
y = jax.vmap(es.unbox(mlp))(x)  # called as the plain eqx.nn.MLP it is (global view)
print("unmodified MLP output:", y.shape)
# --8<-- [end:rules]

# --8<-- [start:errors]
bad = es.Sharded(jnp.zeros((6, 64)), P("tp", None))  # 6 rows do not split 4 ways
try:
    es.shard({"blocks": [bad]}, mesh)
except es.SpecError as err:
    print("SpecError:", err)
# --8<-- [end:errors]
