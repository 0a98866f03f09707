"""What `equishard train` shows and writes: the step log, its throughput and MFU, the
metrics file."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import shutil
import struct

import pytest

from equishard import LayerConfigError
from equishard._app import TrainConfig, run
from equishard._app._run import check_options
from equishard._cli import main
from equishard.models import PRESETS, gpt_flops_per_token
from equishard.report import DeviceProfile, device_profile

STEP_SECONDS = 0.5
PEAK = 2e9  # FLOP/s of the injected device: MFU comes out well above 0 on the CPU
PROFILE = DeviceProfile("test", "a test device", {"float32": PEAK}, 2.0**30, 1e9, 1e9)
TINY = TrainConfig(
    model="tiny", layout="dp=2,fsdp=2,tp=2", steps=4, batch_size=8, seq_len=32,
    eval_every=2, checkpoint_every=2, log_every=2, sample_bytes=0, progress=False, plot=False,
    profile="1:3",
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


def test_matmul_parameters_are_the_models_but_embedding_and_norms():
    """`N` of 6N counts every weight a token is multiplied by: the model's parameters
    less the embedding lookup and the norms (Llama 3 8B: grouped-query attention)."""
    import equinox as eqx
    import jax

    from equishard.models import GPT, gpt_matmul_parameters

    for name in ("tiny", "llama3-8b"):
        c = PRESETS[name]
        model = eqx.filter_eval_shape(lambda: GPT(c, key=jax.random.key(0)))
        leaves = jax.tree_util.tree_leaves_with_path(model)
        count = sum(x.size for path, x in leaves if "embed" not in jax.tree_util.keystr(path)
                    and "norm" not in jax.tree_util.keystr(path))  # fmt: skip
        head = c.d_model * c.vocab_size if c.tied else 0  # a tied head is the embedding
        assert gpt_matmul_parameters(c) == count + head, name


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


def _losses(run_dir: pathlib.Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def test_the_saved_config_runs_the_same_run_again(tiny_run, tmp_path):
    _, _, _, run_dir = tiny_run
    saved = (run_dir / "config.toml").read_text()
    assert 'layout = "dp=2,fsdp=2,tp=2"' in saved and "steps = 4" in saved
    again = tmp_path / "again"
    assert main(["train", "--config", str(run_dir / "config.toml"), "--run-dir", str(again)]) == 0
    assert _losses(again) == _losses(run_dir)  # bit for bit
    assert (again / "config.toml").read_text() == saved.replace(str(run_dir), str(again))


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "text, flags, message",
    [
        ("steps = 0", [], "--steps must be at least 1, got 0."),  # as the flag says it
        ("steps = 3", ["--steps", "0"], "--steps must be at least 1, got 0."),  # flags win
        ("steps = 0\nlr = -1.0", ["--steps", "3"], "--lr must be a finite number above 0, got -1.0."),
        ("stepz = 3", [], "unknown option 'stepz'; the options are"),
        ('steps = "ten"', [], "steps (--steps) must be an integer, got 'ten'."),
        ("seed = 1.5", [], "seed (--seed) must be an integer, got 1.5."),
        ("steps = [", [], "not valid TOML"),
    ],
)
def test_config_files_are_checked_like_flags(text, flags, message, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    argv = ["train", "--config", str(path), "--run-dir", str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    err = _error(capsys)
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_resume_names_the_step_the_layout_and_what_changed(tiny_run, tmp_path, capsys):
    _, _, _, run_dir = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    argv = ["train", "--config", str(copy / "config.toml"), "--run-dir", str(copy), "--resume",
            "--steps", "5", "--seed", "1", "--layout", "fsdp=4,tp=2", "--eval-every", "5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: --seed is 1, but the run was started with 0" in out
    assert "warning: --steps is 5, but the run was started with 4" in out  # the schedule
    assert "the layout changed (layout 'dp=2,fsdp=2,tp=2' -> layout 'fsdp=4,tp=2')" in out
    assert (
        f"resumed from step 4 of {copy / 'checkpoints'} (data position 32), saved under layout "
        f"dp=2,fsdp=2,tp=2, resharded to fsdp=4,tp=2"
    ) in out
    assert "warning: --eval-every" not in out  # changes nothing that was trained
    assert [step for step, _ in _losses(copy)] == [1, 2, 3, 4, 5]
    # TensorBoard: the resumed writer's file starts with the purge marker at step 5
    # (events an interrupted run wrote after its checkpoint are dropped) and goes on there.
    (new,) = set((copy / "tensorboard").iterdir()) - {copy / "tensorboard" / p.name for p in (run_dir / "tensorboard").iterdir()}
    events = _events(new)
    starts = [e.step for e in events if e.HasField("session_log") and e.session_log.status == 1]
    assert starts == [5]
    assert _scalars(events, "train/loss") == {5: pytest.approx(_losses(copy)[-1][1], rel=1e-7)}


def _events(path: pathlib.Path) -> list:
    """The events of a TensorBoard file (TFRecord framing: length, its CRC, data, CRC)."""
    from tensorboardX.proto import event_pb2

    # protobuf builds the message classes when the module loads: no static attribute.
    event_class = getattr(event_pb2, "Event")
    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_class()
        event.ParseFromString(data[at + 12 : at + 12 + length])
        out.append(event)
        at += 12 + length + 4
    return out


def _scalars(events: list, tag: str) -> dict[int, float]:
    return {e.step: v.simple_value for e in events for v in e.summary.value if v.tag == tag}


def test_tensorboard_events_hold_the_step_log(tiny_run):
    _, _, rows, run_dir = tiny_run
    (path,) = (run_dir / "tensorboard").iterdir()
    events = _events(path)
    steps = [row for row in rows if "loss" in row]
    for field in ("loss", "grad_norm", "lr", "step_time", "tokens_per_s", "mfu"):
        written = _scalars(events, f"train/{field}")
        assert written == {row["step"]: pytest.approx(row[field], rel=1e-6) for row in steps}, field
    val = {row["step"]: pytest.approx(row["val_loss"], rel=1e-6) for row in rows if "val_loss" in row}
    assert _scalars(events, "val/loss") == val
    texts = [v.tensor.string_val[0].decode() for e in events for v in e.summary.value if v.tag.startswith("config")]
    assert texts and 'layout = "dp=2,fsdp=2,tp=2"' in texts[0]


def test_profile_writes_a_trace_of_the_steps_asked_for(tiny_run):
    """`--profile 1:3` leaves one `jax.profiler` trace in the run directory's profile/
    (the XPlane TensorBoard's profile plugin reads and the trace Perfetto opens)."""
    *_, run_dir = tiny_run
    traces = list((run_dir / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list(traces[0].parent.glob("*.trace.json.gz"))  # Perfetto's


@pytest.mark.parametrize(
    "text, match",
    [("3", "must be START:STOP"), ("a:b", "must be START:STOP"), ("3:3", "START < STOP <= --steps"),
     ("2:9", r"START < STOP <= --steps \(4\)")],
)  # fmt: skip
def test_a_bad_profile_range_is_refused_before_anything_runs(text, match):
    with pytest.raises(LayerConfigError, match=match):
        check_options(dataclasses.replace(TINY, profile=text))
