"""One home per option (`equishard/_app/_options.py`, `_app/_config.py`): every field of a
run's configuration has a flag, a TOML key and a resume class; the parsers of `train`,
`inspect`, `plan` and `launch` are generated from the dataclasses (their defaults are the
fields'); the TOML file round-trips; a run's `config.toml` written before the sections
existed (flat, by the code before this change) is read with the same values and a resume
against it reports nothing. No JAX compile.
"""

import argparse
import dataclasses
import pathlib
import tempfile
from typing import Any

import pytest

from equishard import _app
from equishard._app import TrainConfig
from equishard._app._config import (
    DTYPES,
    EvalConfig,
    ExportConfig,
    GenerateConfig,
    InspectConfig,
    LaunchConfig,
    PlanConfig,
    TokenizeConfig,
    TrainCommand,
    changes_on_resume,
    config_toml,
    load_config,
)
from equishard._app._options import (
    RESUME_CLASSES,
    START,
    flag_of,
    from_args,
    options_of,
    section_of,
)
from equishard._cli import _add_train
from equishard._cli_report import add_report_parsers
from equishard._cli_text import add_text_parsers
from equishard._errors import LayerConfigError
from equishard._launch import add_launch_parser

OLD_CONFIG = pathlib.Path(__file__).parent / "data" / "config_before_options.toml"
"""`config_toml` of main at 1164d6d (before the sections) for the `TrainConfig` below."""
OLD_VALUES: dict[str, Any] = dict(
    model="tiny", steps=4, batch_size=8, seq_len=32, clip_norm=None, run_dir="runs/old",
    profile="1:3", zero=True, remat="full", eval_batches=2,
)  # fmt: skip
COMMANDS = {
    "train": TrainCommand, "inspect": InspectConfig, "plan": PlanConfig, "launch": LaunchConfig,
    "tokenize": TokenizeConfig, "generate": GenerateConfig, "eval": EvalConfig, "export": ExportConfig,
}  # fmt: skip


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="equishard")
    sub = parser.add_subparsers()
    _add_train(sub)
    add_report_parsers(sub)
    add_launch_parser(sub)
    add_text_parsers(sub)
    return dict(sub.choices)


def _other_value(field: dataclasses.Field, choices) -> Any:
    """A valid value of the field that is not its default."""
    default = field.default
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default / 2
    if field.name == "lora_alpha":
        return 4.0
    if field.name in ("clip_norm", "microbatches", "resume_step", "lora_rank"):
        return 4
    return f"some/{field.name}"


def test_every_field_of_a_run_has_a_flag_a_toml_key_and_a_resume_class(parsers):
    declared = {f.name: m for f, m in options_of(TrainConfig)}
    assert set(declared) == {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {a.dest: a.option_strings for a in parsers["train"]._actions}
    changed = TrainConfig(**{f.name: _other_value(f, m.choices) for f, m in options_of(TrainConfig)})
    saved = load_config_text(config_toml(changed))
    for field in dataclasses.fields(TrainConfig):
        meta = declared[field.name]
        assert meta.resume in RESUME_CLASSES, field.name
        assert flags[field.name] == [flag_of(field, meta)], field.name
        assert section_of(TrainConfig, field.name), field.name
        assert (field.name in saved) == (meta.resume != START), field.name
    assert {n for n, m in declared.items() if m.resume == START} == {"resume", "resume_step", "overwrite"}
    # The three options that had no flag before.
    for flag in ("--weight-decay", "--keep-checkpoints", "--eval-batches"):
        assert [flag] in flags.values()


def load_config_text(text: str) -> dict:
    """`load_config` of a file holding `text`."""
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "config.toml"
        path.write_text(text)
        return load_config(path)


def test_the_toml_file_round_trips_in_sections():
    changed = TrainConfig(**{f.name: _other_value(f, m.choices) for f, m in options_of(TrainConfig)})
    text = config_toml(changed)
    assert "[layout]\nlayout = " in text and "\n[optimizer]\n" in text and "\n[data]\n" in text
    assert "resume =" not in text and "resume_step" not in text and "overwrite" not in text
    read = load_config_text(text)
    starts: dict[str, Any] = {f.name: f.default for f, m in options_of(TrainConfig) if m.resume == START}
    assert TrainConfig(**read, **starts) == dataclasses.replace(changed, **starts)
    for config in (TrainConfig(), TrainConfig(clip_norm=None, microbatches=None)):
        assert TrainConfig(**load_config_text(config_toml(config))) == config


def test_every_command_parses_to_its_dataclass_defaults_and_lists_every_field_in_help(parsers):
    required = {
        "plan": ["--model", "tiny", "--layout", "dp=2", "--devices", "2"],
        "tokenize": ["in.txt", "--out", "o"], "generate": [], "eval": [],
        "export": ["--run-dir", "r", "--to", "t"],
    }  # fmt: skip
    for name, cls in COMMANDS.items():
        parser = parsers[name]
        args = parser.parse_args(required.get(name, []))
        names = {"plan": ("model", "layout", "devices"), "tokenize": ("inputs", "out"), "export": ("run_dir", "to")}.get(name, ())  # fmt: skip
        given = {k: from_args(cls, args).__getattribute__(k) for k in names}
        got = from_args(cls, args)
        assert got == dataclasses.replace(cls(), **given), name
        text = parser.format_help()
        for field, meta in options_of(cls):
            shown = flag_of(field, meta) if flag_of(field, meta).startswith("-") else meta.metavar
            assert shown in text, (name, field.name)
            assert meta.help.split()[0] in text, (name, field.name)


def test_dtype_and_layout_options_have_one_home(parsers):
    def action(command: str, dest: str) -> argparse.Action:
        return next(a for a in parsers[command]._actions if a.dest == dest)

    for command in ("train", "inspect", "plan"):
        assert tuple(action(command, "dtype").choices) == tuple(DTYPES)  # pyright: ignore[reportArgumentType]
        for dest in ("layout", "sequence_parallel", "zero", "cp_impl", "microbatches", "pipeline_repeats", "pipeline_schedule"):
            assert (action(command, dest).help, action(command, dest).choices) == (
                action("train", dest).help, action("train", dest).choices
            ), (command, dest)  # fmt: skip
    assert action("plan", "layout").required and not action("inspect", "layout").required


def test_a_run_directory_written_before_the_sections_is_read_as_before():
    saved = load_config(OLD_CONFIG)
    assert TrainConfig(**saved) == TrainConfig(**OLD_VALUES)
    assert changes_on_resume(saved, TrainConfig(**OLD_VALUES)) == []
    moved = dataclasses.replace(TrainConfig(**OLD_VALUES), run_dir="elsewhere", remat="dots", resume=True)
    assert changes_on_resume(saved, moved) == []  # neutral and start options
    new = load_config_text(config_toml(TrainConfig(**OLD_VALUES)))
    assert {k: new[k] for k in saved} == saved
    # Options added since: at their defaults, which an old run had.
    assert {k: v for k, v in new.items() if k not in saved} == {
        "axis_roles": "", "document_masking": True, "lora_dropout": 0.0, "lora_targets": "q,v",
    }  # fmt: skip


def test_resume_classes_decide_what_a_resume_reports():
    saved = load_config_text(config_toml(TrainConfig()))
    lines = changes_on_resume(saved, TrainConfig(lr=1e-3, weight_decay=0.0, layout="fsdp=8", log_every=1, keep_checkpoints=9))
    assert lines[0] == "warning: --lr is 0.001, but the run was started with 0.003: the resumed steps differ from an uninterrupted run's."
    assert lines[1].startswith("warning: --weight-decay is 0.0")
    assert lines[2] == "the layout changed (layout 'dp=2,fsdp=2,tp=2' -> layout 'fsdp=8'): the checkpoint is resharded to it."
    assert len(lines) == 3


def test_a_resume_cannot_change_what_is_trained():
    saved = load_config_text(config_toml(TrainConfig(lora_rank=8)))
    assert changes_on_resume(saved, TrainConfig(lora_rank=8, lora_dropout=0.1))[0].startswith(
        "warning: --lora-dropout is 0.1"
    )
    with pytest.raises(LayerConfigError, match=r"--lora-rank is 4, but the run was started with 8: it decides what is trained"):
        changes_on_resume(saved, TrainConfig(lora_rank=4))
    with pytest.raises(LayerConfigError, match=r"--lora-targets is 'q,k,v'"):
        changes_on_resume(saved, TrainConfig(lora_rank=8, lora_targets="q,k,v"))
    # A run written before the option (the file lacks it) compares with its default.
    old = load_config(OLD_CONFIG)
    with pytest.raises(LayerConfigError, match=r"--freeze is 'embed', but the run was started with None"):
        changes_on_resume(old, TrainConfig(**OLD_VALUES, freeze="embed"))


def test_a_config_file_is_checked_and_the_flags_win(tmp_path, monkeypatch, capsys):
    from equishard._cli import main

    path = tmp_path / "run.toml"
    path.write_text("[optimizer]\nbatch_size = 8\n")
    with pytest.raises(LayerConfigError, match=r"'batch_size' belongs in \[data\], not in \[optimizer\]"):
        load_config(path)
    path.write_text("model = 'tiny'\n[data]\nbatch-size = 8\nseq_len = 64\n[optimizer]\nweight_decay = 0\n")
    seen: list[TrainConfig] = []
    monkeypatch.setattr(_app, "run", seen.append)
    argv = ["train", "--config", str(path), "--seq-len", "32", "--keep-checkpoints", "5", "--eval-batches", "2"]
    assert main(argv) == 0
    assert seen[0] == TrainConfig(model="tiny", batch_size=8, seq_len=32, weight_decay=0.0, keep_checkpoints=5, eval_batches=2)
    assert main(["train", "--weight-decay", "0.25"]) == 0
    assert seen[1].weight_decay == 0.25
    path.write_text("[data]\nweight_decay = 'x'\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "'weight_decay' belongs in [optimizer], not in [data]" in capsys.readouterr().err
