"""Configuration files of `equishard train`: `--config run.toml`, and the resolved
`config.toml` every run writes to its run directory.

A file sets any `TrainConfig` field, spelled as the field (`batch_size`) or as the
option (`batch-size`); the command line's flags override it. Values are checked for
their type here and then by the same `check_options` as the flags, so a file and a
flag are refused with the same message. The resolved file has every option of the run
(`resume`, `resume_step` left out: they say how a run was started, not what it is), so
`equishard train --config <run-dir>/config.toml --run-dir new` runs it again.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
import types
import typing
from typing import Any

from .._errors import LayerConfigError
from .._names import RING


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `equishard train` takes (its options, one field each).

    See `equishard train --help` for each option's meaning and default.
    """

    layout: str = "dp=2,fsdp=2,tp=2"
    model: str = "small"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    grad_accum: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    resume: bool = False
    resume_step: int | None = None
    overwrite: bool = False
    require_verified: bool = False
    max_skipped_steps: int = 10
    verify_checkpoints: bool = True
    seed: int = 0
    run_dir: str = "runs/train"
    dtype: str = "float32"
    sequence_parallel: bool = False
    zero: bool = False
    cp_impl: str = RING
    microbatches: int | None = None
    pipeline_repeats: int = 1
    remat: str = "none"
    remat_offload: bool = False
    batch_chunks: int = 1
    pipeline_schedule: str | None = None
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    sample_bytes: int = 200
    progress: bool = True
    plot: bool = True
    tensorboard: bool = True
    profile: str | None = None


CONFIG_FILE = "config.toml"
"""The resolved configuration's name in the run directory."""

NOT_SAVED = ("resume", "resume_step", "overwrite")
# Options that change neither the model, the data order nor the updates.
_NEUTRAL = {
    "run_dir", "checkpoint_dir", "resume", "resume_step", "progress", "plot", "log_every",
    "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints", "sample_bytes",
    "verify_checkpoints", "tensorboard", "max_skipped_steps", "remat", "remat_offload",
    "batch_chunks", "overwrite", "require_verified", "profile",
}  # fmt: skip
# Options that change how the same computation is laid out on the devices.
_LAYOUT = ("layout", "sequence_parallel", "cp_impl", "microbatches", "pipeline_repeats", "pipeline_schedule", "zero")


def _field_types() -> dict[str, tuple[type, ...]]:
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for field in dataclasses.fields(TrainConfig):
        hint = hints[field.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[field.name] = tuple(a for a in args if a is not type(None))
    return out


def _check_type(name: str, value: Any, allowed: tuple[type, ...], path: str) -> Any:
    option = f"{name} (--{name.replace('_', '-')})"
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and (int in allowed or float in allowed):
        return float(value) if int not in allowed else value
    elif isinstance(value, float) and float in allowed:
        return value
    elif isinstance(value, str) and str in allowed:
        return value
    wanted = " or ".join({bool: "true/false", int: "an integer", float: "a number", str: "a string"}[t] for t in allowed)
    raise LayerConfigError(f"{path}: {option} must be {wanted}, got {value!r}.")


def load_config(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a TOML configuration file into `TrainConfig` field values.

    **Arguments:**

    - `path`: the file.

    **Returns:**

    `{field: value}` for every key of the file (keys spelled `batch_size` or
    `batch-size`; a `[train]` table is read as the top level).

    **Raises:**

    `LayerConfigError` for a missing or malformed file, an unknown key (naming the known
    ones) or a value of the wrong type (naming the option). Ranges are checked later,
    with the flags', by `check_options`.
    """
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise LayerConfigError(f"--config {path}: cannot read it ({err.strerror}).") from None
    except UnicodeDecodeError as err:
        raise LayerConfigError(f"--config {path}: not UTF-8 text (byte {err.start}), so not TOML.") from None
    except tomllib.TOMLDecodeError as err:
        raise LayerConfigError(f"--config {path}: not valid TOML ({err}).") from None
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    types_ = _field_types()
    out = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in types_:
            known = ", ".join(sorted(types_))
            raise LayerConfigError(f"--config {path}: unknown option {key!r}; the options are {known}.")
        if name in spelled:
            raise LayerConfigError(
                f"--config {path}: {spelled[name]!r} and {key!r} are the same option; keep one."
            )
        spelled[name] = key
        if name == "clip_norm" and (value == 0 or (isinstance(value, str) and value.lower() == "none")):
            out[name] = None  # no clipping, as --clip-norm 0 / none
            continue
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise LayerConfigError(f"--config {path}: {key} = {value} is too large for any option.")
        out[name] = _check_type(name, value, types_[name], f"--config {path}")
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def config_toml(config: TrainConfig) -> str:
    """The resolved configuration as TOML text (`None` values, which TOML cannot say,
    and `resume`, `resume_step` left out)."""
    lines = [
        "# The resolved options of this run (equishard train). Run it again with",
        "#   equishard train --config config.toml --run-dir <another directory>",
    ]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "clip_norm" and value is None:
            value = 0  # no clipping, as the file says it
        if value is None or field.name in NOT_SAVED:
            continue
        lines.append(f"{field.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def changes_on_resume(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """What a resumed run changes against the configuration it was started with.

    **Arguments:**

    - `saved`: the run directory's `config.toml`, as `load_config` reads it.
    - `config`: this run's options.

    **Returns:**

    One warning per option that changes the training (seed, dtype, learning rate, batch,
    ...), and one line announcing a reshard when the layout changed; options that change
    neither (the run directory, logging, checkpoint frequency) are not mentioned.
    """
    out = []
    for field in dataclasses.fields(config):
        name = field.name
        if name in _NEUTRAL or name in _LAYOUT or name not in saved:
            continue
        old, new = saved[name], getattr(config, name)
        if old != new:
            out.append(
                f"warning: --{name.replace('_', '-')} is {new!r}, but the run was started with "
                f"{old!r}: the resumed steps differ from an uninterrupted run's."
            )
    moved = [n for n in _LAYOUT if saved.get(n, getattr(TrainConfig, n)) != getattr(config, n)]
    if moved:
        before = ", ".join(f"{n.replace('_', '-')} {saved.get(n, getattr(TrainConfig, n))!r}" for n in moved)
        after = ", ".join(f"{n.replace('_', '-')} {getattr(config, n)!r}" for n in moved)
        out.append(f"the layout changed ({before} -> {after}): the checkpoint is resharded to it.")
    return out
