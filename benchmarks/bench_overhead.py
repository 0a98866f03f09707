"""equishard's step against its baselines, as the median of many interleaved pairs.

    python benchmarks/bench_overhead.py [--pairs 21]

Two comparisons, each timed as `--pairs` interleaved pairs (the order alternating:
a b, b a, ...) after two warm-up pairs, on the network of `bench_layouts.py` (4 layers,
d_model 256, batch 16 x 128, AdamW, global-norm clipping at 1.0, the non-finite skip):

- **single device**: equishard's train step on a 1-device mesh (`dp=1`) against the
  same network as a plain one-device Equinox model under `jax.jit`, with the same
  update, clipping and non-finite guard;
- **dp=8**: equishard's step on 8 (simulated) devices against the GSPMD baseline (plain
  `jax.jit` with shardings, XLA's partitioner inserting the collectives).

For each, the ratio of every pair (equishard / baseline) is taken and the median ratio
reported with its quartiles and extremes, beside the compiler's cost analysis of both
programs (flops and bytes accessed), which says where a difference comes from. Writes
`benchmarks/results/overhead.json`; `bench_layouts.py --from-results` puts it into
`RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

from _common import use_simulated_cpu_devices
from bench_layouts import HERE, RESULTS, bench_layout, bench_single_device, environment


def ratios(equishard: list[float], baseline: list[float]) -> dict[str, Any]:
    """The per-pair ratios' median, quartiles and extremes."""
    r = sorted(a / b for a, b in zip(equishard, baseline, strict=True))
    q1, median, q3 = statistics.quantiles(r, n=4, method="inclusive")
    return {"pairs": len(r), "median": median, "q1": q1, "q3": q3, "min": r[0], "max": r[-1]}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=21, help="timed interleaved pairs per comparison (>= 15)")
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args()
    use_simulated_cpu_devices(8)
    start = time.perf_counter()
    single = bench_single_device(args.pairs)
    dp8 = bench_layout("dp=8", False, {}, args.pairs)
    out = {
        "environment": {**environment(), "commit": _commit()},
        "seconds": time.perf_counter() - start,
        "single_device": {
            "ratio": ratios(single["equishard_step_times_s"], single["plain_step_times_s"]),
            "equishard_step_s": single["equishard_step_s"],
            "baseline_step_s": single["plain_step_s"],
            "equishard_cost": single["equishard_cost"],
            "baseline_cost": single["plain_cost"],
            "equishard_memory": single["equishard_memory"],
            "baseline_memory": single["plain_memory"],
        },
        "dp8": {
            "ratio": ratios(dp8["equishard_step_times_s"], dp8["gspmd_step_times_s"]),
            "equishard_step_s": dp8["equishard_step_s"],
            "baseline_step_s": dp8["gspmd_step_s"],
            "equishard_cost": dp8["equishard_cost"],
            "baseline_cost": dp8["gspmd_cost"],
            "equishard_memory": dp8["equishard_memory"],
            "baseline_memory": dp8["gspmd_memory"],
            "equishard_bytes": dp8["equishard_bytes"],
            "baseline_bytes": dp8["gspmd_bytes"],
        },
    }
    for name in ("single_device", "dp8"):
        r = out[name]["ratio"]
        c, b = out[name]["equishard_cost"], out[name]["baseline_cost"]
        print(
            f"{name}: median ratio {r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f}, "
            f"range {r['min']:.3f}-{r['max']:.3f}, {r['pairs']} pairs); flops "
            f"{c['flops'] / b['flops']:.4f}x, bytes accessed {c['bytes accessed'] / b['bytes accessed']:.4f}x",
            flush=True,
        )
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "overhead.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
