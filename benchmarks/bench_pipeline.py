"""Benchmark of `equishard.nn.PipelineModule`: GPipe against the circular schedule.

For each schedule at `pp` stages (4 by default) it compiles one forward+backward step of
a stack of transformer blocks (the global loss of equishard's gradient convention, made
global over the stage axis by `equishard.core.from_last_stage`), times it, and prints:

- the schedule report (`equishard.core.schedule_report`): steps, bubble fraction read
  off the schedule (in SPMD every device computes at every step, so the bubble is not
  measured), and the activation memory each device keeps for the backward pass,
  estimated as `steps × layers per stage × one layer's residuals for one micro-batch`;
- what the compiled program says: its temporary memory per device
  (`memory_analysis`) and the collective-permute bytes each device sends
  (`equishard.report.read_collectives`);
- the measured step time (median over `--steps` runs after one warm-up).

On the CPU it simulates 8 devices (`jax_num_cpu_devices=8`, set only there); on a GPU or
TPU host it uses the real devices (`pp` is capped at the number of devices).

    python benchmarks/bench_pipeline.py [--pp 4] [--layers 8] [--microbatches 4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax  # noqa: E402
from _common import use_simulated_cpu_devices

use_simulated_cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import equishard as es  # noqa: E402
from equishard.core import from_last_stage, pipeline_schedule, schedule_report
from equishard.nn import PipelineModule  # noqa: E402
from equishard.report import collective_bytes, read_collectives


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    norm = jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    return x * norm * scale[None, None, :]


class Block(eqx.Module):
    """Pre-norm transformer block: causal multi-head attention and a GELU MLP."""

    ln1: jax.Array
    wqkv: jax.Array
    wo: jax.Array
    ln2: jax.Array
    w1: jax.Array
    w2: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1 = jnp.ones((width,))
        self.ln2 = jnp.ones((width,))
        self.wqkv = jax.random.normal(k1, (width, 3 * width)) / width**0.5
        self.wo = jax.random.normal(k2, (width, width)) / width**0.5
        self.w1 = jax.random.normal(k3, (width, 4 * width)) / width**0.5
        self.w2 = jax.random.normal(k4, (4 * width, width)) / (4 * width) ** 0.5
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = _rms(x, self.ln1)
        q, k, v = jnp.split(h @ self.wqkv, 3, axis=-1)  # f32[b, T, D] each
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / (d // self.heads) ** 0.5
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d) @ self.wo
        return x + jax.nn.gelu(_rms(x, self.ln2) @ self.w1) @ self.w2


def _layer_activation_bytes(args: argparse.Namespace, microbatch: int) -> int:
    """Bytes one layer keeps for its backward pass on one micro-batch.

    The residuals of a `jax.vjp` of one block with respect to its input and weights,
    less the weights themselves (they are parameters, not activations).
    """
    block = Block(args.width, args.heads, key=jax.random.key(0))
    x = jnp.zeros((microbatch, args.seq, args.width))
    _, vjp = jax.vjp(lambda blk, h: blk(h), block, x)
    params = sum(a.nbytes for a in jax.tree.leaves(eqx.filter(block, eqx.is_array)))
    saved = sum(a.nbytes for a in jax.tree.leaves(vjp) if hasattr(a, "nbytes"))
    return max(saved - params, 0)


def _step(mesh: jax.sharding.Mesh, pipe: PipelineModule):
    def step(pipe, x):
        def loss_fn(pipe):
            y = pipe(x)  # f32[B, T, D] on the last stage, zeros elsewhere
            return from_last_stage(jnp.mean(y**2), "pp")

        return eqx.filter_value_and_grad(loss_fn)(pipe)

    fn = es.filter_shard_map(step, mesh=mesh, in_specs=(None, P()), out_specs=(P(), es.specs_of(pipe)))
    return jax.jit(fn)


def bench(pp: int, microbatches: int, repeats: int, args: argparse.Namespace) -> list[str]:
    devices = jax.devices()[:pp]
    mesh = jax.sharding.Mesh(devices, ("pp",))
    key = jax.random.key(0)
    make = lambda k: PipelineModule(  # noqa: E731
        lambda kk: Block(args.width, args.heads, key=kk),
        "pp",
        microbatches,
        num_layers=args.layers,
        num_stages=pp,
        repeats=repeats,
        key=k,
    )
    pipe = es.sharded_init(make, key, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.width))

    step = _step(mesh, pipe)
    compiled = step.lower(pipe, x).compile()
    ops = read_collectives(compiled)
    permute_bytes = collective_bytes(ops, "collective-permute")
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None

    jax.block_until_ready(compiled(pipe, x))  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(pipe, x))
        times.append(time.perf_counter() - start)

    layer_bytes = _layer_activation_bytes(args, args.batch // microbatches)
    report = schedule_report(
        pipeline_schedule(pp, microbatches, repeats),
        num_layers=args.layers,
        layer_activation_bytes=layer_bytes,
    )
    temp_text = "n/a" if temp is None else f"{temp / 2**20:.2f} MiB"
    return [
        f"  {report}",
        f"    compiled: temp memory/device {temp_text}, collective-permute "
        f"{permute_bytes / 2**20:.2f} MiB/device; step time "
        f"{1e3 * statistics.median(times):.1f} ms (median of {args.steps})",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="GPipe vs circular pipeline: step time and schedule report.")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="repeats of the circular schedule")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    pp = min(args.pp, jax.device_count())
    print(
        f"{jax.devices()[0].platform} × {jax.device_count()} devices; pp={pp}; "
        f"{args.layers} blocks of width {args.width}, batch {args.batch} × {args.seq} tokens"
    )
    for m in (int(v) for v in args.microbatches.split(",")):
        for repeats in (1, args.repeats):
            if repeats > 1 and m % pp:
                print(f"  circular R={repeats} skipped for M={m}: M must be a multiple of pp={pp}")
                continue
            for line in bench(pp, m, repeats, args):
                print(line)


if __name__ == "__main__":
    main()
