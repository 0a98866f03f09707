"""Regenerate the documentation's figures (`docs/figures/*.png`) from equishard itself.

    python docs/make_figures.py                  # every figure (trains the main job: minutes)
    python docs/make_figures.py --skip-training  # the figures that need no training (seconds)

Nothing is drawn by hand: each picture is computed by the library's own functions on 8
simulated CPU devices and plotted with matplotlib.

- `specs.png`: how an 8 x 8 array is split over a (dp=2, tp=4) mesh for common specs
  (`equishard.shard`, then the devices' shards of the placed array).
- `collective_matmul.png`: the ring steps of `equishard.core.all_gather_matmul` (which
  block of `w` each device holds at each step, found by running `ring_shift`), and
  why the ring overlaps communication with compute.
- `pipeline_schedule.png`: the five pipeline schedules' tables as timelines
  (`equishard.core.pipeline_schedule`).
- `zigzag.png`: which tokens each device of a `cp` axis holds under the contiguous and
  the zigzag split (`equishard.core.zigzag_indices`), and the causal block pairs each
  device's ring computes (`equishard.core.ring_attention_block_pairs`).
- `loss_curves.png`: the main job (`equishard train`, default options) and the first
  steps of the same model under several layouts (`equishard train`'s job).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

import equishard as es  # noqa: E402
from equishard.core import pipeline_schedule, ring_shift  # noqa: E402

FIGURES = pathlib.Path(__file__).resolve().parent / "figures"
DPI = 200  # 2x: sharp on high-density screens
COLORS = plt.get_cmap("tab10").colors


def _save(fig: plt.Figure, name: str) -> None:
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path.relative_to(FIGURES.parent.parent)} ({path.stat().st_size // 1024} KiB)")


# ----------------------------------------------------------------------------- specs


def specs_figure() -> None:
    mesh = es.make_mesh("dp=2,tp=4")
    ids = np.asarray(mesh.device_ids)  # [dp, tp]
    specs = [P(), P("dp", None), P(None, "tp"), P("dp", "tp"), P("tp", "dp"),
             P(("dp", "tp"), None), P(("tp", "dp"), None)]
    fig, axes = plt.subplots(2, 4, figsize=(9.5, 5.6))
    axes = axes.ravel()

    ax = axes[0]  # the mesh itself
    for (i, j), d in np.ndenumerate(ids):
        ax.add_patch(Rectangle((j, 1 - i), 1, 1, facecolor=COLORS[d % 10], alpha=0.55, edgecolor="k"))
        ax.text(j + 0.5, 1.5 - i, f"{d}", ha="center", va="center", fontsize=11)
    ax.set_xlim(0, 4), ax.set_ylim(0, 2)
    ax.set_title("mesh dp=2, tp=4\n(device ids)", fontsize=9)
    ax.set_xlabel("tp →", fontsize=8), ax.set_ylabel("← dp", fontsize=8)
    ax.set_xticks([]), ax.set_yticks([]), ax.set_aspect("equal")

    x = jnp.arange(64.0).reshape(8, 8)
    for ax, spec in zip(axes[1:], specs):
        placed = es.shard(es.Sharded(x, spec), mesh).value
        owners: dict[tuple, list[int]] = {}
        for shard in placed.addressable_shards:
            rows, cols = shard.index
            key = (rows.start or 0, rows.stop or 8, cols.start or 0, cols.stop or 8)
            owners.setdefault(key, []).append(shard.device.id)
        for (r0, r1, c0, c1), devices in owners.items():
            color = COLORS[min(devices) % 10] if len(owners) > 1 else "0.85"
            ax.add_patch(Rectangle((c0, 8 - r1), c1 - c0, r1 - r0, facecolor=color, alpha=0.55, edgecolor="k"))
            label = ",".join(map(str, sorted(devices)))
            if len(devices) > 4:
                label = "all 8"
            ax.text((c0 + c1) / 2, 8 - (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
        block = placed.addressable_shards[0].data.shape
        ax.set_xlim(0, 8), ax.set_ylim(0, 8), ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_title(f"{str(spec).removeprefix('PartitionSpec')}\nblock {block[0]}x{block[1]}", fontsize=9)
    fig.suptitle("An 8 x 8 array placed by es.shard: which devices hold each block", fontsize=10)
    _save(fig, "specs.png")


# ----------------------------------------------------------------- collective matmul


def collective_matmul_figure() -> None:
    n = 4
    mesh = es.make_mesh(f"x={n}")

    # Which block of w each device holds at each step: device d starts with block d
    # and passes what it holds one place up the ring after each step (ring_shift).
    def holdings(block_ids):
        held = [block_ids]
        for _ in range(n - 1):
            held.append(ring_shift(held[-1], "x", 1))
        return jnp.stack(held, axis=1)  # [1, steps]

    table = es.filter_shard_map(holdings, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.arange(n))
    table = np.asarray(table)  # [device, step]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.5, 6.2), gridspec_kw={"height_ratios": [3, 1.4]})
    for d in range(n):
        for s in range(n):
            j = int(table[d, s])
            top.add_patch(Rectangle((s * 2, (n - 1 - d)), 1.6, 0.8, facecolor=COLORS[j], alpha=0.55, edgecolor="k"))
            top.text(s * 2 + 0.8, n - 1 - d + 0.4, f"x[:, {j}] @ w{j}", ha="center", va="center", fontsize=8)
            if s < n - 1:
                top.add_patch(FancyArrowPatch((s * 2 + 1.6, n - 1 - d + 0.4), (s * 2 + 2.0, n - 1 - ((d + 1) % n) + 0.4),
                                              arrowstyle="-|>", mutation_scale=8, color="0.4"))
    top.set_xlim(-0.2, 2 * n), top.set_ylim(-0.2, n)
    top.set_yticks([n - 1 - d + 0.4 for d in range(n)], [f"device {d}" for d in range(n)])
    top.set_xticks([s * 2 + 0.8 for s in range(n)], [f"step {s}" for s in range(n)])
    top.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        top.spines[side].set_visible(False)
    top.set_title("all_gather_matmul(x, w, 'x', gathered='w'): each step multiplies the block of w it holds\n"
                  "and passes it on (arrows: ring_shift); after n steps every product is summed", fontsize=9)

    # One device's timeline: plain (gather, then matmul) vs ring (step s's matmul while
    # block s + 1 travels). Schematic durations: one unit per block sent or multiplied.
    rows = {"all_gather, then matmul": [("send", s, 1) for s in range(n - 1)] + [("mm", n - 1 + s, 1) for s in range(n)],
            "all_gather_matmul (ring)": [("send", s, 1) for s in range(n - 1)] + [("mm", s, 1) for s in range(n)]}
    for r, (name, spans) in enumerate(rows.items()):
        for kind, start, length in spans:
            y = 1 - r + (0.25 if kind == "send" else 0)
            color = "tab:orange" if kind == "send" else "tab:blue"
            bottom.add_patch(Rectangle((start, y), length * 0.95, 0.22, facecolor=color, alpha=0.8))
    bottom.set_xlim(0, 2 * n - 1), bottom.set_ylim(-0.1, 1.6)
    bottom.set_yticks([1.23, 0.23], list(rows))
    bottom.set_xlabel("time (schematic: one unit per block sent or multiplied)", fontsize=8)
    bottom.legend(handles=[Rectangle((0, 0), 1, 1, color="tab:orange"), Rectangle((0, 0), 1, 1, color="tab:blue")],
                  labels=["send a block (collective-permute)", "multiply a block"], loc="upper right", fontsize=7)
    bottom.set_title("on an accelerator the ring hides the sends behind the multiplies", fontsize=9)
    fig.tight_layout()
    _save(fig, "collective_matmul.png")


# ------------------------------------------------------------------- pipeline schedule


def pipeline_figure() -> None:
    from equishard.core import SCHEDULES, schedule_report

    s, m = 4, 8
    tables = {
        name: pipeline_schedule(name, s, m, repeats=2 if name in ("circular", "interleaved-1f1b") else 1)
        for name in SCHEDULES
    }
    # A step of a schedule with R stages per device runs 1/R of a device's layers:
    # draw it 1/R wide, so that the x axis is time and the schedules compare.
    end = max(t.num_steps / t.repeats for t in tables.values())
    fig, axes = plt.subplots(len(tables), 1, figsize=(10, 9), sharex=True)
    for ax, (name, sch) in zip(axes, tables.items()):
        w = 1 / sch.repeats
        for t in range(sch.num_steps):
            for d in range(s):
                op, mb, v = int(sch.op[t, d]), int(sch.microbatch[t, d]), int(sch.virtual[t, d])
                box = (t * w, s - 1 - d)
                if op == 0:
                    ax.add_patch(Rectangle(box, w * 0.97, 0.9, facecolor="0.95", edgecolor="0.85"))
                    continue
                ax.add_patch(Rectangle(box, w * 0.97, 0.9, facecolor=COLORS[mb % 10],
                                       alpha={1: 0.35, 2: 0.8, 3: 0.55}[op], edgecolor="k",
                                       hatch={1: None, 2: None, 3: "//"}[op] if v <= 0 else "..", lw=0.5))
                label = "FBW"[op - 1] + (f"{mb}" if sch.repeats == 1 else f"{mb}\n{v}")
                ax.text(t * w + w / 2, s - 1 - d + 0.45, label, ha="center", va="center", fontsize=5)
        ax.set_ylim(0, s), ax.set_xlim(0, end)
        ax.set_yticks([s - 1 - d + 0.45 for d in range(s)], [f"dev {d}" for d in range(s)], fontsize=7)
        rep = schedule_report(sch)
        ax.set_title(f"{name} (S={s}, M={m}, R={sch.repeats}): bubble {rep.bubble_fraction:.3f}, "
                     f"peak in flight {list(rep.peak_in_flight)}", fontsize=8)
    axes[-1].set_xlabel("step (a step with R stages per device drawn 1/R wide)", fontsize=8)
    fig.suptitle("pipeline_schedule: forward F, backward B, weight gradient W of each micro-batch; grey = idle",
                 fontsize=9)
    fig.tight_layout()
    _save(fig, "pipeline_schedule.png")


# ------------------------------------------------------------------------- zigzag split


def zigzag_figure() -> None:
    from equishard.core import ring_attention_block_pairs, zigzag_indices

    cp, seq, block = 4, 32, 4
    mesh = es.make_mesh(f"cp={cp}")
    spec = P(None, "cp", None, None)
    q = jnp.zeros((1, seq, 1, 8))
    orders = {"contiguous": np.arange(seq), "zigzag": zigzag_indices(seq, cp)}
    counts = {}
    for layout in orders:
        fn = jax.shard_map(
            lambda q, k, v, layout=layout: ring_attention_block_pairs(q, k, v, "cp", layout=layout, block_size=block)[None],
            mesh=mesh, in_specs=(spec,) * 3, out_specs=P("cp"),
        )  # fmt: skip
        counts[layout] = np.asarray(jax.jit(fn)(q, q, q))
    fig, axes = plt.subplots(2, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    local = seq // cp
    for row, (layout, order) in enumerate(orders.items()):
        ax = axes[row, 0]
        for slot, token in enumerate(order):
            device = slot // local
            ax.add_patch(Rectangle((token, 0), 0.95, 1, facecolor=COLORS[device], edgecolor="k", lw=0.3))
            ax.text(token + 0.47, 0.5, str(device), ha="center", va="center", fontsize=6)
        ax.set_xlim(0, seq), ax.set_ylim(0, 1), ax.set_yticks([])
        ax.set_title(f"{layout}: the device holding each token (S={seq}, cp={cp})", fontsize=8)
        bar = axes[row, 1]
        bar.bar(range(cp), counts[layout], color=[COLORS[d] for d in range(cp)])
        bar.set_xticks(range(cp), [f"dev {d}" for d in range(cp)], fontsize=7)
        bar.set_title(f"causal block pairs computed (max/min {counts[layout].max() / counts[layout].min():.2f})", fontsize=8)
    axes[1, 0].set_xlabel("token position", fontsize=8)
    fig.suptitle("the zigzag split: device i holds chunks i and 2cp-1-i, so every device does the same causal work",
                 fontsize=9)
    fig.tight_layout()
    _save(fig, "zigzag.png")


# ------------------------------------------------------------------------ loss curves


def _train(workdir: pathlib.Path, name: str, **options) -> list[dict]:
    from equishard._app import TrainConfig, run

    run_dir = workdir / name
    config = TrainConfig(run_dir=str(run_dir), progress=False, plot=False, sample_bytes=0, **options)
    run(config, print_fn=lambda *_: None)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loss_figure(workdir: pathlib.Path) -> None:
    main_job = _train(workdir, "main")  # `equishard train` with its default options
    layouts = ["dp=8", "fsdp=8", "tp=8", "pp=2,dp=2,tp=2"]
    short = {spec: _train(workdir, spec.replace(",", "_").replace("=", ""), layout=spec, steps=30, eval_every=10**6)
             for spec in layouts}

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    train = [(r["step"], r["loss"]) for r in main_job if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in main_job if "val_loss" in r]
    left.plot(*zip(*train), label="train", lw=1)
    left.plot(*zip(*val), "o-", label="validation")
    left.set_xlabel("step"), left.set_ylabel("loss (nats per byte)")
    left.set_title("equishard train (default options, layout dp=2,fsdp=2,tp=2)", fontsize=9)
    left.grid(alpha=0.3), left.legend()
    for i, (spec, rows) in enumerate(short.items()):
        curve = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        right.plot(*zip(*curve), lw=2.5 - 0.5 * i, ls=["-", "--", ":", "-."][i], label=spec)
    right.set_xlabel("step"), right.set_title("the first 30 steps under four layouts: one curve", fontsize=9)
    right.grid(alpha=0.3), right.legend()
    fig.tight_layout()
    _save(fig, "loss_curves.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-training", action="store_true", help="keep loss_curves.png as it is")
    args = parser.parse_args()
    specs_figure()
    collective_matmul_figure()
    pipeline_figure()
    zigzag_figure()
    if not args.skip_training:
        with tempfile.TemporaryDirectory() as workdir:
            loss_figure(pathlib.Path(workdir))


if __name__ == "__main__":
    main()
