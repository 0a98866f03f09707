"""What `equishard train` shows and writes: the step log, its throughput and MFU, the
metrics file."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from equishard._app import TrainConfig, run
from equishard.models import PRESETS
from equishard.report import DeviceProfile, device_profile, gpt_flops_per_token

STEP_SECONDS = 0.5
PEAK = 2e9  # FLOP/s of the injected device: MFU comes out well above 0 on the CPU
PROFILE = DeviceProfile("test", "a test device", {"float32": PEAK}, 2.0**30, 1e9, 1e9)
TINY = TrainConfig(
    model="tiny", layout="dp=2,fsdp=2,tp=2", steps=4, batch_size=8, seq_len=32,
    eval_every=2, checkpoint_every=2, log_every=2, sample_bytes=0, progress=False, plot=False,
)  # fmt: skip


class FakeClock:
    """Each reading is `STEP_SECONDS` after the previous one: a step (two readings) lasts
    exactly `STEP_SECONDS`, and so does every other timed phase."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return next(self._ticks) * STEP_SECONDS


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("output") / "run"
    lines: list[str] = []
    summary = run(
        dataclasses.replace(TINY, run_dir=str(run_dir)), print_fn=lines.append, clock=FakeClock(),
        profile=PROFILE,
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, lines, rows, run_dir


def test_flops_per_token_is_6n_plus_attention():
    c = PRESETS["tiny"]  # d_model 64, 2 layers, d_ff 128, 256 bytes
    matmul = c.n_layers * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 256  # blocks, then the head
    assert gpt_flops_per_token(c, 32) == 6 * matmul + 12 * 2 * 64 * 32


def test_device_profiles_from_device_kinds():
    kinds = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "TPU v5 lite": "tpu-v5e",
             "TPU v5p": "tpu-v5p", "TPU v5": "tpu-v5p", "h100": "h100"}  # fmt: skip
    for kind, name in kinds.items():
        profile = device_profile(kind)
        assert profile is not None and profile.name == name, kind
    assert device_profile("cpu") is None


def test_every_step_row_has_the_step_log_fields(tiny_run):
    _, _, rows, _ = tiny_run
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    fields = {"step", "loss", "grad_norm", "lr", "step_time", "tokens", "tokens_per_s",
              "tflops_per_device", "mfu", "time"}  # fmt: skip
    for row in steps:
        assert fields <= set(row), fields - set(row)
        assert "peak_memory_bytes" not in row  # the CPU reports none: left out, never 0
    assert [row["step"] for row in rows if "val_loss" in row] == [2, 4]
    assert steps[0]["lr"] == 0.0 and steps[1]["lr"] > 0  # the warmup starts at 0


def test_tokens_per_second_counts_training_steps_only(tiny_run):
    summary, lines, rows, _ = tiny_run
    tokens_per_step = TINY.batch_size * TINY.seq_len
    assert summary["train_seconds"] == TINY.steps * STEP_SECONDS
    assert summary["tokens_per_s"] == TINY.steps * tokens_per_step / summary["train_seconds"]
    timings = summary["timings"]
    # Compilation, evaluation, checkpoints and export were timed apart from the steps.
    assert timings["train"] == summary["train_seconds"]
    for phase in ("compile", "evaluation", "checkpoint", "export"):
        assert timings[phase] > 0, phase
    assert summary["seconds"] > sum(timings.values()) - 1e-9
    for row in rows:
        if "loss" in row:
            assert row["step_time"] == STEP_SECONDS
            assert row["tokens_per_s"] == tokens_per_step / STEP_SECONDS
    done = next(line for line in lines if line.startswith("done:"))
    assert f"{tokens_per_step / STEP_SECONDS:,.0f} tokens/s" in done


def test_mfu_is_model_flops_over_the_device_peak(tiny_run):
    summary, lines, rows, _ = tiny_run
    flops = gpt_flops_per_token(PRESETS["tiny"], TINY.seq_len)
    per_device = summary["tokens_per_s"] * flops / 8
    for row in rows:
        if "loss" in row:
            assert math.isclose(row["tflops_per_device"], per_device / 1e12, rel_tol=1e-12)
            assert math.isclose(row["mfu"], per_device / PEAK, rel_tol=1e-12)
    logged = [line for line in lines if line.startswith("step ") and "loss " in line and "/4" in line]
    assert [line.split()[1] for line in logged] == ["2/4", "4/4"]
    assert all(f"MFU {100 * per_device / PEAK:.1f}%" in line for line in logged)


def test_the_output_has_no_placeholders(tiny_run):
    _, lines, _, _ = tiny_run
    text = "\n".join(lines)
    assert "compiling the train step..." in lines
    assert any(line.startswith("compiled the train step in ") for line in lines)
    assert "nan" not in text.lower()
    assert "tokens/s 0 " not in text and " 0 tokens/s" not in text
