"""Hugging Face checkpoints for the application: a run started from one
(`equishard train --init-from DIR`) and a run's checkpoint exported as one
(`equishard export --run-dir RUN --to DIR`).

A run started from a Hugging Face folder keeps that folder's `config.json` and tokenizer
files in `<run-dir>/hf-source/`: the export writes the same architecture (Mistral stays
Mistral, Qwen2 Qwen2) and the same tokenizer; a run of a preset exports as
`LlamaForCausalLM`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .._errors import CheckpointError
from ..models import (
    GPT,
    GPTConfig,
    copy_tokenizer,
    gpt_config_from_hf,
    load_hf,
    read_hf_config,
)
from ..sharding import Parallelism
from ._rundir import LOCK, _alive, _holder

HF_SOURCE = "hf-source"
"""The folder of a run directory holding the `config.json` and tokenizer files of the
Hugging Face checkpoint the run started from."""


def init_from_hf(
    folder: str | os.PathLike[str], layout: Parallelism, mesh: Mesh, *,
    run_dir: str | os.PathLike[str] | None = None, dtype: Any = np.float32, seq_len: int | None = None,
) -> tuple[GPTConfig, GPT]:  # fmt: skip
    """The model of `equishard train --init-from DIR`: a `GPT` under `layout` read from
    the Hugging Face folder `folder`, each device reading its own blocks.

    **Arguments:**

    - `folder`: `config.json` and safetensors (see `equishard.models.load_hf`).
    - `layout`, `mesh`: the run's resolved layout and its mesh.
    - `run_dir`: if given, `folder`'s `config.json` and tokenizer files are copied into
      `<run_dir>/hf-source/` (for the export), after the model has loaded.
    - `dtype`: the parameters' dtype (bf16 checkpoints are cast to it).
    - `seq_len`: the run's sequence length (checked against a sliding window).

    **Returns:**

    `(config, model)`: the `GPTConfig` (give it to the run in place of a preset's) and
    the loaded `GPT`.

    **Raises:**

    `CheckpointError` naming the architecture, option, file or tensor at fault, before any
    tensor is read, or for a `<run_dir>/hf-source/` that exists already. (A vocabulary
    the tensor axis does not divide is padded: `GPTConfig.real_vocab_size`.)
    """
    folder = os.fspath(folder)
    hf_model_config(folder, layout, seq_len=seq_len)  # refused before any tensor is read
    model = load_hf(folder, layout, mesh, dtype=dtype, seq_len=seq_len)
    if run_dir is not None:
        record_hf_source(folder, run_dir)
    return model.config, model


def hf_model_config(folder: str | os.PathLike[str], layout: Parallelism, *, seq_len: int | None = None) -> GPTConfig:
    """The `GPTConfig` of `equishard train --init-from DIR` under `layout`, from
    `DIR/config.json` alone (no tensor read).

    **Raises:** `CheckpointError` as `init_from_hf` does.
    """
    folder = os.fspath(folder)
    tp = layout.size(layout.tensor)  # the vocabulary is padded to a multiple of it
    config = gpt_config_from_hf(read_hf_config(folder), vocab_multiple=tp, seq_len=seq_len)
    return config


def record_hf_source(folder: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> pathlib.Path:
    """Copy `folder`'s `config.json` and tokenizer files into `<run_dir>/hf-source/`.

    **Raises:**

    `CheckpointError` if `<run_dir>/hf-source/` exists (nothing is written over).
    """
    target = pathlib.Path(run_dir) / HF_SOURCE
    if target.exists():
        raise CheckpointError(f"{target} exists: the run already records the checkpoint it started from.")
    tmp = target.with_name(f".{HF_SOURCE}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(os.path.join(folder, "config.json"), tmp / "config.json")
        copy_tokenizer(os.fspath(folder), os.fspath(tmp))
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def run_model_config(run_dir: str | os.PathLike[str], *, vocab_multiple: int = 1) -> GPTConfig | None:
    """The `GPTConfig` of a run started from a Hugging Face checkpoint (read from
    `<run_dir>/hf-source/config.json`), or `None` for a run of a preset."""
    source = pathlib.Path(run_dir) / HF_SOURCE
    if not (source / "config.json").exists():
        return None
    return gpt_config_from_hf(read_hf_config(os.fspath(source)), vocab_multiple=vocab_multiple)


def refuse_live(run_dir: pathlib.Path) -> None:
    """Refuse a run directory whose run is alive on this host: opening its checkpoints
    would tidy away the temporary folders of the saves it is writing."""
    holder = _holder(run_dir / LOCK)
    pid = None if holder is None else holder.get("pid")
    if holder and (holder.get("host") != socket.gethostname() or not isinstance(pid, int) or _alive(pid)):
        raise CheckpointError(
            f"{run_dir} is locked by a live run (pid {pid} on host {holder.get('host')}): export its "
            f"checkpoint once it has ended."
        )
