"""One home per option: the command line's parsers and the run's TOML file, generated from
typed dataclasses.

An option is one field of a frozen dataclass, declared with `option`: its type (the
annotation), its default, its help text, its resume class and, where it is special, its
flag spelling, choices or parser. A command is a dataclass whose bases are the sections
it takes (`class TrainConfig(LayoutOptions, ModelOptions, ...)`): the fields stay flat
(`config.batch_size`), each section stays a type of its own (`LayoutOptions` is what
`layout_from_options` reads), and a command may re-declare a section's field with
`option_like` to change its default or help. From a command's class:

- `add_options(parser, cls)` adds one argparse argument per field (a `bool` field
  defaulting to `False` is a `--name` switch, one defaulting to `True` a `--no-name`
  switch; other types are parsed as their annotation, or by the option's `parse`);
- `config_toml(config)` writes the TOML file, one table per section (`[optimizer]`,
  `[data]`, ...), and `read_toml(path, cls)` reads it back, as well as a flat file (the
  `config.toml` runs wrote before the sections existed, `batch_size = 16`);
- `resume_changes(saved, config)` says what a resume changes, by the fields' resume
  classes.

**Adding an option** is one field in `equishard/_app/_config.py`, in the section it
belongs to; its flag, `--help` line, TOML key and resume behaviour follow:

```python
weight_decay: float = option(0.1, "AdamW's decoupled weight decay (0: none)", resume=COMPUTATION)
```

**Adding a command** (`tokenize`, `generate`, `eval`, `export`) is one dataclass there
whose bases are the sections it shares (`class GenerateConfig(GenerateOptions,
ModelOptions, LayoutOptions)`, its own options in a new `...Options` section, or as
fields of the command with `resume=None` when no run saves them), and a parser:

```python
p = sub.add_parser("generate", help=..., formatter_class=HelpFormatter)
add_options(p, GenerateConfig)
p.set_defaults(run=lambda args: generate(from_args(GenerateConfig, args)))
```

A section is a frozen dataclass whose name ends in `Options`: its lowercase name without
the suffix is its TOML table. `tests/test_options.py` checks that every field of a run's
configuration has a flag, a TOML key and a resume class.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import LayerConfigError

# Resume classes: what a resume may change.
NEUTRAL = "neutral"
"""Changes neither the model, the data order nor the updates (paths, logging, checkpoint
cadence, rematerialisation): a resume changes it silently."""
LAYOUT = "layout"
"""Changes how the same computation is laid out on the devices: a resume reshards the
checkpoint to it and says so."""
COMPUTATION = "computation"
"""Changes the training (seed, dtype, learning rate, batch): a resume warns that its steps
differ from an uninterrupted run's."""
FIXED = "fixed"
"""Decides what is trained (the adapters, the frozen parameters, the base they adapt): a
resume that changes it is refused by name, before anything is restored."""
START = "start"
"""Says how a run was started (resume, overwrite), not what it is: never saved."""
RESUME_CLASSES = (NEUTRAL, LAYOUT, COMPUTATION, FIXED, START)

_META = "equishard_option"


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field declares beyond its type and default (see `option`)."""

    help: str
    resume: str | None = None
    flag: str | None = None
    short: str | None = None
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    required: bool = False
    none_as: Any = None
    nargs: str | None = None


def option(default: Any, help: str, *, resume: str | None = None, **special: Any) -> Any:
    """One option: a dataclass field with its default, help text and resume class.

    **Arguments:**

    - `default`: the default value.
    - `help`: the `--help` text.
    - `resume`: one of `RESUME_CLASSES` for a field of a run's configuration (saved in its
      `config.toml`); `None` for a command's own options (`--devices`, `--wide`).
    - `special`: where the field is special, the `Option` fields `flag` (the flag's
      spelling; a name without a dash is a positional argument), `short` (`-n`),
      `choices`, `parse` (text to value, instead of the annotation's type), `metavar`,
      `required`, `none_as` (the TOML spelling of `None`, which TOML cannot say: a file
      reads it, or `"none"`, back as `None`) and `nargs`.

    **Returns:**

    The `dataclasses.field`.

    **Raises:**

    `LayerConfigError` for an unknown resume class.
    """
    if resume is not None and resume not in RESUME_CLASSES:
        raise LayerConfigError(f"resume class {resume!r} is not one of {', '.join(RESUME_CLASSES)}.")
    return dataclasses.field(default=default, metadata={_META: Option(help, resume, **special)})


def option_like(section: type, name: str, **changes: Any) -> Any:
    """`section`'s field `name` declared again, with `changes` (`default`, or any `Option`
    field): how a command changes a shared option's default or help."""
    field = section.__dataclass_fields__[name]
    default = changes.pop("default", field.default)
    meta = dataclasses.replace(field.metadata[_META], **changes)
    return dataclasses.field(default=default, metadata={_META: meta})


def options_of(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Each option field of the dataclass `cls` with its `Option`, in field order."""
    for field in dataclasses.fields(cls):
        if _META in field.metadata:
            yield field, field.metadata[_META]


def flag_of(field: dataclasses.Field, meta: Option) -> str:
    """The flag a field is given on the command line (`--batch-size`, `--no-plot`)."""
    if meta.flag is not None:
        return meta.flag
    dashed = field.name.replace("_", "-")
    return f"--no-{dashed}" if field.default is True else f"--{dashed}"


def section_of(cls: type, name: str) -> str:
    """The section (TOML table) a field belongs to: the lowercase name of the base class
    that declares it first, without `Options` (`OptimizerOptions` -> `optimizer`)."""
    for base in reversed(cls.__mro__):
        if name in getattr(base, "__annotations__", {}) and base.__name__.endswith("Options"):
            return base.__name__.removesuffix("Options").lower()
    return ""


def value_types(cls: type) -> dict[str, tuple[Any, ...]]:
    """Each field's allowed value types (its annotation without `None`)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[field.name] = tuple(a for a in args if a is not type(None))
    return out


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argument per option of the dataclass `cls` to `parser`.

    **Arguments:**

    - `parser`: a subcommand's parser.
    - `cls`: the command's dataclass (its fields declared with `option`).
    """
    kinds = value_types(cls)
    for field, meta in options_of(cls):
        flag = flag_of(field, meta)
        kwargs: dict[str, Any] = {"help": meta.help}
        if not flag.startswith("-"):  # positional
            parser.add_argument(field.name, nargs=meta.nargs, metavar=meta.metavar, help=meta.help)
            continue
        if kinds[field.name] == (bool,):
            kwargs["action"] = "store_false" if field.default is True else "store_true"
        elif typing.get_origin(kinds[field.name][0]) is tuple:
            # A repeatable flag (`--prompt A --prompt B`): its values as a tuple.
            element = typing.get_args(kinds[field.name][0])[0]
            kwargs.update(action="append", type=meta.parse or element, metavar=meta.metavar, default=None)
        else:
            kwargs.update(type=meta.parse or kinds[field.name][0], choices=meta.choices, metavar=meta.metavar)
            if meta.required:
                kwargs["required"] = True
            else:
                kwargs["default"] = field.default
        names = (meta.short, flag) if meta.short else (flag,)
        parser.add_argument(*names, dest=field.name, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass `cls` from parsed arguments (its fields read by name; a list, as
    argparse gives a positional's values, as a tuple)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    # A repeatable flag never given is `None` (argparse appends to its default otherwise).
    values = {k: (f.default if v is None and isinstance(f.default, tuple) else v) for f in dataclasses.fields(cls) for k, v in values.items() if k == f.name}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _check_type(option_name: str, value: Any, allowed: tuple[type, ...], path: str) -> Any:
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
    raise LayerConfigError(f"{path}: {option_name} must be {wanted}, got {value!r}.")


def _flatten(data: dict[str, Any], cls: type, where: str) -> list[tuple[str, Any]]:
    """The `(key, value)` pairs of a file: top-level keys (the flat form) and the keys of
    each section's table, each checked to be in its own section."""
    sections = {section_of(cls, f.name) for f, _ in options_of(cls)}
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    pairs = []
    for key, value in data.items():
        if not (key in sections and isinstance(value, dict)):
            pairs.append((key, value))
            continue
        for inner, item in value.items():
            owner = section_of(cls, inner.replace("-", "_"))
            if owner and owner != key:
                raise LayerConfigError(f"{where}: {inner!r} belongs in [{owner}], not in [{key}].")
            pairs.append((inner, item))
    return pairs


def read_toml(path: str | pathlib.Path, cls: type) -> dict[str, Any]:
    """Read a TOML file of `cls`'s options into field values.

    **Arguments:**

    - `path`: the file: keys spelled as the field (`batch_size`) or the option
      (`batch-size`), at the top level (flat, as runs wrote it before sections), in their
      section's table (`[data]`), or in a `[train]` table.
    - `cls`: the command's dataclass.

    **Returns:**

    `{field: value}` for every key of the file.

    **Raises:**

    `LayerConfigError` for a missing or malformed file, an unknown key (naming the known
    ones), a key spelled twice, a key in another section's table or a value of the wrong
    type (naming the option). Ranges are checked later, with the flags'.
    """
    path = pathlib.Path(path)
    where = f"--config {path}"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise LayerConfigError(f"{where}: cannot read it ({err.strerror}).") from None
    except UnicodeDecodeError as err:
        raise LayerConfigError(f"{where}: not UTF-8 text (byte {err.start}), so not TOML.") from None
    except tomllib.TOMLDecodeError as err:
        raise LayerConfigError(f"{where}: not valid TOML ({err}).") from None
    kinds = value_types(cls)
    metas = {f.name: (f, m) for f, m in options_of(cls) if m.resume is not None}
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in _flatten(data, cls, where):
        name = key.replace("-", "_")
        if name not in metas:
            raise LayerConfigError(f"{where}: unknown option {key!r}; the options are {', '.join(sorted(metas))}.")
        if name in spelled:
            raise LayerConfigError(f"{where}: {spelled[name]!r} and {key!r} are the same option; keep one.")
        spelled[name] = key
        field, meta = metas[name]
        if meta.none_as is not None and (value == meta.none_as or (isinstance(value, str) and value.lower() == "none")):
            out[name] = None  # as the flag's `none`
            continue
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise LayerConfigError(f"{where}: {key} = {value} is too large for any option.")
        out[name] = _check_type(f"{name} ({flag_of(field, meta)})", value, kinds[name], where)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def config_toml(config: Any, header: Sequence[str] = ()) -> str:
    """A run's configuration as TOML text, one table per section.

    **Arguments:**

    - `config`: the dataclass instance.
    - `header`: comment lines to begin with.

    **Returns:**

    The text: every field with a resume class other than `START`; `None` values written
    as their `none_as`, or left out (TOML cannot say `None`).
    """
    lines = [f"# {line}" for line in header]
    tables: dict[str, list[str]] = {}
    for field, meta in options_of(type(config)):
        value = getattr(config, field.name)
        if value is None:
            value = meta.none_as
        if value is None or meta.resume in (None, START):
            continue
        tables.setdefault(section_of(type(config), field.name), []).append(f"{field.name} = {_toml_value(value)}")
    for section, entries in tables.items():
        lines += ["", f"[{section}]", *entries]
    return "\n".join(lines) + "\n"


def resume_changes(saved: dict[str, Any], config: Any) -> list[str]:
    """What a resumed run changes against the configuration it was started with.

    **Arguments:**

    - `saved`: the run's saved options, as `read_toml` reads them.
    - `config`: this run's configuration.

    **Returns:**

    One warning per `COMPUTATION` option that differs, and one line announcing a reshard
    when a `LAYOUT` option differs (a layout option the file lacks is compared with its
    default); `NEUTRAL` and `START` options are not mentioned.

    **Raises:**

    `LayerConfigError` naming a `FIXED` option that differs (one the file lacks is
    compared with its default): what is trained cannot change on a resume.
    """
    out = []
    moved = []
    for field, meta in options_of(type(config)):
        name, new = field.name, getattr(config, field.name)
        if meta.resume == FIXED and saved.get(name, field.default) != new:
            raise LayerConfigError(
                f"{flag_of(field, meta)} is {new!r}, but the run was started with "
                f"{saved.get(name, field.default)!r}: it decides what is trained, and a resume "
                f"cannot change it (start a new run in another --run-dir, or resume with the run's own value)."
            )
        if meta.resume == LAYOUT and saved.get(name, field.default) != new:
            moved.append((name, saved.get(name, field.default), new))
        if meta.resume == COMPUTATION and name in saved and saved[name] != new:
            out.append(
                f"warning: {flag_of(field, meta)} is {new!r}, but the run was started with "
                f"{saved[name]!r}: the resumed steps differ from an uninterrupted run's."
            )
    if moved:
        before = ", ".join(f"{n.replace('_', '-')} {old!r}" for n, old, _ in moved)
        after = ", ".join(f"{n.replace('_', '-')} {new!r}" for n, _, new in moved)
        out.append(f"the layout changed ({before} -> {after}): the checkpoint is resharded to it.")
    return out
