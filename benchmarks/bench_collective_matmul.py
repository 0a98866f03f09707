"""Collective matmuls against their plain counterparts: time, ratio, collectives.

For each of

- `all_gather_matmul(x, w, gathered="x")` vs `all_gather(x) @ w`,
- `all_gather_matmul(x, w, gathered="w")` vs `x @ all_gather(w)` (the FSDP forward),
- `matmul_reduce_scatter(x, w)` vs `psum_scatter(x @ w)`,

one-directional and bidirectional, the script compiles both programs over one mesh axis
of all the devices, checks that they agree, and prints the median time of each, the
ratio overlapped / plain (below 1: the ring is faster), and the collectives each
compiled program runs (read by `equishard.report.read_collectives`).

    python benchmarks/bench_collective_matmul.py [--rows 2048 --k 2048 --cols 2048] [--grad]

On a machine without an accelerator it simulates 8 CPU devices. XLA:CPU runs
collectives synchronously, one after the other, so there the ring versions can only
show their overhead (more, smaller collectives and matmuls), not overlap. On a GPU or
TPU the script runs unchanged on the real devices (all of them form the axis; with a
single device every collective is trivial and the ratios are only the cost of the
extra bookkeeping). XLA's latency-hiding scheduler decides the overlap there.
"""

from __future__ import annotations

import argparse

from _common import median_time, use_simulated_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="global rows of x (default 1024 on CPU, 8192 else)")
    parser.add_argument("--k", type=int, default=None, help="contracting dimension (default 1024 / 8192)")
    parser.add_argument("--cols", type=int, default=None, help="columns of w (default 1024 / 8192)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--grad", action="store_true", help="time value and gradient, not the forward alone")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import equishard as es
    from equishard.core import all_gather_matmul, matmul_reduce_scatter
    from equishard.report import count_collectives, read_collectives

    backend = jax.default_backend()
    n = jax.device_count()
    big = backend != "cpu"
    rows = args.rows or (8192 if big else 1024)
    k = args.k or (8192 if big else 1024)
    cols = args.cols or (8192 if big else 1024)
    for name, size in (("rows", rows), ("k", k)):
        if size % (2 * n):
            raise SystemExit(f"--{name} {size} must be divisible by 2n = {2 * n} (bidirectional halves)")
    dtype = jnp.dtype(args.dtype)
    mesh = es.make_mesh(f"x={n}")
    ax = "x"

    # name -> (overlapped, plain, x spec, w spec, out spec, x shape, w shape)
    cases = {
        "gather x  @ w": (
            lambda bi: lambda x, w: all_gather_matmul(x, w, ax, gathered="x", bidirectional=bi),
            lambda x, w: jax.lax.all_gather(x, ax, axis=0, tiled=True) @ w,
            P(ax), P(), P(ax), (rows, k), (k, cols),
        ),  # f32[M/n, K] @ f32[K, N] -> f32[M, N] on each device
        "x @ gather w": (
            lambda bi: lambda x, w: all_gather_matmul(x, w, ax, gathered="w", bidirectional=bi),
            lambda x, w: x @ jax.lax.all_gather(w, ax, axis=0, tiled=True),
            P(ax), P(ax), P(ax), (rows, k), (k, cols),
        ),  # f32[M/n, K] @ f32[K/n, N] (gathered) -> f32[M/n, N]
        "scatter(x @ w)": (
            lambda bi: lambda x, w: matmul_reduce_scatter(x, w, ax, bidirectional=bi),
            lambda x, w: jax.lax.psum_scatter(x @ w, ax, scatter_dimension=0, tiled=True),
            P(None, ax), P(ax), P(ax), (rows, k), (k, cols),
        ),  # f32[M, K/n] @ f32[K/n, N] -> partial f32[M, N] -> f32[M/n, N]
    }

    def program(fn, in_specs, out_spec):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        if not args.grad:
            return jax.jit(sharded)
        loss = lambda x, w: jnp.sum(sharded(x, w).astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def describe(compiled) -> str:
        counts = count_collectives(read_collectives(compiled))
        return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"

    print(f"backend {backend}, {n} devices on axis {ax!r}; x [{rows}, {k}], w [{k}, {cols}], {dtype.name}"
          f"{', value and gradient' if args.grad else ', forward'}")
    if backend == "cpu":
        print("XLA:CPU runs collectives synchronously: the ratios show the rings' overhead, not overlap.")
    header = f"{'operation':<16}{'ring':<15}{'plain ms':>10}{'ring ms':>10}{'ratio':>8}  collectives (ring | plain)"
    print(header)
    print("-" * len(header))
    key_x, key_w = jax.random.split(jax.random.key(0))
    for name, (overlapped, plain, x_spec, w_spec, out_spec, x_shape, w_shape) in cases.items():
        x = jax.device_put(jax.random.normal(key_x, x_shape, dtype), NamedSharding(mesh, x_spec))
        w = jax.device_put(jax.random.normal(key_w, w_shape, dtype), NamedSharding(mesh, w_spec))
        plain_fn = program(plain, (x_spec, w_spec), out_spec).lower(x, w).compile()
        reference = plain_fn(x, w)
        plain_s = median_time(lambda: plain_fn(x, w), repeats=args.repeats)
        for label, bidirectional in (("one direction", False), ("bidirectional", True)):
            ring_fn = program(overlapped(bidirectional), (x_spec, w_spec), out_spec).lower(x, w).compile()
            got = ring_fn(x, w)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
                if err > (1e-2 if dtype == jnp.bfloat16 else 1e-4):
                    raise SystemExit(f"{name} ({label}) differs from the plain version: relative error {err:.2e}")
            ring_s = median_time(lambda: ring_fn(x, w), repeats=args.repeats)
            print(f"{name:<16}{label:<15}{plain_s * 1e3:>10.2f}{ring_s * 1e3:>10.2f}{ring_s / plain_s:>8.2f}  "
                  f"{describe(ring_fn)} | {describe(plain_fn)}")


if __name__ == "__main__":
    main()
