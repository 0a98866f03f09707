"""Benchmark of `equishard.nn.MoE`: tokens/s and all-to-all bytes for ep = 1, 2, 4, 8.

For each expert-axis size it compiles one forward+backward step of the layer (the
global loss of the equishard gradient convention), times it, and reads the compiled
program with `equishard.report.read_collectives`: the all-to-all bytes each device sends
(`all-to-all` and `ragged-all-to-all`) against the minimum for the capacity buffers,
`4 · (n − 1)/n · E·G·C·D·itemsize` (dispatch and combine, forward and backward; `G`
the token groups per device, `C` the capacity).

On the CPU it simulates 8 devices (`jax_num_cpu_devices=8`, set only there); on a GPU or
TPU host it uses the real devices, runs the sizes that fit, and `dispatch="auto"` takes
the ragged path with the native `ragged_all_to_all` (the reader bounds its bytes by the
send buffer, so its "bytes" column is an upper bound there).

    python benchmarks/bench_moe.py [--dispatch auto|dense|ragged] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax  # noqa: E402
from _common import use_simulated_cpu_devices

use_simulated_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import equishard as es  # noqa: E402
from equishard.nn import MoE  # noqa: E402
from equishard.report import collective_bytes, count_collectives, read_collectives  # noqa: E402


def _step(model: MoE, x: jax.Array, c: jax.Array, mesh: jax.sharding.Mesh):
    tokens = P(None, "ep", None)

    def loss(model, x, c):
        y, aux = model(x)
        local = jax.lax.pmean(jnp.mean(y * c), "ep")
        return local + 0.01 * aux.load_balancing_loss + 0.001 * aux.z_loss

    def step(model, x, c):
        # Gradients for the weights and the input, as inside a network: the input's
        # gradient is what runs the dispatch all-to-all backwards.
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(model, x, c)
        return value, grads

    out_specs = (P(), (es.specs_of(model), tokens))
    fn = es.filter_shard_map(step, mesh=mesh, in_specs=(None, tokens, tokens), out_specs=out_specs)
    return jax.jit(fn)


def bench(ep: int, args: argparse.Namespace) -> str:
    mesh = es.make_mesh(f"ep={ep}")
    key = jax.random.key(0)
    model = es.sharded_init(
        lambda k: MoE(
            args.hidden,
            args.ffn,
            args.experts,
            args.top_k,
            capacity_factor=args.capacity_factor,
            group_size=args.group_size,
            dispatch=args.dispatch,
            key=k,
        ),
        key,
        mesh=mesh,
    )
    kx, kc = jax.random.split(jax.random.key(1))
    shape = (args.batch, args.seq, args.hidden)
    x = jax.random.normal(kx, shape)
    c = jax.random.normal(kc, shape)
    x, c = jax.device_put((x, c), NamedSharding(mesh, P(None, "ep")))

    step = _step(model, x, c, mesh)
    compiled = step.lower(model, x, c).compile()
    ops = read_collectives(compiled)
    moved = collective_bytes(ops, ("all-to-all", "ragged-all-to-all"))
    groups = args.batch * (args.seq // ep) // args.group_size
    buffer = args.experts * groups * model.capacity * args.hidden * jnp.dtype(x.dtype).itemsize
    minimum = 4 * (ep - 1) / ep * buffer

    jax.block_until_ready(step(model, x, c))  # warm up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(step(model, x, c))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens_per_s = args.batch * args.seq / seconds
    counts = ", ".join(f"{k}×{v}" for k, v in sorted(count_collectives(ops).items())) or "none"
    ratio = f"{moved / minimum:5.2f}" if minimum else "    -"
    return (
        f"{ep:>3} {model.dispatch + '/' + model.ragged_impl if model.dispatch == 'ragged' else model.dispatch:>16} "
        f"{tokens_per_s:>12,.0f} {seconds * 1e3:>9.2f} {moved / 2**20:>11.3f} "
        f"{minimum / 2**20:>11.3f} {ratio:>6}   {counts}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatch", default="auto", choices=("auto", "dense", "ragged"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    devices = jax.devices()
    print(
        f"MoE forward+backward: batch {args.batch} x seq {args.seq}, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, groups of "
        f"{args.group_size}, capacity factor {args.capacity_factor}; "
        f"{len(devices)} {devices[0].platform} devices ({devices[0].device_kind})"
    )
    print(
        f"{'ep':>3} {'dispatch':>16} {'tokens/s':>12} {'ms/step':>9} {'a2a MiB/dev':>11} "
        f"{'min MiB/dev':>11} {'ratio':>6}   collectives (count in the program)"
    )
    for ep in (1, 2, 4, 8):
        if ep > len(devices):
            print(f"{ep:>3} skipped: only {len(devices)} devices")
            continue
        print(bench(ep, args), flush=True)


if __name__ == "__main__":
    main()
