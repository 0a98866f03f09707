"""Long sequences: blockwise attention, ring and all-to-all context parallelism, the
zigzag split.

The code of the guide `docs/guides/long-sequences.md`. Run it on a laptop CPU:

    python docs/examples/long_sequences.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    alltoall_attention,
    blockwise_attention,
    dense_attention,
    ring_attention,
    ring_attention_block_pairs,
    zigzag_indices,
    zigzag_permute,
    zigzag_unpermute,
)
from equishard.report import count_collectives, memory_stats, read_collectives


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def qkv(seq, heads=8, kv_heads=2, head_dim=16, seed=0):
    """Queries [1, seq, heads, head_dim]; keys and values with fewer (grouped) heads."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (1, seq, heads, head_dim)),
        jax.random.normal(kk, (1, seq, kv_heads, head_dim)),
        jax.random.normal(kv, (1, seq, kv_heads, head_dim)),
    )
# --8<-- [end:setup]


# --8<-- [start:blockwise]
def temporaries(kernel, seq):
    """Per-device temporaries of a compiled forward+backward program (compiled, not run)."""

    def loss(q, k, v):
        return jnp.sum(kernel(q, k, v)[0] ** 2)

    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(seq))
    stats = memory_stats(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile())
    assert stats is not None, "this backend reports no memory"
    return stats.temp_bytes


for seq in (2048, 4096, 8192):
    dense, blockwise = temporaries(dense_attention, seq), temporaries(blockwise_attention, seq)
    print(f"S={seq:5d}  dense {dense / 2**20:7.1f} MiB   blockwise {blockwise / 2**20:5.1f} MiB")

q, k, v = qkv(1024)
print("blockwise vs dense, relative error:", f"{rel_err(blockwise_attention(q, k, v)[0], dense_attention(q, k, v)[0]):.1e}")
# --8<-- [end:blockwise]


# --8<-- [start:context]
mesh = es.make_mesh("cp=4")
seq_spec = P(None, "cp", None, None)  # [batch, sequence / cp, heads, head_dim]


def context_parallel(attend):
    """Jitted attention over a sequence split over cp; `attend` sees this device's block."""
    return jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(seq_spec,) * 3, out_specs=seq_spec))


ring = context_parallel(lambda q, k, v: ring_attention(q, k, v, "cp"))
zigzag = context_parallel(lambda q, k, v: ring_attention(q, k, v, "cp", layout="zigzag"))
ulysses = context_parallel(lambda q, k, v: alltoall_attention(q, k, v, "cp"))

q, k, v = qkv(256)
want = dense_attention(q, k, v)[0]  # one device, the whole sequence
zz = lambda x: zigzag_permute(x, 4, axis=1)  # tokens (and positions, labels) reordered alike
results = {
    "ring, contiguous": ring(q, k, v),
    "ring, zigzag": zigzag_unpermute(zigzag(zz(q), zz(k), zz(v)), 4, axis=1),
    "all-to-all": ulysses(q, k, v),
}
for name, got in results.items():
    print(f"{name:17s} relative error {rel_err(got, want):.1e}")
for name, fn in (("ring", ring), ("all-to-all", ulysses)):
    print(f"{name:10s} collectives: {count_collectives(read_collectives(fn.lower(q, k, v).compile()))}")
# --8<-- [end:context]


# --8<-- [start:zigzag]
print("tokens per device (zigzag, S=16, cp=4):", zigzag_indices(16, 4).reshape(4, 4).tolist())

mesh8 = es.make_mesh("cp=8")
q, k, v = qkv(512)
for layout in ("contiguous", "zigzag"):
    count = jax.shard_map(
        lambda q, k, v, layout=layout: ring_attention_block_pairs(q, k, v, "cp", layout=layout, block_size=8)[None],
        mesh=mesh8, in_specs=(seq_spec,) * 3, out_specs=P("cp"),
    )  # fmt: skip
    pairs = np.asarray(jax.jit(count)(q, k, v))
    print(f"{layout:10s} block pairs per device {pairs.tolist()}  max/min {pairs.max() / pairs.min():.2f}")
# --8<-- [end:zigzag]
