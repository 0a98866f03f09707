"""Data parallel, FSDP, tensor parallel, sequence parallel, FSDP+TP: the same MLP in
every layout, with the same losses.

The code of the guide `docs/guides/layouts.md`. Run it on a laptop CPU:

    python docs/examples/layouts.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.report import read_collectives

# --8<-- [end:setup]


# --8<-- [start:model]
class Block(eqx.Module):
    """`x + down(gelu(up(x)))`: a column-parallel layer, then a row-parallel one."""

    up: es.nn.ColumnParallelLinear
    down: es.nn.RowParallelLinear

    def __init__(self, d, f, *, sequence_parallel=False, key):
        k1, k2 = jax.random.split(key)
        sp = sequence_parallel
        # up: weight f32[F, D] split over F on "tp"; its output stays split over F.
        self.up = es.nn.ColumnParallelLinear(
            d, f, gather_output=False, sequence_parallel=sp, key=k1
        )
        # down: weight f32[D, F] split over F on "tp"; partial sums summed over "tp"
        # (all-reduce), or summed and split over the tokens (reduce-scatter) with sp.
        self.down = es.nn.RowParallelLinear(
            f, d, input_is_parallel=True, sequence_parallel=sp, key=k2
        )

    def __call__(self, x):  # x: f32[B, S, D], or f32[B, S/tp, D] with sp
        return x + self.down(jax.nn.gelu(self.up(x)))


class MLP(eqx.Module):
    blocks: list

    def __init__(self, d, f, depth, *, sequence_parallel=False, key):
        keys = jax.random.split(key, depth)
        self.blocks = [Block(d, f, sequence_parallel=sequence_parallel, key=k) for k in keys]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x
# --8<-- [end:model]


# --8<-- [start:layout]
D, F, DEPTH, B, S = 64, 256, 2, 16, 8
DATA_AXES = ("dp", "fsdp")  # the batch is split over whichever of these the mesh has


def build(layout, sequence_parallel=False):
    """The MLP born sharded on the mesh of `layout`, and its loss in the local view."""
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a in DATA_AXES)

    def make(key):
        model = MLP(D, F, DEPTH, sequence_parallel=sequence_parallel, key=key)
        # No "tp" axis on the mesh: drop it from the specs (the layers compute locally).
        model = es.restrict_specs(model, mesh.axis_names)
        if "fsdp" in mesh.axis_names:  # split each block's weights over "fsdp" too
            model = eqx.tree_at(
                lambda m: m.blocks,
                model,
                [es.nn.FSDP(b, "fsdp", min_weight_size=1024) for b in model.blocks],
            )
        return model

    model = es.sharded_init(make, jax.random.key(0), mesh=mesh)  # the same on any mesh
    tokens = "tp" if sequence_parallel else None  # sp: the sequence is split over "tp"
    batch_spec = P(data or None, tokens)
    mean_over = data + ((tokens,) if tokens else ())

    @es.filter_shard_map(mesh=mesh, in_specs=(None, batch_spec, batch_spec), out_specs=P())
    def loss(model, x, t):  # local view: x, t are f32[B/data, S(/tp), D]
        local = jnp.mean((model(x) - t) ** 2)
        return jax.lax.pmean(local, mean_over) if mean_over else local  # the global loss

    return mesh, model, loss
# --8<-- [end:layout]


# --8<-- [start:train]
def train(layout, steps=3, sequence_parallel=False):
    mesh, model, loss = build(layout, sequence_parallel)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))  # inherits the specs

    @eqx.filter_jit
    def step(model, opt_state, x, t):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, t)  # no gradient sync
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (B, S, D))
    t = jnp.sin(2 * x)  # something to fit
    compiled = step.lower(model, opt_state, x, t).compile()  # compiled once, ahead of time
    ops = [op for op in read_collectives(compiled) if op.group_size > 1]
    losses = []
    for _ in range(steps):
        model, opt_state, value = compiled(model, opt_state, x, t)
        losses.append(float(value))
    per_device = sum(row.bytes_per_device for row in es.param_table(model, mesh))
    return losses, per_device, ops


LAYOUTS = [  # (name, layout, sequence parallel)
    ("one device", "dp=1", False),
    ("data parallel", "dp=8", False),
    ("FSDP", "fsdp=8", False),
    ("tensor parallel", "tp=8", False),
    ("sequence parallel", "dp=2,tp=4", True),
    ("FSDP + TP", "fsdp=4,tp=2", False),
    ("DP + FSDP + TP", "dp=2,fsdp=2,tp=2", False),
]
for name, layout, sp in LAYOUTS:
    losses, per_device, ops = train(layout, sequence_parallel=sp)
    kinds = ", ".join(sorted({op.kind for op in ops})) or "none"
    sent = sum(op.total_bytes for op in ops) / 1024
    print(f"{name:17s} {layout:16s} losses {' '.join(f'{v:.6f}' for v in losses)}  "
          f"params {per_device / 1024:5.1f} KiB/device  sends {sent:6.1f} KiB/device ({kinds})")
# --8<-- [end:train]
