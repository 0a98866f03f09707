"""`equishard export`: a run's checkpoint as a Hugging Face folder (the run rebuilt from its
`config.toml`, its checkpoint restored, the model written by `equishard.models.export_hf`),
or a LoRA run's adapters as a PEFT folder (`equishard.models.export_peft`)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError, LayerConfigError
from ..models import export_hf, export_peft, merge_lora, read_hf_config
from ..models._internal import canonical_path
from ._config import CONFIG_FILE, TrainConfig, load_config
from ._hf import HF_SOURCE, refuse_live
from ._run import Run


def export_run(
    run_dir: str | os.PathLike[str], to: str | os.PathLike[str], *, step: int | None = None,
    dtype: Any = None, max_shard_bytes: int = 5 * 2**30, make_run: Callable[[TrainConfig], Any] | None = None,
    what: str | None = None,
) -> tuple[str, str]:  # fmt: skip
    """`equishard export --run-dir RUN --to DIR`: a run's checkpoint as a Hugging Face folder.

    **Arguments:**

    - `run_dir`: the run directory (its `config.toml` and checkpoints).
    - `to`: the target folder (must not exist, or be empty).
    - `step`: the checkpoint step (default: the latest; every array is verified against
      its checksum, and a damaged step is refused naming the newest intact one).
    - `dtype`: the tensors' dtype (default: the source checkpoint's, else float32).
    - `max_shard_bytes`: the size limit of one safetensors file.
    - `make_run`: builds the run's pieces from its options (default `Run`).
    - `what`: `"merged"` (the model, a LoRA run's adapters merged into its base
      weights: a Hugging Face model folder), `"adapters"` (a LoRA run's adapters alone:
      a PEFT folder for its `--init-from` base) or `None`: the adapters for a LoRA run
      started from `--init-from` (its base is a Hugging Face folder already), else the
      model.

    **Returns:**

    `(to, what)`: the folder and what it holds (`"merged"`, `"adapters"` or `"model"`).

    **Raises:**

    `CheckpointError` for a run without a `config.toml` or checkpoint, a live run, a
    damaged step, a target that is not empty or an MoE model; `LayerConfigError` for
    `what="adapters"` of a run without adapters, or an unknown `what`.
    """
    from ..train import Checkpointer  # orbax, the `train` extra

    run_dir = pathlib.Path(run_dir)
    to = os.fspath(to)
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        raise CheckpointError(f"export: the target {to} exists and is not empty; choose a new folder.")
    if not (run_dir / CONFIG_FILE).exists():
        raise CheckpointError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE}.")
    refuse_live(run_dir)
    config = TrainConfig(**load_config(run_dir / CONFIG_FILE))
    what = _what(config, what)
    source = run_dir / HF_SOURCE
    trains_part = config.lora_rank is not None or config.init_adapters is not None or config.freeze is not None
    if config.init_from is not None and source.is_dir() and not trains_part:
        # The folder it started from, as recorded (its weights are in the checkpoint);
        # a run that trained part of its model needs its base's weights: the folder.
        config = dataclasses.replace(config, init_from=os.fspath(source))
    r = (make_run or Run)(config)
    checkpoint_dir = pathlib.Path(config.checkpoint_dir or run_dir / "checkpoints")
    with Checkpointer(checkpoint_dir, path_map=canonical_path, checksums=config.verify_checkpoints) as ckpt:
        state = r.restore(ckpt, step)
    if what == "adapters":
        base = os.fspath(config.init_from) if config.init_from is not None else ""
        return export_peft(state.model, to, base_model_name_or_path=base, dtype=dtype), what
    hf = read_hf_config(os.fspath(source)) if (source / "config.json").exists() else None
    # The tokenizer the run read: the Hugging Face folder's, or its token files'.
    tokenizer = os.fspath(source) if source.is_dir() else config.data
    model = merge_lora(state.model) if r.lora is not None else state.model
    written = export_hf(
        model, to, hf_config=hf, dtype=dtype, max_shard_bytes=max_shard_bytes, tokenizer_from=tokenizer,
    )  # fmt: skip
    return written, "merged" if r.lora is not None else "model"


def _what(config: TrainConfig, what: str | None) -> str:
    """What `export_run` writes for this run: `"merged"` or `"adapters"` (see there)."""
    lora = config.lora_rank is not None or config.init_adapters is not None
    if what is None:
        return "adapters" if lora and config.init_from is not None else "merged"
    if what not in ("merged", "adapters"):
        raise LayerConfigError(f"export: what must be 'merged' or 'adapters', got {what!r}.")
    if what == "adapters" and not lora:
        raise LayerConfigError(
            "export --adapters: the run trained no LoRA adapters (no --lora-rank or "
            "--init-adapters); export its model (without --adapters)."
        )
    return what
