"""The collectives: ring shift, all-gather, reduce-scatter, all-reduce, all-to-all, and
the collective matmuls, with what each costs in bytes per device.

The code of the guide `docs/guides/collectives.md`. Run it on a laptop CPU:

    python docs/examples/collectives.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    all_gather_matmul,
    matmul_reduce_scatter,
    ring_all_gather,
    ring_reduce_scatter,
    ring_shift,
)
from equishard.report import collective_bytes, count_collectives, read_collectives


def local(fn, mesh, in_specs, out_specs):
    """A jitted shard_map: `fn` sees each device's block."""
    return jax.jit(es.filter_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
# --8<-- [end:setup]


# --8<-- [start:ring]
mesh = es.make_mesh("dp=4,tp=2")
ring = P(("tp", "dp"))  # one combined axis of 8 devices, in the order ("tp", "dp")
x = jnp.arange(8.0)  # device k of the combined axis holds the value k

shifted = local(lambda v: ring_shift(v, ("tp", "dp"), 1), mesh, ring, ring)(x)
print("ring_shift     ", shifted.astype(int).tolist())


def naive(v):  # the textbook permutation, axes in mesh order (JAX >= 0.12 insists)
    return jax.lax.ppermute(v, ("dp", "tp"), [(i, (i + 1) % 8) for i in range(8)])


print("naive ppermute ", local(naive, mesh, ring, ring)(x).astype(int).tolist())
# --8<-- [end:ring]

# --8<-- [start:collectives]
mesh = es.make_mesh("x=8")
n = 8
block = jnp.arange(n * 8 * 256, dtype=jnp.float32).reshape(n * 8, 256)  # f32[64, 256]


def gather(b):  # f32[8, 256] -> f32[64, 256], the same on every device
    return jax.lax.all_gather(b, "x", tiled=True, to="invarying")


def scatter(b):  # f32[64, 256] (a partial sum on each device) -> f32[8, 256]
    return jax.lax.psum_scatter(b, "x", tiled=True)


def reduce(b):  # f32[8, 256] -> f32[8, 256], summed over the devices
    return jax.lax.psum(b, "x")


def exchange(b):  # f32[8, 256] -> f32[8, 256]: row j goes to device j
    return jax.lax.all_to_all(b, "x", 0, 0, tiled=True)


programs = {
    "all-gather": local(gather, mesh, P("x"), P()),
    "reduce-scatter": local(scatter, mesh, P(), P("x")),
    "all-reduce": local(reduce, mesh, P("x"), P("x")),
    "all-to-all": local(exchange, mesh, P("x"), P("x")),
    "collective-permute": local(lambda b: ring_shift(b, "x"), mesh, P("x"), P("x")),
}
local_block = 8 * 256 * 4  # one device's f32[8, 256] block: 8 KiB
for name, program in programs.items():
    ops = read_collectives(program.lower(block).compile())
    sent = collective_bytes(ops)  # bytes each device sends, under ring algorithms
    print(f"{name:18s} sends {sent / local_block:.3f} x its block")
# --8<-- [end:collectives]

# --8<-- [start:ring_versions]
def gathers_agree(b):  # on each device: the ring's result against JAX's all_gather
    plain = jax.lax.all_gather(b, "x", tiled=True)
    ring_blocks = ring_all_gather(b, "x")  # n - 1 collective-permutes; blocks in device order
    return jnp.array_equal(plain, jnp.concatenate(ring_blocks))[None]


agree = local(gathers_agree, mesh, P("x"), P("x"))(block)
print("ring all-gather equals all_gather on every device:", bool(agree.all()))


def scatters_agree(b):  # b: this device's f32[64, 256] of partial sums
    plain = jax.lax.psum_scatter(b, "x", tiled=True)
    ring_sum = ring_reduce_scatter(jnp.split(b, n), "x")  # one partial per destination device
    # Sums in another order: equal to float32 rounding (DESIGN's relative tolerance).
    return (jnp.linalg.norm(ring_sum - plain) <= 1e-5 * jnp.linalg.norm(plain))[None]


partials = jax.random.normal(jax.random.key(0), (n * 64, 256))  # each device its partials
agree = local(scatters_agree, mesh, P("x"), P("x"))(partials)
print("ring reduce-scatter equals psum_scatter on every device:", bool(agree.all()))
ring_scatter = local(lambda b: ring_reduce_scatter(jnp.split(b, n), "x"), mesh, P("x"), P("x"))
print("ring reduce-scatter compiles to", count_collectives(read_collectives(ring_scatter.lower(partials).compile())))
# --8<-- [end:ring_versions]

# --8<-- [start:matmul]
kx, kw = jax.random.split(jax.random.key(0))
xg = jax.random.normal(kx, (64, 512))  # global x: f32[B, K], batch split over "x"
wg = jax.random.normal(kw, (512, 128))  # global w: f32[K, N], rows split over "x" (FSDP)


def plain_fsdp(x, w):  # f32[B/n, K] @ all_gather(f32[K/n, N]) -> f32[B/n, N]
    return x @ jax.lax.all_gather(w, "x", tiled=True)


def overlapped_fsdp(x, w):  # the same product in n ring steps
    return all_gather_matmul(x, w, "x", gathered="w")


results = {}
for name, fn in (("all_gather + matmul", plain_fsdp), ("all_gather_matmul", overlapped_fsdp)):
    program = local(fn, mesh, (P("x"), P("x")), P("x"))
    results[name] = program(xg, wg)
    print(f"{name:20s} {count_collectives(read_collectives(program.lower(xg, wg).compile()))}")
err = jnp.linalg.norm(results["all_gather_matmul"] - xg @ wg) / jnp.linalg.norm(xg @ wg)
print(f"all_gather_matmul equals x @ w: {bool(err < 1e-5)}")

x_tp = jax.random.normal(kx, (64, 512))  # f32[B, K], K split over "x" (row parallel)
rs = local(lambda x, w: matmul_reduce_scatter(x, w, "x"), mesh, (P(None, "x"), P("x")), P("x"))
out = rs(x_tp, wg)  # psum_scatter(x @ w): each device its rows of the summed product
err = jnp.linalg.norm(out - x_tp @ wg) / jnp.linalg.norm(x_tp @ wg)
print(f"matmul_reduce_scatter equals x @ w: {bool(err < 1e-5)}")
print("matmul_reduce_scatter compiles to", count_collectives(read_collectives(rs.lower(x_tp, wg).compile())))
# --8<-- [end:matmul]
