"""Mixture of experts with expert parallelism: routing, capacity, drops, dense and ragged
dispatch.

The code of the guide `docs/guides/moe.md`. Run it on a laptop CPU:

    python docs/examples/moe.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import capacity_mask, expert_capacity, top_k_router
from equishard.report import collective_bytes, count_collectives, read_collectives

# --8<-- [end:setup]

# --8<-- [start:capacity]
# Slots per expert per group: ceil(group_tokens * top_k / num_experts * capacity_factor)
for factor in (1.0, 1.25, 2.0, 4.0):
    print(f"capacity_factor {factor}: {expert_capacity(16, 2, 8, factor)} slots per expert")
# --8<-- [end:capacity]

# --8<-- [start:drops]
# One group of 6 tokens, top-1 routing over 4 experts; every token wants expert 0.
logits = jnp.array([[2.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [2.5, 0.0, 0.0, 0.0],
                    [1.0, 0.0, 0.0, 0.0], [2.5, 0.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]])
weights, experts = top_k_router(logits, 1, softmax_over="all")  # f32[6, 1], i32[6, 1]
keep, slot = capacity_mask(experts[None], weights[None], num_experts=4, capacity=3)
print("expert of each token:", experts[:, 0].tolist())
print("kept (capacity 3):   ", keep[0, :, 0].astype(int).tolist())
print("slot in the buffer:  ", slot[0, :, 0].tolist())
# --8<-- [end:drops]

# --8<-- [start:layer]
D, F, E, K = 32, 64, 8, 2  # width, expert hidden width, experts, experts per token
B, S, GROUP = 4, 32, 8  # batch, sequence, tokens per routing group


def make_moe(data_axis_name=None, dispatch="dense"):
    return es.nn.MoE(
        D, F, E, K,
        capacity_factor=1.25,  # capacity 3 per group of 8 tokens: some assignments drop
        group_size=GROUP,
        data_axis_name=data_axis_name,
        dispatch=dispatch,
        key=jax.random.key(0),
    )  # fmt: skip


moe = make_moe()
print(f"experts: w_in {moe.w_in.global_shape} spec {moe.w_in.spec}, capacity {moe.capacity}, "
      f"dispatch {moe.dispatch!r}")
x = jax.random.normal(jax.random.key(1), (B, S, D))

# One device holding every expert: the reference.
y_single, aux_single = eqx.filter_jit(moe)(x)
print(f"one device:  dropped {int(aux_single.dropped)} of {B * S * K} assignments, "
      f"load-balancing loss {float(aux_single.load_balancing_loss):.5f}")
# --8<-- [end:layer]

# --8<-- [start:parallel]
mesh = es.make_mesh("dp=2,ep=4")  # batch over "dp", experts (and sequence) over "ep"
tokens = P("dp", "ep", None)  # [batch, seq, hidden]: each ep device routes its own slice


def run(moe, x):
    return es.filter_shard_map(
        lambda moe, x: moe(x), mesh=mesh, in_specs=(None, tokens), out_specs=(tokens, P())
    )(moe, x)


results = {}
for dispatch in ("dense", "ragged"):
    moe = es.shard(make_moe(data_axis_name="dp", dispatch=dispatch), mesh)
    y, aux = eqx.filter_jit(run)(moe, x)
    err = float(jnp.linalg.norm(y - y_single) / jnp.linalg.norm(y_single))
    results[dispatch] = y
    print(f"dp=2,ep=4 {dispatch:6s}: dropped {int(aux.dropped)}, load-balancing loss "
          f"{float(aux.load_balancing_loss):.5f}, output equal to one device: {err < 1e-5}")
print("expert load:", aux.expert_load.tolist())
# --8<-- [end:parallel]

# --8<-- [start:bytes]
moe = es.shard(make_moe(data_axis_name="dp"), mesh)
ops = read_collectives(eqx.filter_jit(run).lower(moe, x).compile())
a2a = [op for op in ops if op.kind == "all-to-all"]
print("all-to-alls:", count_collectives(a2a), f"{collective_bytes(a2a) / 1024:.1f} KiB per device")
# --8<-- [end:bytes]
