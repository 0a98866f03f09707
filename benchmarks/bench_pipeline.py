"""Benchmark of `equishard.nn.PipelineModule`'s five schedules: activation memory and bubble.

For each schedule at `pp` stages (4 by default) and a fixed micro-batch size, it compiles
one forward+backward program of a stack of transformer blocks and a head (the pipeline
alone: `PipelineModule.loss`, differentiated in the blocks and the head, not in the
input) for several micro-batch counts `M`, and prints per device:

- `temp`: the compiled program's temporaries (`memory_analysis().temp_size_in_bytes`);
- `activations`: the part of the temporaries that grows with the micro-batch, measured
  as `temp(2 b) − temp(b)` for micro-batch size `b` (parameter-sized buffers — the
  gradients' accumulators, the parameters' copies — do not depend on `b` and cancel);
- the schedule's bubble fraction and peak in-flight micro-batches, read off its table
  (`equishard.core.schedule_report`; the CPU cannot show a schedule's time, so the
  bubble is not measured).

Results go to `benchmarks/results/pipeline.json`; `--markdown` prints the table that
`benchmarks/RESULTS.md` shows.

    python benchmarks/bench_pipeline.py [--pp 4] [--microbatches 8,16,32] [--schedules 1f1b,gpipe]
    python benchmarks/bench_pipeline.py --bytes   # the GPT's bytes, pp=2,dp=2,tp=2, M=8, 1F1B
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax  # noqa: E402
from _common import use_simulated_cpu_devices

use_simulated_cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import equishard as es  # noqa: E402
from equishard.core import pipeline_schedule, schedule_report  # noqa: E402
from equishard.nn import PipelineModule  # noqa: E402
from equishard.report._hlo import compiled_program  # noqa: E402


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


SCHEDULES_ALL = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
import os

SCHEDULES = tuple(s for s in SCHEDULES_ALL if s[0] in os.environ.get("ONLY", "gpipe circular 1f1b interleaved-1f1b zb-h1").split())


def _head(w: jax.Array, y: jax.Array, t: jax.Array) -> jax.Array:
    # f32[b, T, D] @ f32[D] -> f32[b, T]: a regression head and its loss.
    return jnp.mean((y @ w - t) ** 2)


def temp_bytes(args: argparse.Namespace, schedule: str, repeats: int, m: int, b: int) -> int:
    """Temporaries per device of one forward+backward program of the pipeline."""
    pp = args.pp
    mesh = jax.sharding.Mesh(jax.devices()[:pp], ("pp",))
    make = lambda k: PipelineModule(  # noqa: E731
        lambda kk: Block(args.width, args.heads, key=kk), "pp", m,
        num_layers=args.layers, num_stages=pp, repeats=repeats, schedule=schedule, key=k,
    )  # fmt: skip
    pipe = es.sharded_init(make, jax.random.key(0), mesh=mesh)
    x = jnp.zeros((m * b, args.seq, args.width))
    t = jnp.zeros((m * b, args.seq))
    w = jnp.zeros((args.width,))

    def step(pipe, w, x, t):
        def loss_fn(pipe, w):
            return pipe.loss(x, t, first=lambda _, h: h, last=_head, last_params=w)

        return eqx.filter_value_and_grad(loss_fn)(pipe, w)

    specs = es.specs_of(pipe)
    fn = es.filter_shard_map(step, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), specs))
    compiled = eqx.filter_jit(fn).lower(pipe, w, x, t).compile()
    return int(compiled_program(compiled).memory_analysis().temp_size_in_bytes)


def bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    for schedule, repeats in SCHEDULES:
        if schedule not in args.schedules:
            continue
        for m in args.microbatches:
            if repeats > 1 and m % args.pp:
                continue
            small = temp_bytes(args, schedule, repeats, m, args.microbatch)
            large = temp_bytes(args, schedule, repeats, m, 2 * args.microbatch)
            report = schedule_report(pipeline_schedule(schedule, args.pp, m, repeats=repeats))
            row = {
                "schedule": schedule, "repeats": repeats, "microbatches": m,
                "temp_bytes": small, "activation_bytes": large - small,
                "bubble_fraction": report.bubble_fraction,
                "peak_in_flight": list(report.peak_in_flight),
            }  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return rows


def gpt_bytes(schedule: str, spec: str = "pp=2,dp=2,tp=2", microbatches: int = 8) -> dict:
    """Bytes per device of the reference GPT's train step (`bench_layouts.py`'s model)
    under a pipeline schedule, read with the schedule's weights, against the textbook."""
    import numpy as np
    from bench_layouts import BATCH, SEQ, _config, equishard_side

    from equishard.core import schedule_weights
    from equishard.models import gpt_minimum
    from equishard.report import collective_bytes, read_collectives
    from equishard.sharding import Layout, param_table

    config = _config(False)
    layout = Layout(spec, num_microbatches=microbatches, pipeline_schedule=schedule)
    batch = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ + 1), dtype=np.int32)
    side = equishard_side(config, layout, batch)
    par = layout.resolve()
    table = pipeline_schedule(schedule, par.num_stages, microbatches, repeats=par.pipeline_repeats)
    per_device = []
    for device in range(par.num_stages):
        ops = read_collectives(side["compiled"], weights=schedule_weights(table, device))
        per_device.append(collective_bytes(ops))
    unweighted = collective_bytes(read_collectives(side["compiled"]))
    rows = param_table(side["state"].model, side["mesh"])
    ideal = gpt_minimum(config, layout, batch_size=BATCH, seq_len=SEQ, rows=rows).ideal_total
    return {
        "layout": spec, "schedule": schedule, "microbatches": microbatches,
        "bytes_per_stage_device": per_device, "unweighted_bytes": unweighted,
        "ideal_bytes": ideal, "over_ideal": max(per_device) / ideal,
    }  # fmt: skip


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    ref = {r["microbatches"]: r["activation_bytes"] for r in rows if r["schedule"] == "gpipe"}
    lines = [
        "| schedule | M | temp MiB | activations MiB | / GPipe's | bubble | peak in flight |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = r["schedule"] + (f" R={r['repeats']}" if r["repeats"] > 1 else "")
        gpipe = ref.get(r["microbatches"])
        ratio = f"{r['activation_bytes'] / gpipe:.3f}" if gpipe else "–"
        lines.append(
            f"| {name} | {r['microbatches']} | {r['temp_bytes'] / 2**20:.2f} | "
            f"{r['activation_bytes'] / 2**20:.2f} | {ratio} | {r['bubble_fraction']:.3f} | "
            f"{r['peak_in_flight']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Pipeline schedules: activation memory and bubble.")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=2, help="examples per micro-batch, b")
    parser.add_argument("--microbatches", default="8,16,32", help="comma-separated micro-batch counts")
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES), help="comma-separated schedules")
    parser.add_argument("--markdown", action="store_true", help="print the RESULTS.md table")
    parser.add_argument("--no-write", dest="write", action="store_false")
    parser.add_argument("--bytes", action="store_true", help="only the GPT's bytes on pp=2,dp=2,tp=2, M=8, 1F1B")
    args = parser.parse_args()
    out = pathlib.Path(__file__).parent / "results" / "pipeline.json"
    if args.bytes:
        result = gpt_bytes("1f1b")
        print(result)
        if args.write and out.exists():
            saved = json.loads(out.read_text())
            out.write_text(json.dumps({**saved, "gpt_bytes": result}, indent=1) + "\n")
        return
    args.microbatches = [int(v) for v in args.microbatches.split(",")]
    args.schedules = args.schedules.split(",")
    args.pp = min(args.pp, jax.device_count())
    print(
        f"{jax.devices()[0].platform} x {jax.device_count()} devices; pp={args.pp}; "
        f"{args.layers} blocks of width {args.width}, micro-batches of {args.microbatch} x "
        f"{args.seq} tokens"
    )
    rows = bench(args)
    if args.write:
        out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    if args.markdown:
        print(markdown(rows, args))


if __name__ == "__main__":
    main()
