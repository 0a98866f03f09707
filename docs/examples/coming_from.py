"""Coming from the PyTorch model-parallel library or the xLSTM JAX library: their
examples, in equishard.

The code of the guide `docs/guides/coming-from.md`. Run it on a laptop CPU:

    python docs/examples/coming_from.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.nn import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

# --8<-- [end:setup]

# --8<-- [start:torch]
vocab_size, in_features, out_features, bsz, tsz = 64, 32, 48, 4, 16
mesh = es.make_mesh("tp=8")  # init_parallelism(): here, a mesh with a model axis


class Parallel(eqx.Module):
    parallel_embedding: ParallelEmbedding
    column_parallel_linear: ColumnParallelLinear
    row_parallel_linear: RowParallelLinear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.parallel_embedding = ParallelEmbedding(vocab_size, in_features, key=k1)
        self.column_parallel_linear = ColumnParallelLinear(
            in_features, out_features, bias=True, gather_output=False, key=k2
        )
        self.row_parallel_linear = RowParallelLinear(
            out_features, out_features, bias=True, input_is_parallel=True, key=k3
        )

    def __call__(self, x):
        return self.row_parallel_linear(self.column_parallel_linear(self.parallel_embedding(x)))


model = es.sharded_init(lambda k: Parallel(key=k), jax.random.key(0), mesh=mesh)
x = jax.random.randint(jax.random.key(1), (bsz, tsz), 0, vocab_size - 1)
y = es.filter_shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(None, P()), out_specs=P())(model, x)

# The single-process model of the same weights: Embedding -> Linear -> Linear.
plain = es.gather(model)  # master weights
emb = plain.parallel_embedding.master_weight
col, row = plain.column_parallel_linear, plain.row_parallel_linear
h = emb[x] @ col.master_weight.T + col.master_bias[None, None, :]
y_single = h @ row.master_weight.T + row.master_bias[None, None, :]
err = float(jnp.linalg.norm(es.gather(y) - y_single) / jnp.linalg.norm(y_single))
print(f"Embedding -> Column -> Row on tp=8 equals the sequential model: {err < 1e-5}")
# --8<-- [end:torch]

# --8<-- [start:xlstm]
import functools

from equishard.nn import Dense, TPAsyncDense, TPDense

D, F, T, tp = 32, 128, 16, 4
mesh = es.make_mesh("dp=2,tp=4")
k1, k2 = jax.random.split(jax.random.key(2))


def mlp(dense_cls):  # xLSTM's tensor-parallel MLP: "gather" (D -> F/tp) then "scatter" (F/tp -> D/tp)
    # "scatter": TPDense's one layer gives all D outputs (Flax: partial(nn.Dense, features=D));
    # TPAsyncDense's one layer per ring step gives D // tp (xLSTM: features=D // tp_size).
    down_features = D // tp if dense_cls is TPAsyncDense else D
    up = dense_cls(
        dense_fn=functools.partial(Dense, D, F // tp),  # Flax: partial(nn.Dense, features=F // tp)
        model_axis_name="tp",
        tp_mode="gather",
        kernel_init_adjustment=tp**-0.5,
        dense_name="up",
        key=k1,
    )
    down = dense_cls(
        dense_fn=functools.partial(Dense, F // tp, down_features),
        model_axis_name="tp",
        tp_mode="scatter",
        dense_name="down",
        key=k2,
    )
    return up, down


features = P("dp", None, "tp")  # [batch, tokens, features], features split over "tp"
x = jax.random.normal(jax.random.key(3), (4, T, D))
outputs = {}
for dense_cls in (TPDense, TPAsyncDense):
    layers = es.sharded_init(lambda: mlp(dense_cls), mesh=mesh)

    @es.filter_shard_map(mesh=mesh, in_specs=(None, features), out_specs=features)
    def forward(layers, x):  # x: f32[B/dp, T, D/tp]
        up, down = layers
        return down(jax.nn.gelu(up(x)))  # -> f32[B/dp, T, F/tp] -> f32[B/dp, T, D/tp]

    outputs[dense_cls.__name__] = eqx.filter_jit(forward)(layers, x)
up, down = es.gather(es.sharded_init(lambda: mlp(TPDense), mesh=mesh))  # global kernels
reference = down(jax.nn.gelu(up(x)))  # outside shard_map: plain dense layers
for name, y in outputs.items():
    err = float(jnp.linalg.norm(es.gather(y) - reference) / jnp.linalg.norm(reference))
    print(f"{name} gather -> scatter on feature-split activations equals the unsharded MLP: {err < 1e-5}")
# --8<-- [end:xlstm]

# --8<-- [start:xlstm_fsdp]
from equishard.nn import shard_module_params

mesh = es.make_mesh("data=2,fsdp=4")


class MLP(eqx.Module):  # the model being sharded: any Equinox module
    layers: list

    def __init__(self, *, key):
        ka, kb = jax.random.split(key)
        self.layers = [Dense(D, F, key=ka), Dense(F, D, key=kb)]

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x)))


# xLSTM: shard_module_params(MLP, axis_name="fsdp", min_weight_size=...); here the module.
model = es.sharded_init(
    lambda k: shard_module_params(MLP(key=k), axis_name="fsdp", min_weight_size=2**8), jax.random.key(4), mesh=mesh
)
batch = P(("data", "fsdp"))
x = jax.random.normal(jax.random.key(5), (16, D))
t = jax.random.normal(jax.random.key(6), (16, D))


@eqx.filter_jit
@functools.partial(
    es.filter_shard_map, mesh=mesh, in_specs=(None, batch, batch), out_specs=(P(), None),
    check_vma=False,  # xLSTM's shard_map(..., check_rep=False)
)
def train_grads(model, x, t):
    def loss_fn(model):  # each device's local loss
        return jnp.mean((model(x) - t) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    grads = es.sync_gradients(grads, ("data", "fsdp"))  # xLSTM: sync_gradients(grads, (data, fsdp))
    return jax.lax.pmean(loss, ("data", "fsdp")), grads


loss, grads = train_grads(model, x, t)
plain = es.unbox(es.gather(model.module))
ref_loss, ref_grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - t) ** 2))(plain)
leaves = zip(jax.tree.leaves(es.unbox(es.gather(grads.module))), jax.tree.leaves(ref_grads))
err = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in leaves)
print(f"xLSTM's FSDP recipe (local loss, sync_gradients) gives the single-device gradients: {err < 1e-5}")
# --8<-- [end:xlstm_fsdp]
