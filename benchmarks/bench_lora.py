"""LoRA against full fine-tuning: the gpt2-small train step's memory, time and checkpoints.

The reference GPT's `gpt2-small` preset (124 M parameters, tied embeddings) under one
layout (`--layout`, default `fsdp=8` on 8 simulated CPU devices), one batch (`--batch`
sequences of `--seq` tokens), float32, AdamW, trained two ways by `gpt_training`: every
array (full fine-tuning), and rank-`--rank` LoRA adapters on q and v with the base frozen
(`lora=LoRA(rank, targets=("q", "v"))`). For each, per device from the compiled program's
`memory_analysis()`: the arguments (the state's blocks and the batch's) and the
temporaries, and XLA's FLOP count (`cost_analysis()`); the optimizer state's bytes (global); the step time (the median of
`--steps` steps after the compiled step's first call); and the bytes on disk of a
`Checkpointer` checkpoint of the state: the whole state, and for LoRA also the adapters
alone (`save(..., trainable=adapters_trainable())`, with the base's fingerprint) and the
PEFT export (`export_peft`). The machine's load average is printed with the table: on a
shared machine the times move with it.

    python benchmarks/bench_lora.py              # about 4 minutes on 2 cores
    python benchmarks/bench_lora.py --steps 1    # fewer timed steps
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from _common import use_simulated_cpu_devices


def _folder_bytes(folder: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _measure(name, training, batch, steps: int, root: pathlib.Path, lora: bool) -> dict:
    """One way of training: memory, optimizer state, step time and checkpoint bytes."""
    import equinox as eqx
    import jax

    import equishard as es
    from equishard.models import adapters_trainable, export_peft
    from equishard.train import Checkpointer

    start = time.perf_counter()
    state = training.init_state(jax.random.key(0))
    compiled = training.step.compile(state, batch)
    compile_s = time.perf_counter() - start
    memory = compiled.compiled.memory_analysis()
    arrays = lambda tree: [x for x in jax.tree.leaves(es.unbox(tree)) if eqx.is_array(x)]  # noqa: E731
    row = {
        "name": name,
        "args": memory.argument_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "opt_state": sum(x.nbytes for x in arrays(state.opt_state)),
        "compile_s": compile_s,
        # XLA's count for one device's program (a loop's body counted once)
        "flops": float(compiled.compiled.cost_analysis().get("flops", float("nan"))),
    }
    state, metrics = compiled(state, batch)  # the first call (not timed)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - begin)
    row["step_s"] = statistics.median(times)
    row["loss"] = float(metrics["loss"])
    with Checkpointer(root / f"{name}-full", async_save=False) as ckpt:
        ckpt.save(1, state)
    row["ckpt"] = _folder_bytes(root / f"{name}-full")
    shutil.rmtree(root / f"{name}-full")
    if lora:
        with Checkpointer(root / f"{name}-adapters", async_save=False) as ckpt:
            ckpt.save(1, state, trainable=adapters_trainable(), base_source="random init")
        row["adapter_ckpt"] = _folder_bytes(root / f"{name}-adapters")
        export_peft(state.model, str(root / "peft"), base_model_name_or_path="random init")
        row["peft"] = _folder_bytes(root / "peft")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small", help="a preset of equishard.models.PRESETS")
    parser.add_argument("--layout", default="fsdp=8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)

    import jax
    import optax

    import equishard as es
    from equishard.models import PRESETS, LoRA, gpt_training

    load_before = os.getloadavg()
    started = time.perf_counter()
    config = PRESETS[args.model]
    layout = es.Layout(args.layout).resolve()
    mesh = layout.mesh()
    batch = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, config.vocab_size)
    optimizer = optax.adamw(1e-4)
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        lora = LoRA(args.rank, alpha=2.0 * args.rank, targets=("q", "v"))
        rows = [
            _measure(f"LoRA r={args.rank} q,v", gpt_training(config, layout, mesh, optimizer, lora=lora), batch, args.steps, root, True),
            _measure("full fine-tuning", gpt_training(config, layout, mesh, optimizer), batch, args.steps, root, False),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    mib = lambda b: f"{b / 2**20:,.2f}"  # noqa: E731
    lo, full = rows
    print(
        f"{args.model}, {args.layout} on {len(jax.devices())} {jax.devices()[0].platform} devices, batch "
        f"{args.batch} x {args.seq} tokens, float32, AdamW; {args.steps} timed steps; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {time.perf_counter() - started:.0f} s in all"
    )
    print()
    print(f"| measure | {lo['name']} | {full['name']} | LoRA / full |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("args", "arguments per device (MiB)"),
        ("temp", "temporaries per device (MiB)"),
        ("opt_state", "optimizer state, global (MiB)"),
        ("ckpt", "checkpoint of the whole state (MiB)"),
    ):
        print(f"| {label} | {mib(lo[key])} | {mib(full[key])} | {lo[key] / full[key]:.4f} |")
    print(f"| adapter-only checkpoint (MiB) | {mib(lo['adapter_ckpt'])} | | {lo['adapter_ckpt'] / full['ckpt']:.4f} |")
    print(f"| PEFT export (MiB) | {mib(lo['peft'])} | | {lo['peft'] / full['ckpt']:.4f} |")
    print(f"| FLOPs per device, XLA's count (G) | {lo['flops'] / 1e9:,.1f} | {full['flops'] / 1e9:,.1f} | {lo['flops'] / full['flops']:.2f} |")
    print(f"| step time, median (s) | {lo['step_s']:.2f} | {full['step_s']:.2f} | {lo['step_s'] / full['step_s']:.2f} |")
    print(f"| compile time (s) | {lo['compile_s']:.1f} | {full['compile_s']:.1f} | |")
    print()
    print(
        f"adapter checkpoint / whole LoRA-state checkpoint: {lo['adapter_ckpt'] / lo['ckpt']:.4f}; "
        f"/ full fine-tuning checkpoint: {lo['adapter_ckpt'] / full['ckpt']:.4f}"
    )


if __name__ == "__main__":
    main()
