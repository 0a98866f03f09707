"""`equishard inspect` and `plan` on a terminal: 120 columns, the verdict first, dtypes,
the step-time estimate on a device profile."""

from __future__ import annotations

import re

import pytest

from equishard import __version__
from equishard._cli import main
from equishard._cli_report import WIDTH, gpt_step_estimate, step_time_estimate
from equishard._text import text_table
from equishard.models import PRESETS, GPTConfig, gpt_matmul_parameters
from equishard.report import DEVICE_PROFILES, DeviceProfile

PLAN = ["plan", "--model", "tiny", "--layout", "fsdp=4,tp=2", "--devices", "8", "--seq-len", "32"]


def _run(argv: list[str], capsys) -> list[str]:
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()


def _param_total(lines: list[str]) -> list[str]:
    at = lines.index("Parameters:")
    return next(line for line in lines[at:] if line.startswith("total")).split()[-2:]


def test_text_tables_wrap_their_widest_columns_to_fit():
    rows = [("a" * 10, "word " * 30, "1.00 KiB"), ("b", "short", "2 B")]
    table = text_table(("name", "description", "bytes/device"), rows, width=60)
    lines = table.splitlines()
    assert max(map(len, lines)) <= 60
    assert " ".join(" ".join(line.split()[1:-2]) for line in lines[2:5]).startswith("word word")
    assert lines[-1].split() == ["b", "short", "2", "B"]
    assert text_table(("x",), [("y" * 80,)]) == "\n".join(["x", "-" * 80, "y" * 80])  # no width


def test_inspect_fits_120_columns_with_the_verdict_first(capsys):
    lines = _run(["inspect", "--model", "tiny", "--seq-len", "32"], capsys)
    assert lines[0].startswith("verdict: peak memory ") and "x the analytical minimum" in lines[0]
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)


def test_plan_on_an_h100_and_with_bfloat16_parameters(capsys):
    f32 = _run([*PLAN, "--device", "h100"], capsys)
    assert re.match(r"verdict: fits: peak .* per device of 74\.51 GiB", f32[0])  # H100: 80 GB
    assert max(map(len, f32)) <= WIDTH
    at = f32.index("Step time on 8 x NVIDIA H100 SXM (an estimate, not a measurement):")
    estimate = " ".join(f32[at:])
    assert re.search(r"estimated step time [\d.]+ \w+ to [\d.]+ \w+, MFU [\d.]+% to [\d.]+%", estimate)
    assert "assumptions: calibrated on one H100" in estimate
    bf16 = _run([*PLAN, "--param-dtype", "bfloat16", "--wide"], capsys)
    assert "float32 compute, bfloat16 parameters" in bf16[2]
    (value, unit), (half, half_unit) = _param_total(f32), _param_total(bf16)
    assert unit == half_unit and abs(float(half) - float(value) / 2) <= 0.005  # 2 decimals printed
    assert "Step time on" not in "\n".join(bf16)  # no --device: no time estimate


def test_the_step_time_estimate_is_flops_hbm_bytes_and_link_bytes():
    profile = DeviceProfile("test", "a test device", {"bfloat16": 100.0}, 1.0, 1.0, 10.0)
    e = step_time_estimate(240.0, 20.0, profile, "bfloat16", memory_bytes_per_device=0.9)
    # 240 FLOPs at 80% of 100/s; 0.9 B at 90% of 1 B/s; 20 B over 10 B/s
    assert (e["matmul_s"], e["memory_s"], e["communication_s"]) == (3.0, 1.0, 2.0)
    assert (e["overlapped_s"], e["serial_s"]) == (4.0, 6.0)
    assert e["mfu_overlapped"] == pytest.approx(0.6) and e["mfu_serial"] == pytest.approx(0.4)


# Measured on one H100 and one H200 (benchmarks/RESULTS.md, "On one GPU"): the reference
# GPT's bf16 step, AdamW, tokens per second. The model is calibrated on the first; the
# others are held out.
# The H200's (run five there) are all held out.
GPU_STEPS = [
    # (device, d_model, n_heads, n_layers, d_ff, batch x seq, measured tokens/s)
    ("h100", 768, 12, 12, 2048, (16, 1024), 445_936),
    ("h100", 768, 12, 12, 2048, (8, 2048), 412_739),
    ("h100", 1024, 16, 24, 2816, (8, 2048), 163_454),
    ("h100", 2048, 16, 24, 5504, (4, 2048), 53_167),
    ("h200", 768, 12, 12, 2048, (16, 1024), 493_228),
    ("h200", 768, 12, 12, 2048, (8, 2048), 456_237),
    ("h200", 1024, 16, 24, 2816, (8, 2048), 175_692),
    ("h200", 2048, 16, 24, 5504, (4, 2048), 57_884),
]


@pytest.mark.parametrize("device, d, heads, layers, d_ff, shape, measured", GPU_STEPS)
def test_the_plan_estimate_is_within_25_percent_of_measured_gpu_steps(
    device, d, heads, layers, d_ff, shape, measured
):
    config = GPTConfig(vocab_size=50304, d_model=d, n_heads=heads, n_layers=layers, d_ff=d_ff, tied=True)
    parameters = gpt_matmul_parameters(config)
    tokens = shape[0] * shape[1]
    e = gpt_step_estimate(config, shape[1], tokens, 12 * parameters, DEVICE_PROFILES[device], "bfloat16")
    assert abs(tokens / e["serial_s"] / measured - 1) <= 0.25


def test_plan_of_one_device_prints_its_report(capsys):
    lines = _run(["plan", "--model", "tiny", "--layout", "dp=1", "--devices", "1", "--seq-len", "32",
                  "--device", "h100"], capsys)  # fmt: skip
    assert "nothing to send" in lines[0]
    assert any(line.startswith("Step time on 1 x NVIDIA H100 SXM") for line in lines)


# ----------------------------------------------------------------- the command line


def test_version_and_bare_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"equishard {__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: equishard") and all(c in out for c in ("train", "inspect", "plan", "launch"))


@pytest.mark.parametrize("command", ["train", "inspect", "plan", "launch", "demo"])
def test_help_says_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    for option in options:
        assert option.count("default") <= 1, option
    if command in ("train", "inspect", "plan"):
        layout = next(o for o in options if o.startswith("--layout"))
        assert "-1 to fill the devices" in " ".join(layout.split())


def test_one_preset_registry_and_train_refuses_what_cannot_fit(tmp_path, capsys):
    for command in ("train", "inspect", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(name in text for name in PRESETS), command
    assert main(["train", "--model", "llama3-405b", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--model llama3-405b: its \d+\.\d B parameters need at least [\d.]+ TiB", err), err
    assert "equishard plan --model llama3-405b" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_train_inspect_and_plan_declare_one_set_of_layout_options():
    """`--layout` and its options come from one dataclass (`LayoutOptions`): the same
    help, the same choices (the library's constants) in every command that takes a layout."""
    import argparse

    from equishard._app._internal import LayoutOptions, add_options
    from equishard.core import SCHEDULES
    from equishard.sharding import CONTEXT_IMPLS

    def layout_actions(command: str) -> dict[str, tuple[str | None, object]]:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        if command == "train":
            from equishard._cli import _add_train

            p = _add_train(sub)
        else:
            from equishard._cli_report import add_report_parsers

            add_report_parsers(sub)
            p = sub.choices[command]
        names = {"--layout", "--sequence-parallel", "--zero", "--cp-impl", "--microbatches", "--pipeline-repeats", "--pipeline-schedule", "--axis-roles"}
        return {a.option_strings[-1]: (a.help, a.choices) for a in p._actions if a.option_strings[-1] in names}

    reference = argparse.ArgumentParser()
    add_options(reference, LayoutOptions)
    expected = {a.option_strings[-1]: (a.help, a.choices) for a in reference._actions if a.option_strings[-1] != "-h" and a.option_strings[-1] != "--help"}
    assert expected["--cp-impl"][1] == CONTEXT_IMPLS and expected["--pipeline-schedule"][1] == SCHEDULES
    for command in ("train", "inspect", "plan"):
        assert layout_actions(command) == expected, command


def test_inspect_reads_a_layout_in_the_users_axis_names(capsys):
    """`--axis-roles`: the same collectives and analytical minimum as the conventional
    names, named as the user named the axes."""
    common = ["inspect", "--model", "tiny", "--seq-len", "32"]
    named = _run([*common, "--layout", "replica=2,shard=2,model=2", "--axis-roles", "replica=data,shard=fsdp,model=tensor"], capsys)
    plain = _run([*common, "--layout", "dp=2,fsdp=2,tp=2"], capsys)
    assert named[0] == plain[0] and "1.000 x the analytical minimum" in named[0]
    assert any("all-gather      shard" in line for line in named)
