"""`equishard inspect` and `equishard plan`: the communication and memory report on the command line.

Both compile — never run — the real train step of the reference GPT under a layout,
with the parameters as shapes only, and print `equishard.report`'s report: every
collective with its mesh axes and bytes per device, the analytical minimum beside the
measured bytes, the compiler's per-device memory and the per-parameter table.
`inspect` uses the simulated devices as `equishard train` does; `plan` simulates as many
CPU devices as the mesh it plans for (thousands) and says whether the step fits a
device's memory, as an estimate from the CPU compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from typing import Any

from ._app._internal import WIDTH as WIDTH
from ._cli_base import HelpFormatter
from ._errors import LayerConfigError, MeshError

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """`"80GiB"`, `"80G"`, `"1.5TiB"` or `"1000000"` as a number of bytes (binary units).

    **Raises:**

    `LayerConfigError` for anything else.
    """
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise LayerConfigError(f"--device-memory {text!r} is not a size such as '80GiB' or '24G'.")
    try:
        value = float(match.group(1))
    except ValueError:
        raise LayerConfigError(f"--device-memory {text!r} is not a size such as '80GiB'.") from None
    if int(value * _UNITS[match.group(2).upper()]) < 1:
        raise LayerConfigError(f"--device-memory {text!r} must be above 0 bytes.")
    return int(value * _UNITS[match.group(2).upper()])


def _layout(args: argparse.Namespace) -> Any:
    """The layout the options name, resolved for `--devices` (checked before JAX starts
    any device: a malformed layout fails first)."""
    from ._app._internal import LayoutOptions, from_args, layout_from_options

    return layout_from_options(from_args(LayoutOptions, args)).resolve(args.devices)


def _cpu_devices(n: int) -> list:
    """`n` CPU devices: simulated as such before JAX starts, else the first `n` it has."""
    import jax

    from ._cli_base import use_cpu_devices

    use_cpu_devices(n)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise MeshError(
            f"JAX has already started with {len(devices)} CPU devices, fewer than the {n} "
            f"asked for; run the command in a fresh process (it simulates the devices "
            f"itself before JAX starts)."
        )
    return devices[:n]


def _compile_report(args: argparse.Namespace, layout: Any = None) -> tuple[Any, dict[str, float], Any]:
    """Compile the reference GPT's step for the options (`layout`: resolved already, or
    `None`) and report on it: `(report, facts, layout)`."""
    from ._app import TrainConfig, make_optimizer
    from .models import abstract_train_step, gpt_report, precision_policy, preset

    # An unknown preset fails before JAX starts.
    config = dataclasses.replace(
        preset(args.model), remat=args.remat, remat_offload=args.remat_offload,
        batch_chunks=args.batch_chunks,
    )  # fmt: skip
    layout = layout or _layout(args)  # a malformed layout too
    devices = _cpu_devices(args.devices)
    train = TrainConfig()  # the optimizer `equishard train` uses, with its defaults
    step = abstract_train_step(
        config, layout, batch_size=args.batch_size, seq_len=args.seq_len,
        optimizer=make_optimizer(train), clip_norm=train.clip_norm, devices=devices,
        param_dtype=args.param_dtype, precision=precision_policy(args.dtype, args.param_dtype),
    )  # fmt: skip
    report, facts = gpt_report(step, name=args.model, optimizer_name="AdamW")
    return report, facts, layout


def _load_factory(spec: str) -> Any:
    """The callable `module:factory` names (the module imported from `sys.path` and the
    current directory)."""
    import importlib
    import sys

    module_name, _, attr = spec.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise LayerConfigError(f"--model {spec!r}: cannot import module {module_name!r} ({err}).") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LayerConfigError(f"--model {spec!r}: module {module_name!r} has no callable {attr!r}.")
    return factory


def _user_report(args: argparse.Namespace) -> tuple[Any, dict[str, float]]:
    """Compile a user's own train step: `factory(layout) -> dict` (see `inspect --help`)."""
    import jax
    import optax

    from .report import report as read_report
    from .report._internal import abstract_state, lower_from_shapes
    from .sharding import make_mesh, param_table
    from .train import init_train_state, make_train_step

    factory = _load_factory(args.model)
    devices = _cpu_devices(args.devices)
    mesh = make_mesh(args.layout, devices=devices)
    parts = factory(args.layout)
    missing = {"make_model", "loss_fn", "batch", "batch_spec"} - set(parts)
    if missing:
        raise LayerConfigError(
            f"--model {args.model!r}: the factory's dict lacks {sorted(missing)} (it gives "
            f"make_model, loss_fn, batch, batch_spec and optionally optimizer, view)."
        )
    optimizer = parts.get("optimizer") or optax.adamw(1e-3)
    # From shapes: the model is traced, never initialised (nor held by this process).
    state = abstract_state(
        lambda: init_train_state(parts["make_model"], optimizer, jax.random.key(0), mesh=mesh), mesh
    )
    step = make_train_step(
        parts["loss_fn"], optimizer, mesh=mesh, batch_spec=parts["batch_spec"], view=parts.get("view", "local")
    )
    start = time.perf_counter()
    lowered = lower_from_shapes(step, state, parts["batch"])
    traced = time.perf_counter()
    compiled = lowered.compile()
    facts = {"lower_seconds": traced - start, "compile_seconds": time.perf_counter() - traced}
    description = f"{args.model}; layout {args.layout} on {args.devices} CPU devices"
    return read_report(compiled, mesh=mesh, params=param_table(state.model, mesh), description=description), facts


def _width(args: argparse.Namespace) -> int | None:
    return None if args.wide else WIDTH


def _verdict(report: Any, device_memory: int | None, width: int | None) -> str:
    """The first line: whether the step fits, and its bytes against the minimum."""
    from ._text import fill, human_bytes

    parts = []
    memory = report.memory
    if memory is not None and device_memory is not None:
        fits = "fits" if memory.peak_bytes <= device_memory else "does NOT fit"
        parts.append(
            f"{fits}: peak {human_bytes(memory.peak_bytes)} per device of "
            f"{human_bytes(device_memory)} ({100 * memory.peak_bytes / device_memory:.1f}%)"
        )
    elif memory is not None:
        parts.append(f"peak memory {human_bytes(memory.peak_bytes)} per device")
    if report.minimum is not None:
        parts.append(
            f"collectives {human_bytes(report.collective_bytes)} per device per step, "
            f"{report.ratio_text} x the analytical minimum ({human_bytes(report.minimum.total)})"
        )
    else:
        parts.append(f"collectives {human_bytes(report.collective_bytes)} per device per step")
    return fill("verdict: " + "; ".join(parts), width)


def _inspect(args: argparse.Namespace) -> int:
    from .report import format_report

    start = time.perf_counter()
    if ":" in args.model:
        if (args.dtype, args.param_dtype) != ("float32", "float32"):
            raise LayerConfigError(
                f"--dtype and --param-dtype apply to the reference GPT's presets; your model "
                f"{args.model!r} decides its own dtypes (cast in its make_model / loss_fn)."
            )
        report, facts = _user_report(args)
    else:
        report, facts, _ = _compile_report(args)
    if not args.params:
        report = dataclasses.replace(report, params=())
    width = _width(args)
    print(_verdict(report, None, width))
    print()
    print(format_report(report, width))
    print(
        f"\ncompiled (not run) in {facts['compile_seconds']:.1f} s after "
        f"{facts['lower_seconds']:.1f} s of tracing; {time.perf_counter() - start:.1f} s in all."
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ._text import fill, human_bytes
    from .report import DEVICE_PROFILES, format_report

    start = time.perf_counter()
    profile = DEVICE_PROFILES[args.device] if args.device is not None else None
    if args.device_memory is not None:
        device_memory = parse_bytes(args.device_memory)
    else:
        device_memory = int(profile.memory_bytes) if profile is not None else 80 * 2**30
    layout = None
    if args.batch_size is None:
        from .models import preset

        preset(args.model)
        layout = _layout(args)
        args.batch_size = layout.data_parallel_size * layout.num_microbatches
    report, facts, layout = _compile_report(args, layout)
    width = _width(args)
    print(_verdict(report, device_memory, width))
    print()
    print(format_report(report, width))
    memory = report.memory
    lines = []
    state = facts["state_bytes"]
    if memory is not None:
        # The state, the batch shard and the counters.
        expected = report.estimate.arguments if report.estimate is not None else state
        lines.append(
            f"parameters + optimizer state per device: {human_bytes(state)} by their specs "
            f"(analytical); the compiled step's arguments {human_bytes(memory.argument_bytes)} "
            f"against {human_bytes(expected)} expected with the batch and counters "
            f"(ratio {memory.argument_bytes / expected:.4f})"
        )
        fits = memory.peak_bytes <= device_memory
        lines.append(
            f"peak per device {human_bytes(memory.peak_bytes)} of {human_bytes(device_memory)}: "
            f"{'fits' if fits else 'does NOT fit'} (an estimate: a GPU or TPU compiler fuses, "
            f"schedules and rematerialises differently)"
        )
    if report.minimum is not None:
        lines.append(
            f"collectives: {human_bytes(report.collective_bytes)} per device per step, "
            f"analytical minimum {human_bytes(report.minimum.total)} "
            f"(ratio {report.ratio_text})"
        )
    print("\nEstimate (from the XLA:CPU compiler, which compiled but never ran the step):")
    for line in lines:
        print(fill("  " + line, width))
    if profile is not None:
        print()
        print("\n".join(fill(line, width) for line in _time_estimate(args, report, profile, state)))
    total = time.perf_counter() - start
    print(
        f"\nplanned in {total:.1f} s ({facts['lower_seconds']:.1f} s tracing, "
        f"{facts['compile_seconds']:.1f} s compiling for {args.devices} devices)"
    )
    return 0


# The step-time model of `plan --device` (the "inspect and plan" guide states its error).
MATMUL_EFFICIENCY = 0.8
"""Matrix products at 0.8 of the dense peak: a bf16 8192³ product measures 790-800 TFLOP/s
of 989 on an H100 and an H200."""
BANDWIDTH_EFFICIENCY = 0.9
"""Memory-bound work at 0.9 of the HBM bandwidth: device copies measure 3.0 of 3.35 TB/s
(H100) and 4.3 of 4.8 TB/s (H200)."""
ELEMENTWISE_BYTES = 5.75
"""HBM bytes moved per elementwise element of a token (`gpt_elementwise_per_token`),
calibrated on the 124 M GPT's measured H100 step (16 x 1024 tokens, bf16)."""
UPDATE_PASSES = 10 / 3
"""HBM passes of the update over the parameters and optimizer state (AdamW in float32
reads and writes master weights and moments, reads the gradient and writes the bf16 copy:
about 40 bytes a parameter against 12 of state)."""


def gpt_elementwise_per_token(config: Any) -> int:
    """Elementwise elements a token costs in a GPT step, forward and backward: per layer
    12 passes over `d_model` (norms, residuals, rotary, casts) and 6 over `d_ff` (the
    SwiGLU product), and 6 over the vocabulary (the loss's softmax and its gradient)."""
    per_layer = 12 * config.d_model + 6 * config.d_ff
    return config.n_layers * per_layer + 6 * config.vocab_size


def step_time_estimate(
    flops_per_device: float,
    bytes_per_device: float,
    profile: Any,
    dtype: str,
    *,
    memory_bytes_per_device: float = 0.0,
) -> dict[str, float]:
    """A step's time on `profile`'s devices, from its model FLOPs, the HBM bytes its
    memory-bound work moves and the bytes each device sends.

    **Returns:**

    `matmul_s` (the FLOPs at `MATMUL_EFFICIENCY` of the peak), `memory_s` (the HBM bytes
    at `BANDWIDTH_EFFICIENCY` of the bandwidth), `compute_s` (their sum),
    `communication_s` (the bytes sent over the link bandwidth), `overlapped_s` (the larger
    of compute and communication: communication hidden), `serial_s` (their sum: none
    hidden), and the MFU each time gives (`mfu_overlapped`, `mfu_serial`).
    """
    peak = profile.peak_flops[dtype]
    matmul = flops_per_device / (MATMUL_EFFICIENCY * peak)
    memory = memory_bytes_per_device / (BANDWIDTH_EFFICIENCY * profile.memory_bandwidth)
    compute = matmul + memory
    communication = bytes_per_device / profile.link_bandwidth
    overlapped, serial = max(compute, communication), compute + communication
    ideal = flops_per_device / peak
    return {
        "matmul_s": matmul,
        "memory_s": memory,
        "compute_s": compute,
        "communication_s": communication,
        "overlapped_s": overlapped,
        "serial_s": serial,
        "mfu_overlapped": ideal / overlapped if overlapped else 0.0,
        "mfu_serial": ideal / serial if serial else 0.0,
    }


def gpt_step_estimate(
    config: Any, seq_len: int, tokens_per_device: float | int, state_bytes: float | int, profile: Any,
    dtype: str, bytes_sent: float | int = 0.0,
) -> dict[str, float]:  # fmt: skip
    """`step_time_estimate` of a GPT step: `tokens_per_device` tokens' model FLOPs and
    elementwise bytes, and the update's passes over `state_bytes` of parameters and
    optimizer state per device."""
    from .models import gpt_flops_per_token

    flops = gpt_flops_per_token(config, seq_len) * tokens_per_device
    memory = tokens_per_device * ELEMENTWISE_BYTES * gpt_elementwise_per_token(config)
    memory += UPDATE_PASSES * state_bytes
    return step_time_estimate(
        float(flops), float(bytes_sent), profile, dtype, memory_bytes_per_device=float(memory)
    )


def _time_estimate(args: argparse.Namespace, report: Any, profile: Any, state: float) -> list[str]:
    from .models import preset

    tokens = args.batch_size * args.seq_len
    config = preset(args.model)
    e = gpt_step_estimate(
        config, args.seq_len, tokens / args.devices, state, profile, args.dtype,
        report.collective_bytes,
    )  # fmt: skip
    return [
        f"Step time on {args.devices} x {profile.description} (an estimate, not a measurement):",
        f"  matrix products: {e['matmul_s'] * MATMUL_EFFICIENCY * profile.peak_flops[args.dtype] / 1e12:,.3g} "
        f"TFLOP of model FLOPs per device at {MATMUL_EFFICIENCY:.0%} of "
        f"{profile.peak_flops[args.dtype] / 1e12:,.0f} TFLOP/s ({args.dtype} peak) = {_duration(e['matmul_s'])}",
        f"  memory-bound work: {e['memory_s'] * BANDWIDTH_EFFICIENCY * profile.memory_bandwidth / 1e9:,.3g} GB "
        f"of HBM traffic per device at {BANDWIDTH_EFFICIENCY:.0%} of "
        f"{profile.memory_bandwidth / 1e12:,.2f} TB/s = {_duration(e['memory_s'])}",
        f"  communication: {report.collective_bytes / 2**20:,.1f} MiB per device at "
        f"{profile.link_bandwidth / 1e9:,.0f} GB/s = {_duration(e['communication_s'])}",
        f"  estimated step time {_duration(e['overlapped_s'])} to {_duration(e['serial_s'])}, "
        f"MFU {100 * e['mfu_serial']:.1f}% to {100 * e['mfu_overlapped']:.1f}%, "
        f"{tokens / e['serial_s']:,.0f} to {tokens / e['overlapped_s']:,.0f} tokens/s",
        "  assumptions: calibrated on one H100 (the 124 M GPT's bf16 step; within 12% of the "
        "measured 350 M and 1.3 B steps): matrix products at 80% of the peak, elementwise "
        "work per token from the layer sizes at 90% of the HBM bandwidth, the update's "
        "passes over the parameters and optimizer state; model FLOPs 6N + 12 L d T per "
        "token (no recomputation); the collectives' ring-algorithm bytes at the per-device "
        "link bandwidth, hidden behind compute (the lower time) or not at all (the higher); "
        "no pipeline bubble, host or input time.",
    ]


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:,.1f} ms"
    return f"{seconds * 1e6:,.1f} us"


def _model_names() -> list[str]:
    from .models import PRESETS

    return list(PRESETS)


def add_report_parsers(sub: Any) -> None:
    """Add the `inspect` and `plan` subcommands to the `equishard` parser, their options
    generated from `InspectConfig` and `PlanConfig`."""
    from ._app._internal import InspectConfig, PlanConfig, add_options

    p = sub.add_parser(
        "inspect",
        help="compile the reference GPT's train step under a layout and report its collectives and memory",
        description=(
            "Compile (never run) the train step `equishard train` runs, for the reference GPT "
            "under a layout on simulated CPU devices, and print every collective (kind, mesh "
            "axes, shapes, count, bytes each device sends under ring algorithms), the "
            "analytical minimum beside the measured bytes, the compiler's per-device memory "
            "and the per-parameter table."
        ),
        formatter_class=HelpFormatter,
    )
    add_options(p, InspectConfig)
    p.set_defaults(run=_inspect)

    p = sub.add_parser(
        "plan",
        help="compile a train step for a virtual mesh of up to thousands of devices; memory and communication estimate",
        description=(
            "Compile (never run) the reference GPT's real train step for a virtual mesh of N "
            "simulated CPU devices, with parameters that exist only as shapes, and print the "
            "report of `equishard inspect`, the analytical estimate, and whether the step "
            "fits the given device memory (an estimate from the CPU compiler)."
        ),
        formatter_class=HelpFormatter,
    )
    add_options(p, PlanConfig)
    p.set_defaults(run=_plan, params=True)
