"""The options of every `equishard` command, one field each, and the run's configuration
files: `--config run.toml`, and the resolved `config.toml` every run writes to its run
directory.

Each option is declared once here (see `_options` for the mechanism and how to add an
option or a command): `equishard train`'s configuration `TrainConfig` is made of the
sections `LayoutOptions`, `ModelOptions`, `OptimizerOptions`, `DataOptions`,
`FineTuneOptions`, `CheckpointOptions`, `LogOptions` and `StartOptions`; `inspect`,
`plan` and `launch` take `InspectConfig`, `PlanConfig` and `LaunchConfig`. Their
parsers and the TOML file are generated from these classes.

A file sets any `TrainConfig` option, spelled as the field (`batch_size`) or as the
flag (`batch-size`), in its section's table (`[data]`) or at the top level (as runs wrote
it before the sections existed); the command line's flags override it. Values are
checked for their type here and then by the same `check_options` as the flags, so a file
and a flag are refused with the same message. The resolved file has every option of the
run but the `START` ones (`resume`, `resume_step`, `overwrite`: they say how a run was
started, not what it is), so `equishard train --config <run-dir>/config.toml --run-dir
new` runs it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import Any

import jax.numpy as jnp

from .._errors import LayerConfigError
from .._names import CONTEXT_IMPLS, RING, SCHEDULES
from ..models import PRESETS
from ..nn import REMAT_POLICIES
from ..report import DEVICE_PROFILES
from ..sharding import Layout
from ._options import (
    COMPUTATION,
    FIXED,
    LAYOUT,
    NEUTRAL,
    START,
    config_toml as _config_toml,
    option,
    option_like,
    read_toml,
    resume_changes,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""The compute dtypes `--dtype` takes, and the dtype each names."""


def parse_clip_norm(text: str) -> float | None:
    """`--clip-norm`: a number, `0` or `none` (no clipping, as in nanoGPT)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (or none)") from None
    return None if value == 0 else value


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """How the devices are used: the fields of `equishard.sharding.Layout`."""

    layout: str = option(
        "dp=2,fsdp=2,tp=2", resume=LAYOUT,
        help="mesh axes: dp (data), fsdp (fully sharded data), cp (context: the sequence), tp "
        "(tensor), ep (expert), pp (pipeline), e.g. 'fsdp=4,tp=2' or 'dp=2,cp=4'; one size "
        "may be -1 to fill the devices ('fsdp=-1,tp=2')",
    )  # fmt: skip
    sequence_parallel: bool = option(False, "split activations over the sequence on tp", resume=LAYOUT)
    zero: bool = option(False, "split the optimizer state over dp, parameters replicated (ZeRO-1: gradients reduce-scattered, parameters all-gathered)", resume=LAYOUT)
    cp_impl: str = option(RING, "attention over a cp axis (the sequence split in zigzag order): ring attention or all-to-all (Ulysses)", resume=LAYOUT, choices=CONTEXT_IMPLS)
    microbatches: int | None = option(None, "pipeline micro-batches per step (default: the pp size)", resume=LAYOUT)
    pipeline_repeats: int = option(1, "stages per device with pp (1: GPipe, more: circular)", resume=LAYOUT)
    pipeline_schedule: str | None = option(None, "pipeline schedule with pp (default: gpipe, or circular with --pipeline-repeats > 1)", resume=LAYOUT, choices=SCHEDULES)
    axis_roles: str = option("", "roles of mesh axes named otherwise than dp, fsdp, cp, tp, ep, pp, e.g. 'replica=data,shard=fsdp,model=tensor' for --layout replica=2,shard=2,model=2 (roles: data, fsdp, context, tensor, expert, pipeline)", resume=LAYOUT, metavar="AXIS=ROLE,...")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """The model, its compute dtype and how its steps keep activations."""

    model: str = option("small", "model size preset (the registry inspect and plan share; one too large for this machine is refused)", resume=COMPUTATION, choices=tuple(PRESETS))
    init_from: str | None = option(None, "start from the weights of a Hugging Face folder (config.json and safetensors of the Llama family; the architecture from its config.json, --model ignored; needs --data for its tokenizer's ids)", resume=COMPUTATION, metavar="DIR")
    dtype: str = option("float32", "compute dtype (master weights stay float32)", resume=COMPUTATION, choices=tuple(DTYPES))
    remat: str = option(
        "none", resume=NEUTRAL, choices=REMAT_POLICIES,
        help="what each block keeps for the backward pass: none (everything), full (nothing: "
        "recompute the block), dots (matrix products), minimal (the projections' outputs), "
        "minimal_with_context (also the attention context)",
    )  # fmt: skip
    remat_offload: bool = option(False, "keep what --remat saves in host memory (GPU/TPU; not on the CPU)", resume=NEUTRAL)
    batch_chunks: int = option(
        1, resume=NEUTRAL, metavar="N",
        help="run the blocks on the local batch in N equal pieces, one after another (the "
        "same results; the backward pass works on one piece of a layer at a time: fewer "
        "temporaries, the same bytes on tp; under fsdp each piece gathers the parameters "
        "again; not with pp or MoE)",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """The updates: AdamW on a warmup-cosine schedule, clipping and the non-finite guard."""

    steps: int = option(200, "optimizer steps to train for", resume=COMPUTATION)
    lr: float = option(3e-3, "peak learning rate (AdamW)", resume=COMPUTATION)
    warmup: int = option(20, "linear warmup steps, then cosine decay", resume=COMPUTATION)
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay (0: none)", resume=COMPUTATION)
    clip_norm: float | None = option(1.0, "clip the gradient to this global norm; 0 or none: no clipping", resume=COMPUTATION, parse=parse_clip_norm, none_as=0)
    grad_accum: int = option(1, "gradient accumulation micro-steps per step", resume=COMPUTATION)
    max_skipped_steps: int = option(10, "stop with an error after this many consecutive steps skipped as non-finite", resume=NEUTRAL)


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The batches: their size and the seed of the initialisation and the data order."""

    batch_size: int = option(16, "global batch, in sequences", resume=COMPUTATION)
    seq_len: int = option(128, "sequence length, in bytes", resume=COMPUTATION)
    seed: int = option(0, "seed of the initialisation and of the data order", resume=COMPUTATION)
    data: str | None = option(None, "train on the token files `equishard tokenize` wrote to DIR (the vocabulary from its manifest; documents packed) instead of the standard library's bytes", resume=COMPUTATION, metavar="DIR")
    document_masking: bool = option(True, "with --data: let attention cross document boundaries and positions run on (off: each document attends to itself, positions restart)", resume=COMPUTATION)


@dataclasses.dataclass(frozen=True)
class FineTuneOptions:
    """What is trained: LoRA adapters on a frozen base, or a frozen subset of the model."""

    lora_rank: int | None = option(None, "train LoRA adapters of this rank on the frozen model (the base: --init-from's, or the seed's); only the adapters get gradients and optimizer state", resume=FIXED, metavar="R")
    lora_alpha: float | None = option(None, "LoRA's alpha: the adapters' update is scaled by alpha / rank (default: the rank, a scale of 1)", resume=FIXED, metavar="A")
    lora_dropout: float = option(0.0, "dropout on the adapters' input", resume=COMPUTATION)
    lora_targets: str = option("q,v", "the projections that get adapters, of q, k, v, o (attention) and gate, up, down (MLP)", resume=FIXED, metavar="T,...")
    freeze: str | None = option(None, "freeze the parameters whose path matches this regular expression (e.g. 'embed|blocks'): no gradient, no optimizer state; with --lora-rank the base is frozen already", resume=FIXED, metavar="PATTERN")
    init_adapters: str | None = option(None, "start the adapters from a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) made for the --init-from model; its rank, alpha and targets are used", resume=FIXED, metavar="DIR")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often checkpoints are saved, and how they are verified."""

    checkpoint_dir: str | None = option(None, "where checkpoints go (default: <run-dir>/checkpoints)", resume=NEUTRAL)
    checkpoint_every: int = option(50, "save a checkpoint every N steps (and at the end)", resume=NEUTRAL)
    keep_checkpoints: int = option(3, "how many of the latest checkpoints to keep (older ones are deleted)", resume=NEUTRAL)
    verify_checkpoints: bool = option(True, "neither record nor check the arrays' checksums in checkpoints", resume=NEUTRAL)
    require_verified: bool = option(False, "refuse to resume a checkpoint that carries no checksums (saved with --no-verify-checkpoints); without it such a step is restored with a warning", resume=NEUTRAL)


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """What a run writes and prints besides checkpoints."""

    run_dir: str = option("runs/train", "where metrics.jsonl and loss.png go", resume=NEUTRAL)
    eval_every: int = option(50, "evaluate on the validation split every N steps", resume=NEUTRAL)
    eval_batches: int = option(8, "batches of the validation split each evaluation averages over", resume=NEUTRAL)
    log_every: int = option(10, "print a step-log line every N steps (step, loss, grad norm, lr, step time, tokens/s, TFLOP/s, MFU, memory)", resume=NEUTRAL)
    sample_bytes: int = option(200, "bytes of text to generate at the end (0: none)", resume=NEUTRAL)
    progress: bool = option(True, "no progress bar", resume=NEUTRAL)
    plot: bool = option(True, "no loss-curve PNG", resume=NEUTRAL)
    tensorboard: bool = option(True, "no TensorBoard events (<run-dir>/tensorboard, written with tensorboardX)", resume=NEUTRAL)
    profile: str | None = option(None, "write a jax.profiler trace of steps START to STOP - 1 into <run-dir>/profile (TensorBoard's profile plugin and Perfetto read it), e.g. 10:15", resume=NEUTRAL, metavar="START:STOP")


@dataclasses.dataclass(frozen=True)
class StartOptions:
    """How a run was started: not part of what it is, never saved."""

    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir (any layout)", resume=START)
    resume_step: int | None = option(None, "continue from this checkpoint step instead of the latest (implies --resume)", resume=START)
    overwrite: bool = option(False, "start anew in a --run-dir that holds an earlier run: its files (checkpoints included) are moved into <run-dir>/previous-<UTC time>/, nothing is deleted", resume=START)


@dataclasses.dataclass(frozen=True)
class TrainConfig(StartOptions, LogOptions, CheckpointOptions, FineTuneOptions, DataOptions, OptimizerOptions, ModelOptions, LayoutOptions):
    """Everything `equishard train` takes (its options, one field each, flat:
    `config.batch_size`), made of the sections it inherits (layout first).

    See `equishard train --help` for each option's meaning and default.
    """


@dataclasses.dataclass(frozen=True)
class TrainCommand(TrainConfig):
    """`equishard train`'s command line: the run's configuration and the options of the
    command itself (not part of the run, not saved)."""

    config: str | None = option(None, "a TOML file of options (any option below, as batch_size = 16 or batch-size = 16, at the top level or in its section's table); flags given here override it. A run writes its resolved options to <run-dir>/config.toml", metavar="FILE")
    devices: int = option(8, "CPU devices to simulate (ignored on accelerators and under `equishard launch`, which splits its own --devices)")


WIDTH = 120
"""The columns `inspect` and `plan` fit their output to (`--wide`: no limit)."""


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """What `inspect` and `plan` compile and print (options of the commands, not saved)."""

    devices: int = option(8, "CPU devices to simulate; the layout must use them all")
    batch_size: int | None = option_like(DataOptions, "batch_size", resume=None)
    seq_len: int = option_like(DataOptions, "seq_len", help="sequence length, in tokens", resume=None)
    param_dtype: str = option("float32", "dtype the parameters and optimizer moments are stored in", choices=tuple(DTYPES))
    wide: bool = option(False, f"print every table at full width (default: fit {WIDTH} columns)")


_REPORT_DTYPE = "compute dtype (mixed precision, as train --dtype: the step casts the float32 parameters to it, gradients reduced in float32)"


@dataclasses.dataclass(frozen=True)
class InspectConfig(ReportOptions, ModelOptions, LayoutOptions):
    """`equishard inspect`: the reference GPT's (or a user's) step, compiled on the
    simulated devices."""

    model: str = option_like(
        ModelOptions, "model", choices=None, resume=None,
        help=f"model preset: {', '.join(PRESETS)}; or your own model as module:factory, where "
        "factory(layout) returns a dict with make_model (key -> model; traced for its shapes, "
        "never run), loss_fn, batch, batch_spec and optionally optimizer and view, as "
        "make_train_step takes them",
    )  # fmt: skip
    dtype: str = option_like(ModelOptions, "dtype", help=_REPORT_DTYPE, resume=None)
    params: bool = option(True, "leave out the per-parameter table")


@dataclasses.dataclass(frozen=True)
class PlanConfig(ReportOptions, ModelOptions, LayoutOptions):
    """`equishard plan`: the step compiled for a virtual mesh of up to thousands of devices."""

    layout: str = option_like(LayoutOptions, "layout", required=True)
    model: str = option_like(ModelOptions, "model", choices=None, required=True, resume=None, help=f"model preset: {', '.join(PRESETS)}")
    dtype: str = option_like(ModelOptions, "dtype", help=_REPORT_DTYPE, resume=None)
    devices: int = option_like(ReportOptions, "devices", required=True, help="devices of the mesh (the layout must use them all)")
    batch_size: int | None = option_like(ReportOptions, "batch_size", default=None, help="global batch in sequences (default: one per data shard and micro-batch)")
    seq_len: int = option_like(ReportOptions, "seq_len", default=2048)
    device_memory: str | None = option(None, "memory of one device, e.g. 80GiB (default: the --device's HBM, else 80GiB)")
    device: str | None = option(None, "the accelerator to estimate the step time and MFU on (peak FLOP/s, HBM, link bandwidth)", choices=sorted(DEVICE_PROFILES))


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """`equishard launch`: several local processes of one JAX multi-process run."""

    num_processes: int = option(2, "processes to start", short="-n")
    devices: int = option(8, "CPU devices to simulate in all, split evenly over the processes")
    grace: float = option(5.0, "seconds between SIGTERM and SIGKILL when stopping the processes", metavar="SECONDS")
    child: tuple[str, ...] = option((), "the command each process runs, after `--`", flag="child", nargs=argparse.REMAINDER, metavar="COMMAND")


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
    """`equishard tokenize`: text files into token files (see `_tokenize.tokenize`)."""

    inputs: tuple[str, ...] = option((), ".txt / .jsonl files (optionally .gz), or directories of them", flag="inputs", nargs="*", metavar="INPUT")
    stdlib: bool = option(False, "tokenize the corpus `equishard train` reads by default instead: the running Python's standard library (its top-level modules, a document each)")
    out: str = option("", "the token-file folder to write (must not exist, or be empty)", required=True, metavar="DIR")
    tokenizer: str | None = option(None, "a tokenizer.json (or a Hugging Face folder holding one)", metavar="FILE")
    train_bpe: int | None = option(None, "instead of --tokenizer: train a byte-level BPE of this vocabulary on the inputs", metavar="VOCAB")
    text_field: str = option("text", "the .jsonl records' text field (records with prompt/completion fields are read as instruction pairs)")
    val_every: int = option(20, "one document in this many goes to the validation split")
    workers: int = option(1, "threads encoding batches of documents")
    progress: bool = option(True, "a progress bar on a terminal")


@dataclasses.dataclass(frozen=True)
class RunSource:
    """A finished or stopped run to read: its directory, the layout and devices to use."""

    run_dir: str | None = option(None, "the run directory (its config.toml and verified checkpoints)")
    layout: str | None = option(None, "the layout to run under (default: the run's own)")
    devices: int = option(8, "CPU devices to simulate (ignored on accelerators)")


@dataclasses.dataclass(frozen=True)
class GenerateConfig(RunSource):
    """`equishard generate`: continue prompts with a run's latest verified checkpoint."""

    prompt: tuple[str, ...] = option((), "a prompt (repeat for a batch of prompts)", metavar="TEXT")
    prompt_file: str | None = option(None, "a file of prompts, one a line", metavar="FILE")
    max_new_tokens: int = option(200, "the most new tokens each prompt gets")
    max_len: int | None = option(None, "the key/value cache's length (default: the run's --seq-len, or what the prompts need)")
    temperature: float = option(0.0, "0: greedy; otherwise sample from the logits divided by it")
    top_k: int = option(0, "sample from the K most likely tokens (0: all)", metavar="K")
    top_p: float = option(1.0, "sample from the smallest set of tokens whose probability reaches P (nucleus; 1: all)", metavar="P")
    seed: int = option(0, "the sampling key's seed (each row's key comes from it and the row)")
    stop: tuple[str, ...] = option((), "a stop string (one byte for the byte model, one token for a tokenizer's); repeat for several", metavar="TEXT")
    gather: str = option("once", "under fsdp: gather the parameters once before decoding (once) or per layer in every step, as training does (per_layer)", choices=("once", "per_layer"))
    hf: str | None = option(None, "generate from a Hugging Face folder (config.json, safetensors, tokenizer.json) instead of a run", metavar="DIR")
    json: bool = option(False, "print one JSON object (tokens, texts, timings) instead of streaming the text")


@dataclasses.dataclass(frozen=True)
class EvalConfig(RunSource):
    """`equishard eval`: loss and perplexity of a run's latest verified checkpoint."""

    batches: int | None = option(None, "evaluate this many batches of validation windows (default: the run's --eval-batches)", metavar="N")
    seed: int | None = option(None, "the windows' seed (default: the run's; with --batches, a validation row's very windows)", metavar="S")
    whole_split: bool = option(False, "every window of the validation split instead of the sampled batches")
    json: bool = option(False, "print one JSON object")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """`equishard export`: a run's checkpoint as a Hugging Face folder."""

    run_dir: str = option("", "the run directory (its config.toml and verified checkpoints)", required=True)
    to: str = option("", "the folder to write (must not exist, or be empty)", required=True, metavar="DIR")
    step: int | None = option(None, "the checkpoint step (default: the latest; every array verified against its checksum)")
    dtype: str | None = option(None, "the tensors' dtype (default: the source checkpoint's, else float32)", choices=tuple(DTYPES))
    max_shard_gib: float = option(5.0, "the size limit of one safetensors file, in GiB", metavar="GIB")
    merged: bool = option(False, "a LoRA run: write the model with its adapters merged into the base weights (a Hugging Face model folder)")
    adapters: bool = option(False, "a LoRA run: write the adapters alone, as a PEFT folder (adapter_config.json, adapter_model.safetensors) for the run's --init-from base (the default for a LoRA run started from --init-from; --merged for one started from a seed)")
    devices: int = option(8, "CPU devices to simulate (ignored on accelerators)")


CONFIG_FILE = "config.toml"
"""The resolved configuration's name in the run directory."""


def load_config(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a TOML configuration file into `TrainConfig` field values.

    **Arguments:**

    - `path`: the file (keys spelled `batch_size` or `batch-size`, in their section's
      table, at the top level as runs wrote them before the sections, or in a `[train]`
      table).

    **Returns:**

    `{field: value}` for every key of the file.

    **Raises:**

    `LayerConfigError` for a missing or malformed file, an unknown key (naming the known
    ones) or a value of the wrong type (naming the option). Ranges are checked later,
    with the flags', by `check_options`.
    """
    return read_toml(path, TrainConfig)


def config_toml(config: TrainConfig) -> str:
    """The resolved configuration as TOML text, one table per section (`None` values,
    which TOML cannot say, and the `START` options `resume`, `resume_step`, `overwrite`
    left out; no clipping written `clip_norm = 0`)."""
    return _config_toml(
        config,
        header=(
            "The resolved options of this run (equishard train). Run it again with",
            "  equishard train --config config.toml --run-dir <another directory>",
        ),
    )


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
    return resume_changes(saved, config)


def layout_from_options(options: LayoutOptions) -> Layout:
    """The `Layout` that the layout options of `train`, `inspect` and `plan` name.

    **Arguments:**

    - `options`: the `LayoutOptions` (a `TrainConfig`, `InspectConfig` or `PlanConfig`).

    **Returns:**

    The `Layout` (not yet resolved: `Layout.resolve` checks it).
    """
    return Layout(
        options.layout,
        sequence_parallel=options.sequence_parallel,
        num_microbatches=options.microbatches,
        pipeline_repeats=options.pipeline_repeats,
        pipeline_schedule=options.pipeline_schedule,
        cp_impl=options.cp_impl,
        zero=options.zero,
        roles=_axis_roles(options.axis_roles),
    )


def _axis_roles(text: str) -> dict[str, str]:
    """`--axis-roles replica=data,model=tensor` as `{axis: role}` (roles checked by `Layout`)."""
    roles = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, sep, role = (x.strip() for x in part.partition("="))
        if not sep or not axis or not role:
            raise LayerConfigError(f"--axis-roles {text!r}: {part!r} is not AXIS=ROLE (e.g. 'model=tensor').")
        roles[axis] = role
    return roles
