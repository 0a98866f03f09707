"""`equishard export`: a run's checkpoint as a Hugging Face folder (the run rebuilt from its
`config.toml`, its checkpoint restored, the model written by `equishard.models.export_hf`)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError
from ..models import export_hf, read_hf_config
from ..models._internal import canonical_path
from ._config import CONFIG_FILE, TrainConfig, load_config
from ._hf import HF_SOURCE, refuse_live
from ._run import Run


def export_run(
    run_dir: str | os.PathLike[str], to: str | os.PathLike[str], *, step: int | None = None,
    dtype: Any = None, max_shard_bytes: int = 5 * 2**30, make_run: Callable[[TrainConfig], Any] | None = None,
) -> str:  # fmt: skip
    """`equishard export --run-dir RUN --to DIR`: a run's checkpoint as a Hugging Face folder.

    **Arguments:**

    - `run_dir`: the run directory (its `config.toml` and checkpoints).
    - `to`: the target folder (must not exist, or be empty).
    - `step`: the checkpoint step (default: the latest; every array is verified against
      its checksum, and a damaged step is refused naming the newest intact one).
    - `dtype`: the tensors' dtype (default: the source checkpoint's, else float32).
    - `max_shard_bytes`: the size limit of one safetensors file.
    - `make_run`: builds the run's pieces from its options (default `Run`; its
      `state_template()` and `mesh` are read).

    **Returns:**

    `to`.

    **Raises:**

    `CheckpointError` for a run without a `config.toml` or checkpoint, a live run, a
    damaged step, a target that is not empty or an MoE model.
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
    source = run_dir / HF_SOURCE
    if config.init_from is not None and source.is_dir():  # the folder it started from, as recorded
        config = dataclasses.replace(config, init_from=os.fspath(source))
    r = (make_run or Run)(config)
    checkpoint_dir = pathlib.Path(config.checkpoint_dir or run_dir / "checkpoints")
    with Checkpointer(checkpoint_dir, path_map=canonical_path, checksums=config.verify_checkpoints) as ckpt:
        state = ckpt.restore(r.state_template(), step=step, mesh=r.mesh)
    hf = read_hf_config(os.fspath(source)) if (source / "config.json").exists() else None
    # The tokenizer the run read: the Hugging Face folder's, or its token files'.
    tokenizer = os.fspath(source) if source.is_dir() else config.data
    return export_hf(
        state.model, to, hf_config=hf, dtype=dtype, max_shard_bytes=max_shard_bytes, tokenizer_from=tokenizer,
    )  # fmt: skip
