"""The step log of `equishard train`: what each logged step prints and writes.

Every `--log-every` steps one line (and one `metrics.jsonl` row per step): step, loss,
gradient norm, learning rate, step time, tokens/s, model TFLOP/s per device, MFU where
the device's peak is known, and peak device memory where the backend reports it. A value
that does not exist yet is left out, never printed as `nan` or `0`. The "Reading the
train output" guide explains each field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from .._text import human_bytes
from ..report import DeviceProfile, mfu


@dataclasses.dataclass
class Throughput:
    """Training time and tokens, counted over training steps only (no compilation,
    evaluation, checkpoint or export time).

    **Fields:**

    - `tokens_per_step`: global batch x sequence length.
    - `flops_per_token`: model FLOPs of one training token (`gpt_flops_per_token`).
    - `num_devices`: devices the step runs on.
    - `profile`: the device's profile, or `None` where no peak is known (no MFU).
    - `dtype`: the compute dtype name (which peak MFU is measured against).
    """

    tokens_per_step: int
    flops_per_token: int
    num_devices: int
    profile: DeviceProfile | None
    dtype: str
    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float) -> None:
        """Count one training step that took `seconds`."""
        self.seconds += seconds
        self.steps += 1

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        """`tokens_per_s`, `tflops_per_device` and (with a profile) `mfu` of `steps`
        training steps that took `seconds`; empty before any time has passed."""
        if steps < 1 or seconds <= 0:
            return {}
        tokens_per_s = self.tokens_per_step * steps / seconds
        flops = tokens_per_s * self.flops_per_token / self.num_devices
        out = {"tokens_per_s": tokens_per_s, "tflops_per_device": flops / 1e12}
        if self.profile is not None:
            out["mfu"] = mfu(flops, self.profile, self.dtype)
        return out

    def total(self) -> dict[str, float]:
        """The rates over every training step so far."""
        return self.rates(self.steps, self.seconds)


def device_memory_stat(devices: list[Any], key: str) -> list[int]:
    """`memory_stats()[key]` of each device that reports it (none on the CPU)."""
    values = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without the query raises rather than returning None
            stats = None
        if stats and key in stats:
            values.append(int(stats[key]))
    return values


def peak_memory_bytes(devices: list[Any] | None = None) -> int | None:
    """The largest peak of memory in use over this process's devices, or `None` where the
    backend reports none (the CPU)."""
    peaks = device_memory_stat(jax.local_devices() if devices is None else devices, "peak_bytes_in_use")
    return max(peaks) if peaks else None


def step_line(row: dict[str, Any], steps: int) -> str:
    """One step-log line from a `metrics.jsonl` row (fields it lacks are left out)."""
    width = len(str(steps))
    parts = [f"step {row['step']:>{width}}/{steps}", f"loss {row['loss']:.4f}"]
    if "grad_norm" in row:
        parts.append(f"grad_norm {row['grad_norm']:.3f}")
    if "lr" in row:
        parts.append(f"lr {row['lr']:.2e}")
    if "step_time" in row:
        parts.append(f"step {_seconds(row['step_time'])}")
    if "tokens_per_s" in row:
        parts.append(f"tokens/s {row['tokens_per_s']:,.0f}")
    if "tflops_per_device" in row:
        parts.append(f"TFLOP/s/device {row['tflops_per_device']:.3g}")
    if "mfu" in row:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if "peak_memory_bytes" in row:
        parts.append(f"memory {human_bytes(row['peak_memory_bytes'])}")
    if row.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return "  ".join(parts)


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"  # one unit, so that lines compare at a glance


def time_summary(seconds: dict[str, float], total: float) -> str:
    """`compile 12.0 s, train 30.1 s, evaluation 2.0 s, ...; 45.3 s in all` (phases with
    no time left out)."""
    parts = [f"{name} {value:.1f} s" for name, value in seconds.items() if value > 0]
    return ", ".join(parts) + f"; {total:.1f} s in all"


def rate_summary(rates: dict[str, float]) -> str:
    """`16,640 tokens/s, 0.21 TFLOP/s per device, MFU 21.3%` (what exists)."""
    if not rates:
        return "no timed training step"
    text = f"{rates['tokens_per_s']:,.0f} tokens/s, {rates['tflops_per_device']:.3g} TFLOP/s per device"
    if "mfu" in rates:
        text += f", MFU {100 * rates['mfu']:.1f}%"
    return text


Clock = Callable[[], float]
