"""Trace + lower time of the reference train step: this checkout against an older commit.

    python benchmarks/bench_lowering.py [--baseline 2035ef6] [--repeats 5] [--trials 10]

Both versions run in one process, alternating, so machine load affects them alike: the
older commit's `equishard/` is extracted with `git archive` into a temporary directory
under the name `equishard_baseline` (the package imports itself relatively, so the copy
is a second, independent package). For each, `equishard.models.abstract_train_step`
builds the train step of the `base` preset on `fsdp=4,tp=2` (batch 16 x 256, AdamW,
clipping at 1.0) from abstract arrays, then traces and lowers it to StableHLO (no XLA
compilation). Reported per phase (the state's `eval_shape`; `make_train_step` and the
trace; the lowering), the best of `--repeats` for each, and the ratio of trace + lower;
with `--trials K`, that measurement is made K times in a row and each trial's ratio is
reported (their spread is the measurement's, on a machine whose speed drifts), beside the
phases' best over all trials.
Times are the process's CPU time (`time.process_time`): tracing and lowering run on one
thread, so on a shared machine the CPU time measures their work where wall time would
also measure the other processes. Writes
`benchmarks/results/lowering.json`; `bench_layouts.py --from-results` puts it into
`RESULTS.md`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import use_simulated_cpu_devices
from bench_layouts import HERE, RESULTS, environment

LAYOUT = "fsdp=4,tp=2"
PRESET = "base"
BATCH, SEQ = 16, 256
CLIP = 1.0


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], capture_output=True, check=True, cwd=HERE.parent).stdout


def import_baseline(rev: str, into: Path) -> Any:
    """The package `equishard/` of commit `rev`, imported as `equishard_baseline`."""
    archive = _git("archive", "--format=tar", rev, "equishard")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "equishard").rename(into / "equishard_baseline")
    sys.path.insert(0, str(into))
    return importlib.import_module("equishard_baseline")


def lower_once(package: str) -> dict[str, float]:
    """Seconds to trace and to lower `package`'s reference train step (abstract arrays).

    The abstract train state is built first (`eval_shape`, not timed in the ratio); then
    `make_train_step` and `jax.jit(...).trace` (timed as "trace"), then `.lower()` (timed
    as "lower"): the two phases `make_train_step` and its shard_map decide.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding

    models = importlib.import_module(f"{package}.models")
    train = importlib.import_module(f"{package}.train")
    report = importlib.import_module(f"{package}.report")
    sharding = importlib.import_module(f"{package}.sharding")
    # `Layout` moved from `train` to `sharding` in the redesign.
    layout = (getattr(sharding, "Layout", None) or train.Layout)(LAYOUT)
    devices = jax.devices()
    optimizer = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    mesh, par = layout.mesh(devices), layout.resolve(len(devices))
    # The resolved layout's batch spec (a method of `Layout` before the one layout object).
    batch_spec = par.batch_spec if hasattr(par, "batch_spec") else layout.batch_spec(len(devices))
    clock = time.process_time  # CPU time of this process: what tracing and lowering cost
    start = clock()
    make_state = lambda: train.init_train_state(  # noqa: E731
        lambda k: models.GPT(models.PRESETS[PRESET], par, key=k), optimizer, jax.random.key(0), mesh=mesh
    )
    old = getattr(report, "_gpt", None)  # `equishard.report._gpt` before the GPT's report moved
    if hasattr(old, "_abstract"):  # before `equishard.report._abstract.abstract_state`
        state = old._abstract(eqx.filter_eval_shape(make_state), mesh)
    else:
        state = importlib.import_module(f"{package}.report._abstract").abstract_state(make_state, mesh)
    dynamic, static = eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    batch = jax.ShapeDtypeStruct(
        (BATCH, SEQ + 1), jnp.int32, sharding=NamedSharding(mesh, batch_spec)
    )
    traced_at = clock()
    step = train.make_train_step(
        lambda model, b, key: model.loss(b, key), optimizer, mesh=mesh,
        batch_spec=batch_spec, clip_norm=CLIP,
    )  # fmt: skip
    traced = jax.jit(lambda d, b: step(eqx.combine(d, static), b), donate_argnums=0).trace(dynamic, batch)
    lowered_at = clock()
    traced.lower()
    end = clock()
    return {"state": traced_at - start, "trace": lowered_at - traced_at, "lower": end - lowered_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="2035ef6", help="the commit to compare against")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, default=1, help="independent best-of-repeats measurements")
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args()
    use_simulated_cpu_devices(8)
    baseline_commit = _git("rev-parse", "--short", args.baseline).decode().strip()
    times: dict[str, list[dict[str, float]]] = {"equishard": [], "equishard_baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        import_baseline(args.baseline, Path(tmp))
        for i in range(args.repeats * args.trials):
            order = ["equishard", "equishard_baseline"]
            for package in order if i % 2 == 0 else order[::-1]:
                gc.collect()
                gc.disable()  # as `timeit` does: a collection would land in one phase at random
                try:
                    times[package].append(lower_once(package))
                finally:
                    gc.enable()

    def best(runs: list[dict[str, float]]) -> dict[str, float]:
        return {**{k: min(r[k] for r in runs) for k in runs[0]}, "trace + lower": min(r["trace"] + r["lower"] for r in runs)}

    def ratio_of(runs_new: list[dict[str, float]], runs_old: list[dict[str, float]]) -> float:
        return best(runs_new)["trace + lower"] / best(runs_old)["trace + lower"]

    new, old = best(times["equishard"]), best(times["equishard_baseline"])
    trials = [
        ratio_of(times["equishard"][t : t + args.repeats], times["equishard_baseline"][t : t + args.repeats])
        for t in range(0, args.repeats * args.trials, args.repeats)
    ]
    ratio = trials[0] if args.trials == 1 else statistics.median(trials)
    out = {
        "environment": {**environment(), "commit": _git("rev-parse", "--short", "HEAD").decode().strip()},
        "baseline_commit": baseline_commit,
        "layout": LAYOUT, "preset": PRESET, "batch": BATCH, "seq_len": SEQ,
        "repeats": args.repeats, "trials": args.trials, "times_s": times,
        "best_s": new, "baseline_best_s": old, "ratio": ratio, "trial_ratios": trials,
    }  # fmt: skip
    for name, b in (("this checkout", new), (baseline_commit, old)):
        print(f"{name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in b.items()))
    if args.trials > 1:
        print(f"trials (best of {args.repeats} each): " + ", ".join(f"{r:.2f}x" for r in trials))
    print(f"trace + lower, best of {args.repeats}: {ratio:.2f}x the time at {baseline_commit}" + (f" (median of {args.trials} trials)" if args.trials > 1 else ""))
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "lowering.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
