"""Pipeline parallelism: GPipe and circular schedules, the bubble, and a pipelined stack of
blocks equal to the same blocks run one after the other.

The code of the guide `docs/guides/pipeline.md`. Run it on a laptop CPU:

    python docs/examples/pipeline.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import SCHEDULES, from_last_stage, pipeline_schedule, schedule_report
from equishard.report import count_collectives, read_collectives

# --8<-- [end:setup]

# --8<-- [start:schedule]
one_f_one_b = pipeline_schedule("1f1b", num_stages=4, num_microbatches=8)
print("1F1B: what each device does, step by step (F3 = forward of micro-batch 3, . = idle)")
for t, row in enumerate(one_f_one_b.rows()):
    print(f"  step {t:2d}: {row}")
for name in SCHEDULES:
    repeats = 2 if name in ("circular", "interleaved-1f1b") else 1
    print(schedule_report(pipeline_schedule(name, 4, 8, repeats=repeats)))
# --8<-- [end:schedule]

# --8<-- [start:bubble]
for m in (4, 8, 16, 32):
    bubble = {
        name: schedule_report(pipeline_schedule(name, 4, m, repeats=r)).bubble_fraction
        for name, r in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
    }
    print(f"M={m:2d}  " + "  ".join(f"{name} {b:.3f}" for name, b in bubble.items())
          + f"  (3/(M+3) = {3 / (m + 3):.3f})")
# --8<-- [end:bubble]


# --8<-- [start:block]
D, T, L = 32, 8, 8  # width, tokens, layers


class Block(eqx.Module):
    """A residual MLP block: activations in, activations of the same shape out."""

    w1: jax.Array
    w2: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (D, 4 * D)) / D**0.5
        self.w2 = jax.random.normal(k2, (4 * D, D)) / (4 * D) ** 0.5

    def __call__(self, x):  # f32[b, T, D] -> f32[b, T, D]
        return x + jax.nn.gelu(x @ self.w1) @ self.w2


def loss_of(y):
    return jnp.mean(y**2)


# The reference: the L blocks run in order on one device.
key = jax.random.key(0)
blocks = [Block(k) for k in jax.random.split(key, L)]  # the keys PipelineModule uses
x = jax.random.normal(jax.random.key(1), (16, T, D))


def sequential(blocks, x):
    for block in blocks:
        x = block(x)
    return loss_of(x)


ref_loss, ref_grads = jax.jit(jax.value_and_grad(sequential))(blocks, x)
print(f"sequential loss {float(ref_loss):.4f}")
# --8<-- [end:block]


# --8<-- [start:pipeline]
def pipelined(layout, repeats, num_microbatches):
    mesh = es.make_mesh(layout)
    pipe = es.sharded_init(
        lambda k: es.nn.PipelineModule(
            Block, "pp", num_microbatches,
            num_layers=L, num_stages=mesh.shape["pp"], repeats=repeats, key=k,
        ),
        key, mesh=mesh,
    )  # fmt: skip
    data = "dp" if "dp" in mesh.axis_names else None

    @es.filter_shard_map(mesh=mesh, in_specs=(None, P(data)), out_specs=P())
    def loss(pipe, x):  # local view: this device's stage(s), this data shard
        y = pipe(x)  # f32[B/dp, T, D] on the last stage, zeros on the others
        local = loss_of(y)
        local = jax.lax.pmean(local, data) if data else local
        return from_last_stage(local, "pp")  # the global loss, on every stage

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(pipe, x).compile()
    value, grads = step(pipe, x)
    layers = grads.unstack()  # the gradients of the L blocks, in model order
    err = max(
        float(jnp.linalg.norm(g.w1 - r.w1) / jnp.linalg.norm(r.w1))
        for g, r in zip(layers, ref_grads)
    )
    ops = [op for op in read_collectives(step) if op.group_size > 1]
    print(f"{layout:9s} repeats={repeats} M={num_microbatches}: loss {float(value):.4f}, "
          f"gradients equal: {err < 1e-5}, collectives {count_collectives(ops)}")


pipelined("pp=4", repeats=1, num_microbatches=8)  # GPipe
pipelined("pp=4", repeats=2, num_microbatches=8)  # circular: 2 stages per device
pipelined("dp=2,pp=4", repeats=1, num_microbatches=4)  # pipeline x data parallel
# --8<-- [end:pipeline]


# --8<-- [start:explicit]
def scheduled(schedule, repeats=1, num_microbatches=8):
    mesh = es.make_mesh("pp=4")
    pipe = es.sharded_init(
        lambda k: es.nn.PipelineModule(
            Block, "pp", num_microbatches, num_layers=L, num_stages=4, repeats=repeats,
            schedule=schedule, key=k,
        ),
        key, mesh=mesh,
    )  # fmt: skip

    @es.filter_shard_map(mesh=mesh, in_specs=(None, P()), out_specs=P())
    def loss(pipe, x):
        # The loss of each micro-batch is computed on the last stage as soon as its
        # forward ends (`last`); the mean over micro-batches is the same on every stage.
        return pipe.loss(x, (), last=lambda params, y, targets: loss_of(y))

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(pipe, x).compile()
    value, grads = step(pipe, x)
    err = max(
        float(jnp.linalg.norm(g.w1 - r.w1) / jnp.linalg.norm(r.w1))
        for g, r in zip(grads.unstack(), ref_grads)
    )
    peak = schedule_report(pipe.table()).peak_in_flight
    print(f"{schedule:16s} R={repeats} M={num_microbatches}: loss {float(value):.4f}, "
          f"gradients equal: {err < 1e-5}, micro-batches held per device {list(peak)}")


scheduled("1f1b")
scheduled("interleaved-1f1b", repeats=2)
scheduled("zb-h1")
# --8<-- [end:explicit]
