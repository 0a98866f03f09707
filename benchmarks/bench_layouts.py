"""The reference GPT under seven layouts: equishard against a plain-`jit` GSPMD baseline.

    python benchmarks/bench_layouts.py

(4 to 12 minutes on a 2-core machine, depending on what else runs) writes `benchmarks/results/layouts.json`,
`compile_depth.json`, `single_device.json` and regenerates `benchmarks/RESULTS.md`.
`--layouts "dp=8;tp=8" --no-write` runs a subset without touching the committed files;
`--from-results` regenerates RESULTS.md from the JSON files alone.

**What runs.** One process, 8 simulated CPU devices (real devices on an accelerator
host). A GPT of 4 layers, d_model 256, 8 heads, d_ff 1024 (SwiGLU), vocabulary 512,
sequence 128, batch 16 (the MoE variant: a mixture of 8 experts, top-2, every second
block), float32, AdamW with global-norm clipping at 1.0. For each layout:

- (a) equishard: `init_train_state` + `make_train_step` (the train step of
  `equishard train`), the whole step inside one `shard_map`;
- (b) GSPMD: the same network as a one-device model (`to_single_device`), its arrays
  placed with `NamedSharding(mesh, spec)` on a mesh of `AxisType.Auto` axes — the
  specs are equishard's, mapped onto the plain model's parameter paths — and the same
  step (loss, gradient, global-norm clipping, non-finite skip, AdamW) under plain
  `jax.jit` with in/out shardings and no `shard_map`: XLA's SPMD partitioner inserts
  every collective. The same parameters and the same batch: the first losses agree.
  GSPMD has no pipeline schedule: for `pp`, the stacked layer axis is split over `pp`
  as the annotation would say, and XLA decides how to run the layer scan over it.

The two are timed interleaved (a, b, a, b, ...) after a warm-up; the tables give the
median step time, the collective bytes each device sends per step (read from each
compiled program by `equishard.report.read_collectives`, loop trip counts applied), the
analytical minimum of equishard's algorithm (`equishard.models.gpt_minimum`), the
compiler's per-device memory (`memory_analysis`) and compile times.

Also: trace + compile time of equishard's step against depth (4, 16, 48 layers, each
measured three times, interleaved, the fastest kept), and the single-device overhead:
equishard's step on a 1-device mesh against the plain Equinox model under `jax.jit`.

On XLA:CPU collectives run synchronously (no overlap), so the step times compare
bookkeeping and partitioning, not communication hiding; bytes and memory are what the
compiled programs would move and hold on any backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

from _common import timed, use_simulated_cpu_devices
from bench_memory import memory_markdown

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

LAYOUTS: list[tuple[str, bool, dict[str, Any]]] = [
    ("dp=8", False, {}),
    ("fsdp=8", False, {}),
    ("tp=8", False, {}),
    ("fsdp=4,tp=2", False, {}),
    ("dp=2,fsdp=2,tp=2", False, {}),
    ("dp=2,ep=4", True, {}),
    ("pp=2,dp=2,tp=2", False, {"num_microbatches": 8}),
    ("pp=2,dp=2,tp=2", False, {"num_microbatches": 8, "pipeline_repeats": 2}),
]
"""(layout, MoE variant, `Layout` options): the benchmarked layouts."""

BATCH, SEQ = 16, 128
DEPTHS = (4, 16, 48)
DEPTH_LAYOUT = "dp=2,fsdp=2,tp=2"
CLIP = 1.0
MIB = 2**20


def _config(moe: bool, layers: int = 4) -> Any:
    from equishard.models import GPTConfig

    config = GPTConfig(vocab_size=512, d_model=256, n_heads=8, n_layers=layers, d_ff=1024)
    return dataclasses.replace(config, moe_every=2, num_experts=8, top_k=2) if moe else config


def _optimizer() -> Any:
    import optax

    return optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)


# ------------------------------------------------------------------------ equishard


def _plain_step(static: Any, optimizer: Any) -> Any:
    """The baselines' train step on a plain model's arrays: what equishard's step does.

    Loss and gradient, global-norm clipping at `CLIP`, the optax update, and the same
    non-finite guard (the loss, the gradient norm and every update finite, else the
    step is skipped).
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            return eqx.combine(p, static).loss(batch)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grad_norm = optax.global_norm(grads)
        scale = jnp.minimum(1.0, CLIP / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        finite = [jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates) if eqx.is_inexact_array(u)]
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.all(jnp.stack(finite))
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), {"loss": loss, **metrics}

    return step


def _state_jit(step: Any, state: Any) -> tuple[Any, Any, Any]:
    """`(jitted, arrays, static)`: `step` as a `jax.jit` over the state's arrays (donated)."""
    import equinox as eqx
    import jax

    arrays, static = eqx.partition(state, eqx.is_array)

    def run(arrays: Any, batch: Any) -> Any:
        new, metrics = step(eqx.combine(arrays, static), batch)
        return eqx.filter(new, eqx.is_array), metrics

    return jax.jit(run, donate_argnums=0), arrays, static


def equishard_side(config: Any, layout: Any, batch: Any) -> dict[str, Any]:
    """Build, compile and prepare equishard's step; returns its pieces and facts."""
    import jax

    from equishard.models import GPT
    from equishard.train import init_train_state, make_train_step

    mesh = layout.mesh()
    par = layout.resolve()
    optimizer = _optimizer()
    state = init_train_state(lambda k: GPT(config, par, key=k), optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(
        lambda model, b, key: model.loss(b, key), optimizer, mesh=mesh,
        batch_spec=layout.resolve().batch_spec, clip_norm=CLIP,
    )  # fmt: skip
    jitted, arrays, _ = _state_jit(step, state)
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, layout.resolve().batch_spec))
    lowered, lower_s = timed(lambda: jitted.lower(arrays, batch))
    compiled, compile_s = timed(lambda: lowered.compile())
    return {
        "mesh": mesh, "state": state, "compiled": compiled, "arrays": arrays, "batch": batch,
        "lower_s": lower_s, "compile_s": compile_s,
    }  # fmt: skip


# ---------------------------------------------------------------------------- GSPMD


def _plain_with_specs(model: Any) -> Any:
    """The one-device model of `model`, its boxes carrying `model`'s specs by path."""
    import jax

    from equishard import Sharded, gather, is_sharded
    from equishard.models._gpt import canonical_path, to_single_device
    from equishard.sharding._specs import leaves_with_specs, path_str

    specs = {canonical_path("." + path): spec for path, _, spec in leaves_with_specs(model)}
    plain = to_single_device(gather(model))

    def respec(path: Any, leaf: Any) -> Any:
        if not is_sharded(leaf):
            return leaf
        return Sharded(leaf.value, specs[canonical_path("." + path_str(path))])

    return jax.tree_util.tree_map_with_path(respec, plain, is_leaf=is_sharded)


def _shardings(tree: Any, mesh: Any) -> Any:
    import jax

    from equishard import specs_of
    from equishard.sharding._specs import is_spec

    return jax.tree.map(
        lambda s: None if s is None else jax.sharding.NamedSharding(mesh, s),
        specs_of(tree),
        is_leaf=lambda s: s is None or is_spec(s),
    )


def gspmd_side(es: dict[str, Any], layout: Any, batch_host: Any) -> dict[str, Any]:
    """The same network, parameters and batch under plain `jax.jit` + NamedSharding."""
    import equinox as eqx
    import jax
    from jax.sharding import AxisType, NamedSharding

    from equishard import make_mesh

    mesh = make_mesh(layout.spec, axis_types=AxisType.Auto)
    optimizer = _optimizer()
    model = _plain_with_specs(es["state"].model)
    params, static = eqx.partition(model, eqx.is_array)
    param_sh = _shardings(params, mesh)
    params = jax.device_put(params, param_sh)
    opt_state = optimizer.init(params)
    opt_sh = _shardings(opt_state, mesh)
    opt_state = jax.device_put(opt_state, opt_sh)
    batch_sh = NamedSharding(mesh, layout.resolve().batch_spec)
    batch = jax.device_put(batch_host, batch_sh)
    jitted = jax.jit(
        _plain_step(static, optimizer), in_shardings=(param_sh, opt_sh, batch_sh), out_shardings=(param_sh, opt_sh, None),
        donate_argnums=(0, 1),
    )  # fmt: skip
    lowered, lower_s = timed(lambda: jitted.lower(params, opt_state, batch))
    compiled, compile_s = timed(lambda: lowered.compile())
    return {
        "mesh": mesh, "compiled": compiled, "params": params, "opt_state": opt_state,
        "batch": batch, "lower_s": lower_s, "compile_s": compile_s,
    }  # fmt: skip


# ------------------------------------------------------------------------- timing


def _pairs(a: Any, b: Any, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """`repeats` interleaved pairs of timed calls, the order alternating (a b, b a, ...)
    so that neither side always runs right after the other; `warmup` pairs first."""
    for _ in range(warmup):
        a(), b()
    a_times, b_times = [], []
    for i in range(repeats):
        if i % 2:
            b_times.append(b())
            a_times.append(a())
        else:
            a_times.append(a())
            b_times.append(b())
    return a_times, b_times


def cost(compiled: Any) -> dict[str, float]:
    """The compiler's cost analysis of a program: flops, transcendentals, bytes accessed."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    keys = ("flops", "transcendentals", "bytes accessed")
    return {k: float(analysis.get(k, 0.0)) for k in keys}


def _time_interleaved(es: dict[str, Any], gs: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Warm up both, then alternate single steps; median times and the first losses."""
    import jax

    def es_step() -> float:
        start = time.perf_counter()
        es["arrays"], metrics = es["compiled"](es["arrays"], es["batch"])
        jax.block_until_ready(metrics)
        es["last"] = float(metrics["loss"])
        return time.perf_counter() - start

    def gs_step() -> float:
        start = time.perf_counter()
        gs["params"], gs["opt_state"], metrics = gs["compiled"](gs["params"], gs["opt_state"], gs["batch"])
        jax.block_until_ready(metrics)
        gs["last"] = float(metrics["loss"])
        return time.perf_counter() - start

    es_step()
    first_es = es["last"]
    gs_step()
    first_gs = gs["last"]
    es_times, gs_times = _pairs(es_step, gs_step, repeats)
    return {
        "equishard_step_s": statistics.median(es_times),
        "gspmd_step_s": statistics.median(gs_times),
        "equishard_step_times_s": es_times,
        "gspmd_step_times_s": gs_times,
        "first_loss": {"equishard": first_es, "gspmd": first_gs},
        "last_loss": {"equishard": es["last"], "gspmd": gs["last"]},
    }


def _memory(compiled: Any) -> dict[str, int]:
    from equishard.report import memory_stats

    m = memory_stats(compiled)
    assert m is not None
    return {
        "argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes,
        "alias_bytes": m.alias_bytes, "temp_bytes": m.temp_bytes, "peak_bytes": m.peak_bytes,
    }  # fmt: skip


def bench_layout(spec: str, moe: bool, options: dict[str, Any], repeats: int) -> dict[str, Any]:
    import numpy as np

    from equishard.models import gpt_minimum
    from equishard.report import report
    from equishard.sharding import Layout, param_table

    config = _config(moe)
    layout = Layout(spec, **options)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, config.vocab_size, (BATCH, SEQ + 1), dtype=np.int32)
    es = equishard_side(config, layout, batch)
    gs = gspmd_side(es, layout, batch)
    rows = param_table(es["state"].model, es["mesh"])
    minimum = gpt_minimum(config, layout, batch_size=BATCH, seq_len=SEQ, rows=rows)
    es_report = report(es["compiled"], mesh=es["mesh"], minimum=minimum)
    gs_report = report(gs["compiled"], mesh=gs["mesh"])
    times = _time_interleaved(es, gs, repeats)
    by_kind = lambda r: {  # noqa: E731
        kind: sum(c.total_bytes for c in r.collectives if c.kind == kind)
        for kind in sorted({c.kind for c in r.collectives})
    }
    result = {
        "layout": spec,
        "options": options,
        "moe": moe,
        "parameters": int(sum(int(np.prod(r.shape)) for r in rows)),
        **times,
        "equishard_bytes": es_report.collective_bytes,
        "gspmd_bytes": gs_report.collective_bytes,
        "equishard_bytes_by_kind": by_kind(es_report),
        "gspmd_bytes_by_kind": by_kind(gs_report),
        "minimum_bytes": minimum.total,
        "ideal_bytes": minimum.ideal_total,
        "minimum_terms": [dataclasses.asdict(t) for t in minimum.terms],
        "equishard_over_minimum": es_report.collective_bytes / minimum.total,
        "equishard_over_ideal": es_report.collective_bytes / minimum.ideal_total,
        "equishard_memory": _memory(es["compiled"]),
        "gspmd_memory": _memory(gs["compiled"]),
        "equishard_cost": cost(es["compiled"]),
        "gspmd_cost": cost(gs["compiled"]),
        "equishard_lower_s": es["lower_s"],
        "equishard_compile_s": es["compile_s"],
        "gspmd_lower_s": gs["lower_s"],
        "gspmd_compile_s": gs["compile_s"],
    }
    print(
        f"{spec:18} step {times['equishard_step_s'] * 1e3:7.1f} ms vs GSPMD "
        f"{times['gspmd_step_s'] * 1e3:7.1f} ms | bytes {result['equishard_bytes'] / MIB:7.2f} MiB "
        f"(x{result['equishard_over_minimum']:.3f} of minimum) vs GSPMD "
        f"{result['gspmd_bytes'] / MIB:7.2f} MiB | losses {times['first_loss']}",
        flush=True,
    )
    return result


# ------------------------------------------------------------- depth and 1 device


def bench_depth() -> dict[str, Any]:
    """Trace + compile time of equishard's step at 4, 16 and 48 layers (best of three)."""
    from equishard.models import abstract_train_step
    from equishard.sharding import Layout

    best: dict[int, dict[str, float]] = {}
    for _ in range(3):
        for depth in DEPTHS:
            step = abstract_train_step(
                _config(False, depth), Layout(DEPTH_LAYOUT), batch_size=BATCH, seq_len=SEQ,
                optimizer=_optimizer(), clip_norm=CLIP,
            )
            _, compile_s = timed(lambda: step.lowered.compile())
            total = step.lower_seconds + compile_s
            if depth not in best or total < best[depth]["total_s"]:
                best[depth] = {"lower_s": step.lower_seconds, "compile_s": compile_s, "total_s": total}
    print("compile time vs depth:", {d: round(v["total_s"], 2) for d, v in best.items()}, flush=True)
    return {
        "layout": DEPTH_LAYOUT,
        "depths": {str(d): v for d, v in best.items()},
        "ratio_48_over_4": best[48]["total_s"] / best[4]["total_s"],
    }


def bench_single_device(repeats: int) -> dict[str, Any]:
    """equishard's step on a 1-device mesh against the plain Equinox model under `jax.jit`."""
    import equinox as eqx
    import jax
    import numpy as np

    from equishard.models import GPT
    from equishard.models._gpt import to_single_device
    from equishard.sharding import Layout
    from equishard.train import init_train_state, make_train_step

    config = _config(False)
    device = jax.devices()[0]
    layout = Layout("dp=1")
    mesh = layout.mesh([device])
    optimizer = _optimizer()
    state = init_train_state(lambda k: GPT(config, layout.resolve(1), key=k), optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(
        lambda model, b, key: model.loss(b, key), optimizer, mesh=mesh, batch_spec=layout.resolve(1).batch_spec,
        clip_norm=CLIP,
    )  # fmt: skip
    batch = jax.device_put(
        np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ + 1), dtype=np.int32), device
    )
    es_jit, es_arrays, _ = _state_jit(step, state)
    es_low, es_lower_s = timed(lambda: es_jit.lower(es_arrays, batch))
    es_compiled, es_compile_s = timed(lambda: es_low.compile())

    # Plain Equinox: the same network as a one-device model (its boxes are plain pytree
    # nodes holding replicated specs), one device, jax.jit; no mesh, no shard_map.
    plain = to_single_device(jax.device_get(state.model))
    params, static = eqx.partition(jax.device_put(plain, device), eqx.is_array)
    opt_state = optimizer.init(params)

    p_jit = jax.jit(_plain_step(static, optimizer), donate_argnums=(0, 1))
    p_low, p_lower_s = timed(lambda: p_jit.lower(params, opt_state, batch))
    p_compiled, p_compile_s = timed(lambda: p_low.compile())

    carry = {"es": es_arrays, "p": (params, opt_state)}

    def run_es() -> float:
        start = time.perf_counter()
        carry["es"], metrics = es_compiled(carry["es"], batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    def run_plain() -> float:
        start = time.perf_counter()
        p, o, loss = p_compiled(*carry["p"], batch)
        carry["p"] = (p, o)
        jax.block_until_ready(loss)
        return time.perf_counter() - start

    run_es()
    run_plain()
    es_times, p_times = _pairs(run_es, run_plain, repeats)
    result = {
        "equishard_step_s": statistics.median(es_times),
        "plain_step_s": statistics.median(p_times),
        "equishard_step_times_s": es_times,
        "plain_step_times_s": p_times,
        "equishard_lower_s": es_lower_s,
        "equishard_compile_s": es_compile_s,
        "plain_lower_s": p_lower_s,
        "plain_compile_s": p_compile_s,
        "equishard_memory": _memory(es_compiled),
        "plain_memory": _memory(p_compiled),
        "equishard_cost": cost(es_compiled),
        "plain_cost": cost(p_compiled),
    }
    result["overhead"] = result["equishard_step_s"] / result["plain_step_s"]
    print(
        f"single device: equishard {result['equishard_step_s'] * 1e3:.1f} ms, plain Equinox "
        f"{result['plain_step_s'] * 1e3:.1f} ms (x{result['overhead']:.3f})",
        flush=True,
    )
    return result


# ------------------------------------------------------------------------ output


def environment() -> dict[str, Any]:
    import jax

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "platform": f"{jax.devices()[0].platform} x {jax.device_count()}",
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        # Other work on the machine while the benchmark ran (1-minute load average).
        "load": round(__import__("os").getloadavg()[0], 1),
    }


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def markdown(layouts: list[dict[str, Any]], depth: dict[str, Any], single: dict[str, Any], env: dict[str, Any], seconds: float) -> str:
    """RESULTS.md from the results."""
    lines = [
        "# Benchmarks: equishard against the GSPMD baseline",
        "",
        "Generated by `python benchmarks/bench_layouts.py` (see its docstring for the setup);",
        f"{env['date']}, Python {env['python']}, JAX {env['jax']}, {env['platform']} devices on "
        f"{env['machine']}; the whole run took {seconds / 60:.1f} minutes. Raw numbers: "
        "`benchmarks/results/*.json`.",
        "",
        "The reference GPT (4 layers, d_model 256, 8 heads, d_ff 1024 SwiGLU, vocabulary 512; "
        "MoE variant: 8 experts, top-2, every second block), sequence 128, batch 16, float32, "
        "AdamW, one train step. equishard: the step of `equishard train` (one `shard_map`). "
        "GSPMD: the same network, parameters and batch under plain `jax.jit` with "
        "`NamedSharding` specs on `AxisType.Auto` axes, no `shard_map`.",
        "",
        "## Time and communication",
        "",
        "Bytes: what each device sends per step under ring algorithms, read from the compiled "
        "programs. Minimum: the analytical minimum of equishard's algorithm "
        "(`equishard.models.gpt_minimum`); ideal: the textbook figure (no pipeline bubble).",
        "",
        "| layout | equishard ms | GSPMD ms | GSPMD / equishard | equishard MiB | GSPMD MiB | minimum MiB | equishard / minimum | equishard / ideal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in layouts:
        lines.append(
            f"| {_row_name(r)} | {r['equishard_step_s'] * 1e3:.0f} | {r['gspmd_step_s'] * 1e3:.0f} | "
            f"{r['gspmd_step_s'] / r['equishard_step_s']:.2f} | {_mib(r['equishard_bytes'])} | "
            f"{_mib(r['gspmd_bytes'])} | {_mib(r['minimum_bytes'])} | "
            f"{r['equishard_over_minimum']:.3f} | {r['equishard_over_ideal']:.3f} |"
        )
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    lines += [
        "",
        "Bytes by collective kind (MiB per device per step), equishard / GSPMD:",
        "",
        "| layout | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for r in layouts:
        cells = [
            f"{r['equishard_bytes_by_kind'].get(k, 0) / MIB:.2f} / {r['gspmd_bytes_by_kind'].get(k, 0) / MIB:.2f}"
            for k in kinds
        ]
        lines.append(f"| {_row_name(r)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Memory and compilation",
        "",
        "Per device, from each compiled program's `memory_analysis()` (MiB): arguments (the "
        "state and the batch shard, donated to the outputs) and temporaries; compile: "
        "tracing + lowering + XLA compilation (s).",
        "",
        "| layout | equishard args | GSPMD args | equishard temp | GSPMD temp | equishard compile s | GSPMD compile s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in layouts:
        em, gm = r["equishard_memory"], r["gspmd_memory"]
        lines.append(
            f"| {_row_name(r)} | {_mib(em['argument_bytes'])} | {_mib(gm['argument_bytes'])} | "
            f"{_mib(em['temp_bytes'])} | {_mib(gm['temp_bytes'])} | "
            f"{r['equishard_lower_s'] + r['equishard_compile_s']:.1f} | "
            f"{r['gspmd_lower_s'] + r['gspmd_compile_s']:.1f} |"
        )
    lines += [
        "",
        "## Compile time against depth",
        "",
        f"equishard's train step on `{depth['layout']}` (trace + lower + compile, best of three), "
        "the layers stacked and run by `jax.lax.scan`:",
        "",
        "| layers | trace + lower s | compile s | total s |",
        "|---:|---:|---:|---:|",
    ]
    for d, v in depth["depths"].items():
        lines.append(f"| {d} | {v['lower_s']:.2f} | {v['compile_s']:.2f} | {v['total_s']:.2f} |")
    lines += [
        "",
        f"48 layers over 4 layers: **{depth['ratio_48_over_4']:.2f}x**.",
        "",
        "## Single-device overhead",
        "",
        "equishard's step on a 1-device mesh (`dp=1`: `shard_map` and the train step's "
        "bookkeeping) against the same network as a one-device Equinox model "
        "(`to_single_device`) under plain `jax.jit` with the same update, batch 16, one device:",
        "",
        "| | equishard | plain Equinox | ratio |",
        "|---|---:|---:|---:|",
        f"| median step ms | {single['equishard_step_s'] * 1e3:.0f} | {single['plain_step_s'] * 1e3:.0f} | "
        f"{single['overhead']:.3f} |",
        f"| trace + compile s | {single['equishard_lower_s'] + single['equishard_compile_s']:.1f} | "
        f"{single['plain_lower_s'] + single['plain_compile_s']:.1f} | "
        f"{(single['equishard_lower_s'] + single['equishard_compile_s']) / (single['plain_lower_s'] + single['plain_compile_s']):.2f} |",
        f"| temporaries MiB | {_mib(single['equishard_memory']['temp_bytes'])} | "
        f"{_mib(single['plain_memory']['temp_bytes'])} | |",
        "",
        *overhead_markdown(),
        *lowering_markdown(),
        *pipeline_markdown(),
        *memory_markdown(),
        NOTES,
        LONG_CONTEXT,
    ]
    return "\n".join(lines) + "\n"


def pipeline_markdown() -> list[str]:
    """The section of `bench_pipeline.py`'s results (nothing before it has run)."""
    path = RESULTS / "pipeline.json"
    if not path.exists():
        return []
    o = json.loads(path.read_text())
    from equishard.core import pipeline_schedule, schedule_report

    a = o["args"]
    rows = o["rows"]
    gpipe = {r["microbatches"]: r["activation_bytes"] for r in rows if r["schedule"] == "gpipe"}
    lines = [
        "## Pipeline schedules",
        "",
        f"`python benchmarks/bench_pipeline.py`: `pp={a['pp']}`, {a['layers']} transformer "
        f"blocks of width {a['width']}, micro-batches of {a['microbatch']} x {a['seq']} tokens "
        "(fixed), one forward+backward program of the pipeline and a head "
        "(`PipelineModule.loss`). Per device: temporaries (`memory_analysis`) and "
        "activations, the part of the temporaries that grows with the micro-batch "
        "(`temp(2b) − temp(b)`; the parameter-sized buffers cancel). The circular rows were "
        "measured at commit 94c5cf0 (`ONLY=circular python benchmarks/bench_pipeline.py "
        "--microbatches 16,32`), the others before; circular holds `R M` micro-batches of "
        "`1/R` of a stage each, so its activations grow with `M` as GPipe's do.",
        "",
        "| schedule | M | temp MiB | activations MiB | / GPipe's | bubble | peak in flight |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = r["schedule"] + (f" R={r['repeats']}" if r["repeats"] > 1 else "")
        ref = gpipe.get(r["microbatches"])
        ratio = f"{r['activation_bytes'] / ref:.3f}" if ref else "–"
        lines.append(
            f"| {name} | {r['microbatches']} | {r['temp_bytes'] / MIB:.2f} | "
            f"{r['activation_bytes'] / MIB:.2f} | {ratio} | {r['bubble_fraction']:.3f} | "
            f"{r['peak_in_flight']} |"
        )
    bubbles = []
    for name, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        cells = [
            f"{schedule_report(pipeline_schedule(name, a['pp'], m, repeats=repeats)).bubble_fraction:.3f}"
            for m in (8, 16, 32)
        ]
        bubbles.append(f"| {name}{f' R={repeats}' if repeats > 1 else ''} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Bubble fractions at `pp={a['pp']}`, read off the tables (`schedule_report`; a forward "
        "costs one unit, a backward two, ZB-H1's split backward one and one). The CPU cannot "
        "show a schedule's time — its simulated devices share the cores, so no device ever "
        "waits for another — and in particular not ZB-H1's gain over 1F1B:",
        "",
        "| schedule | M = 8 | M = 16 | M = 32 |",
        "|---|---:|---:|---:|",
        *bubbles,
    ]
    g = o.get("gpt_bytes")
    if g:
        per = ", ".join(f"{b / MIB:.2f}" for b in g["bytes_per_stage_device"])
        lines += [
            "",
            f"Collective bytes of the reference GPT's train step (the model above) on "
            f"`{g['layout']}`, {g['schedule']}, M = {g['microbatches']}, read with the "
            f"schedule's weights (`read_collectives(..., weights=schedule_weights(table, "
            f"device))`): {per} MiB per device on the stage devices, "
            f"{g['over_ideal']:.3f}x the textbook figure of the last stage's device, "
            f"{g['ideal_bytes'] / MIB:.2f} MiB (GPipe: 1.057x its own). Unweighted — every "
            "branch of every conditional counted on every step — the reader would say "
            f"{g['unweighted_bytes'] / MIB:.2f} MiB. The textbook figure counts what 1F1B runs "
            "where — the embedding on the first stage only, the head and loss on the last only "
            "(GPipe runs both on every stage), the embedding's gradient summed over the stages "
            "instead of the pipeline input's (`equishard.report`'s module documentation, "
            '"Explicit schedules"); counted as for GPipe, as before commit 29d7575, the same '
            "bytes read 0.894x a textbook of 17.64 MiB. Re-measured at 29d7575 "
            "(`python benchmarks/bench_pipeline.py --bytes`).",
        ]
    return [*lines, ""]


def overhead_markdown() -> list[str]:
    """The section of `bench_overhead.py`'s results (nothing before it has run)."""
    path = RESULTS / "overhead.json"
    if not path.exists():
        return []
    o = json.loads(path.read_text())
    env = o["environment"]
    lines = [
        "## Overhead as interleaved pairs",
        "",
        f"`python benchmarks/bench_overhead.py` at commit {env.get('commit', '?')} "
        f"({env['date']}, JAX {env['jax']}, {env['platform']} devices on {env['machine']}): "
        "each comparison timed as interleaved pairs (order alternating, after two warm-up "
        "pairs); the ratio of each pair, equishard / baseline, summarised by its median, "
        "quartiles and extremes. Cost: the compiled programs' own cost analysis "
        "(`compiled.cost_analysis()`), equishard / baseline.",
        "",
        "| comparison | pairs | median ratio | quartiles | range | equishard ms | baseline ms | flops | bytes accessed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"single_device": "1 device vs plain Equinox", "dp8": "dp=8 vs GSPMD"}
    for key, name in names.items():
        r, e, b = o[key]["ratio"], o[key]["equishard_cost"], o[key]["baseline_cost"]
        lines.append(
            f"| {name} | {r['pairs']} | {r['median']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} | "
            f"{r['min']:.3f}-{r['max']:.3f} | {o[key]['equishard_step_s'] * 1e3:.0f} | "
            f"{o[key]['baseline_step_s'] * 1e3:.0f} | {e['flops'] / b['flops']:.4f} | "
            f"{e['bytes accessed'] / b['bytes accessed']:.4f} |"
        )
    dp8 = o["dp8"]
    load = f"load average {env['load']}" if "load" in env else "load not recorded"
    return [
        *lines,
        "",
        "Targets: at most 1.05 on one device, 1.03 on `dp=8`. The baselines run the same "
        "update, clipping and non-finite guard as equishard's step (loss, gradient norm and "
        "every update finite). equishard computes the update twice, once for the guard to "
        "read and once more, inside the branch of a `lax.cond` that applies it, so that no "
        "parameter-sized update is held beside the gradients (see the memory sections): "
        "that is the flops column's excess, largest on `dp=8`, where every device updates "
        "every parameter. "
        "The collective bytes on `dp=8` are equal "
        f"({dp8['equishard_bytes'] / MIB:.2f} MiB against {dp8['baseline_bytes'] / MIB:.2f} MiB: "
        "the same two all-reduces of the same gradients). The non-finite guard combines its "
        "verdict over the axes some parameter is split over only, so on `dp=8` it sends "
        "nothing, as GSPMD's does. The step times come from 8 simulated devices sharing "
        f"the machine's cores with other work ({load} during the run): the quartiles "
        "and range say how far one pair's ratio moves with that noise.",
        "",
    ]


def lowering_markdown() -> list[str]:
    """The section of `bench_lowering.py`'s results (nothing before it has run)."""
    path = RESULTS / "lowering.json"
    if not path.exists():
        return []
    o = json.loads(path.read_text())
    env, new, old = o["environment"], o["best_s"], o["baseline_best_s"]
    row = lambda name, b: (  # noqa: E731
        f"| {name} | {b['state']:.3f} | {b['trace']:.3f} | {b['lower']:.3f} | {b['trace + lower']:.3f} |"
    )
    trials = o.get("trial_ratios", [o["ratio"]])
    if len(trials) > 1:
        measured = (
            f"**{o['ratio']:.2f}x** the older commit's, the median of {len(trials)} trials of best of "
            f"{o['repeats']} made in a row (each trial: {', '.join(f'{r:.2f}' for r in trials)}; "
            f"{sum(r <= 0.6 for r in trials)} of {len(trials)} at most 0.6x)"
        )
        best_of = f"best of {o['repeats']} x {len(trials)} each (the table)"
    else:
        measured = f"**{o['ratio']:.2f}x** the older commit's"
        best_of = f"best of {o['repeats']} each"
    return [
        "## Trace and lower time",
        "",
        f"`python benchmarks/bench_lowering.py` at commit {env.get('commit', '?')} ({env['date']}, "
        f"JAX {env['jax']}, {env['platform']} devices on {env['machine']}): the train step of "
        f"`{o['preset']}` on `{o['layout']}` (batch {o['batch']} x {o['seq_len']}, AdamW, clipping) "
        f"built from abstract arrays, this commit against commit {o['baseline_commit']} imported beside "
        f"it in the same process, alternating; {best_of}, CPU seconds of the process "
        "(tracing and lowering run on one thread; on a shared machine wall time would also "
        "count the other processes).",
        "",
        "| package | abstract state | make_train_step + trace | lower | trace + lower |",
        "|---|---:|---:|---:|---:|",
        row(f"this commit ({env.get('commit', '?')})", new),
        row(f"commit {o['baseline_commit']}", old),
        "",
        f"Trace + lower: {measured}; the target is at most 0.6x. The older "
        "train step traced its body twice (once more under `eval_shape`, to learn the "
        "`shard_map`'s output specs); this one passes the parameters' specs and traces once. "
        "The FSDP unit no longer linearises and transposes a `jax.checkpoint`: its call is "
        "traced once, its forward copies that trace's equations into the step (keeping its "
        "other collectives' outputs), and its backward differentiates it with those outputs "
        "replayed (`jvp` and `linear_transpose`). The scan over the units is differentiated "
        "as one (`scan_units`: a forward scan and a reverse scan of those rules), so JAX's "
        "linearisation, known-value hoisting and transpose of the scan body, each a pass over "
        "every equation of a layer, are not traced; a layer stages fewer equations (no "
        "transposed weight before a matmul, no nested `jit` for SiLU, one rotary table for "
        "the queries and keys, no log-sum-exp when only the attention output is read), and the "
        "scanned layer drops its checkpoint names and unused probes before it is run and replayed "
        "(no remat policy sees inside those rules). The "
        "vocabulary-parallel embedding and cross-entropy gather their clipped rows without the "
        "default gather mode's mask. The optimizer's update, called twice by the non-finite guard, "
        "is traced once, and its guarded application takes the state as one flat list. The "
        "state is placed by its own specs in one pass, and the `shard_map`s' traced inputs are "
        "laid out by their `in_specs` alone on a mesh of Auto axes (no sharding constraint per "
        "array). The lowering is the larger share now, about the older commit's: a few more "
        "equations (the guard's finiteness checks, its copy of the update, which JAX lowers "
        "apart from the applied one), every one lowered by JAX into a function and inlined.",
        "",
    ]


def _row_name(r: dict[str, Any]) -> str:
    """`pp=2,dp=2,tp=2 (GPipe, M=8)`: the layout with what distinguishes its row."""
    options = r["options"]
    name = r["layout"] + (" (MoE)" if r["moe"] else "")
    if "num_microbatches" in options:
        repeats = options.get("pipeline_repeats", 1)
        schedule = "GPipe" if repeats == 1 else f"circular R={repeats}"
        name += f" ({schedule}, M={options['num_microbatches']})"
    return name


NOTES = """## Notes

- **Where equishard sends more than the textbook minimum**, the analytical minimum
  names the term: a pipeline's SPMD schedule runs `T = R·M + S − 1` steps and every
  device runs its stage at each, bubble steps included, so the stage's tensor-parallel
  all-reduces run `T` times where a bubble-free pipeline runs them `R·M` times
  (`(S − 1)/(R·M)` more: 1/8 for GPipe with M = 8, 1/16 for the circular schedule with
  two stages per device). The activations themselves are sent `T − 1` times, which with
  two stages is the textbook `R·M`. In a bubble the devices of a stage would otherwise
  idle, so these bytes cost link time that no useful transfer wanted; the formulas are
  in `equishard.report`'s documentation, not constants fitted to the measurement.
- **FSDP with tensor parallelism** sends exactly the textbook bytes: FSDP's re-gather
  recomputes each unit's forward in the backward pass but keeps the outputs of the
  unit's tensor-parallel all-reduces (its forward rule keeps them, and the backward
  rule replays them in the recomputation it differentiates), so they are not sent twice.
- **GSPMD's bytes** are what XLA's partitioner chose for the same annotations (the
  parameters' specs and the batch's, no constraints on activations, as a plain `jax.jit`
  user writes them). Where a weight is split over `fsdp` along a dimension that is not
  the batch's, the partitioner keeps it split and all-reduces partial activations of the
  whole batch instead of gathering the weight (see the all-reduce column); steering it
  to FSDP's schedule takes `with_sharding_constraint` on the activations. For `pp` GSPMD
  has no pipeline at all (the layer axis is split over `pp` and XLA runs the layer scan
  over it as it sees fit), so that row compares a pipeline with no pipeline.
- **Step times** are on simulated CPU devices sharing the machine's cores: XLA:CPU runs
  collectives synchronously and all eight "devices" compete for the same cores, so the
  times measure partitioning and bookkeeping overhead, not interconnect time.
"""

# Measured by hand (`equishard plan`), not by this script: kept in every regeneration.
LONG_CONTEXT = """## Long context: planning Llama 3 8B at 128 K tokens

`equishard plan --model llama3-8b --layout fsdp=8,cp=8 --seq-len 131072 --devices 64`
(ring attention, zigzag split, batch 8 x 131,072 tokens, float32, AdamW) on this
machine's simulated CPU devices (2 cores shared with other work, so times are
pessimistic):

| remat | tracing | compiling | collectives per device per step | minimum | peak per device (CPU compiler) | analytical estimate |
|---|---|---|---|---|---|---|
| none | 1.7 s | 12.4 s | 169.66 GiB | 169.66 GiB (ratio 1.000) | 79.23 GiB | 53.25 GiB |
| full | 8.4 s | 33.3 s | 198.55 GiB | 169.66 GiB (ratio 1.170: the recomputed forward rings again) | 51.23 GiB | 53.25 GiB |

The step compiles and the collectives are exactly the analytical minimum without
remat; by the CPU compiler's estimate it fits an 80 GiB device (99 %) without remat
and with 29 GiB to spare under full remat. (Measured at commit cbf79dd plus the
estimate's blockwise scores; the earlier figures, 448.16 GiB and 419.28 GiB peaks
after 72.7 s and 42.4 s of compiling, came from the blockwise kernel's loops being
scans: inside the layers' scan JAX's partial evaluation hoisted every block pair's
mask out of it, `O(S^2)` per layer. The kernel's loops are while loops now.) The
analytical estimate (`equishard.models.gpt_memory`) counts one block of scores per
sequence, as the blockwise kernel holds; it was 565 GiB when it counted the whole
`[t, S]` score matrix. The minimum does not yet count full remat's second forward ring."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=None, help="comma-separated subset, e.g. 'dp=8;tp=8' (';' between layouts)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each side per layout")
    parser.add_argument("--no-write", dest="write", action="store_false", help="do not write results/ and RESULTS.md")
    parser.add_argument("--skip-extras", action="store_true", help="skip the depth and single-device parts")
    parser.add_argument("--from-results", action="store_true", help="only regenerate RESULTS.md from results/*.json")
    args = parser.parse_args()
    if args.from_results:
        saved = json.loads((RESULTS / "layouts.json").read_text())
        depth = json.loads((RESULTS / "compile_depth.json").read_text())
        single = json.loads((RESULTS / "single_device.json").read_text())
        text = markdown(saved["layouts"], depth, single, saved["environment"], saved["seconds"])
        (HERE / "RESULTS.md").write_text(text)
        print(f"wrote {HERE / 'RESULTS.md'} from {RESULTS}/*.json")
        return
    use_simulated_cpu_devices(8)
    start = time.perf_counter()
    wanted = None if args.layouts is None else set(args.layouts.split(";"))
    layouts = [
        bench_layout(spec, moe, options, args.repeats)
        for spec, moe, options in LAYOUTS
        if wanted is None or spec in wanted
    ]
    depth = single = None
    if not args.skip_extras:
        depth = bench_depth()
        single = bench_single_device(args.repeats)
    seconds = time.perf_counter() - start
    env = environment()
    print(f"done in {seconds / 60:.1f} minutes", flush=True)
    if not args.write:
        return
    complete = wanted is None and depth is not None and single is not None
    if not complete:
        sys.exit("RESULTS.md is only written by a full run (all layouts, depth and single device).")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "layouts.json").write_text(
        json.dumps({"environment": env, "seconds": seconds, "layouts": layouts}, indent=1) + "\n"
    )
    (RESULTS / "compile_depth.json").write_text(json.dumps({"environment": env, **depth}, indent=1) + "\n")  # type: ignore[dict-item]
    (RESULTS / "single_device.json").write_text(json.dumps({"environment": env, **single}, indent=1) + "\n")  # type: ignore[dict-item]
    assert depth is not None and single is not None
    (HERE / "RESULTS.md").write_text(markdown(layouts, depth, single, env, seconds))
    print(f"wrote {RESULTS}/*.json and {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
