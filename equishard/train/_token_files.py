"""`TokenFiles`: a tokenized corpus on disk as a packed-sequence data source.

The files (written by `equishard tokenize`): `manifest.json`, written last, and per split
and shard a flat array of token ids (`<split>-<shard>.bin`, the manifest's `dtype`,
`uint16` when the vocabulary fits), each document ended by the tokenizer's end-of-text
token, with an optional loss mask beside it (`<split>-<shard>.mask.bin`, `uint8`, 0 on a
prompt's tokens). Shards are memory-mapped; a read touches only the windows asked for.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, ClassVar

import numpy as np
from jaxtyping import Int

from .._errors import EquishardError
from ._data import pack_windows

MANIFEST = "manifest.json"
FORMAT = "equishard-tokens/1"


class TokenFiles:
    """A split of a tokenized corpus as packed sequences of `seq_len + 1` tokens.

    Sequence `i` of a shard is its tokens `[i seq_len, (i + 1) seq_len + 1)` (the last
    token is the next sequence's first: every token is an input once per epoch); the
    sequences of the shards are numbered one after another. `source[i]` and
    `source.read(indices)` give `pack_windows`' fields (documents split at the
    end-of-text and beginning-of-text tokens, labels masked at boundaries and on
    prompt tokens), in zigzag order over `cp`.

    **Arguments:**

    - `directory`: the folder `equishard tokenize` wrote.
    - `seq_len`: tokens per input sequence.
    - `split`: `"train"` or `"val"`.
    - `cp`: the context-parallel axis size (the fields' order along the sequence).

    **Raises:**

    `EquishardError` for a folder without a manifest (an interrupted tokenize), a
    manifest of another format, a shard missing or shorter than the manifest says, or
    a split too short for one sequence.
    """

    MANIFEST: ClassVar[str] = MANIFEST
    """The manifest's file name, written last."""
    FORMAT: ClassVar[str] = FORMAT
    """The manifest's `format`."""

    def __init__(self, directory: str | pathlib.Path, seq_len: int, *, split: str = "train", cp: int = 1):
        self.directory = pathlib.Path(directory)
        self.manifest = read_manifest(self.directory)
        splits = self.manifest["splits"]
        if split not in splits:
            raise EquishardError(f"{self.directory / MANIFEST}: no split {split!r} (it has {sorted(splits)}).")
        if seq_len < 1:
            raise EquishardError(f"TokenFiles: seq_len must be positive, got {seq_len}.")
        self.seq_len, self.split, self.cp = seq_len, split, cp
        tok = self.manifest["tokenizer"]
        self.eot: int = tok["eot"]
        self.bos: int | None = tok.get("bos")
        self.vocab_size: int = tok["vocab_size"]
        dtype = np.dtype(self.manifest["dtype"])
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray | None] = []
        counts = []
        for shard in splits[split]["shards"]:
            self._tokens.append(_map(self.directory / shard["file"], dtype, shard["tokens"]))
            mask = shard.get("mask")
            self._masks.append(None if mask is None else _map(self.directory / mask, np.dtype(np.uint8), shard["tokens"]))
            counts.append(max((shard["tokens"] - 1) // seq_len, 0))
        self._ends = np.cumsum(counts)
        if not len(self._ends) or self._ends[-1] == 0:
            raise EquishardError(
                f"{self.directory}: the {split!r} split holds too few tokens for one sequence of "
                f"seq_len + 1 = {seq_len + 1}."
            )

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.read(np.array([index])).items()}

    def read_range(self, shard: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens `[start, stop)` of a shard (and its loss mask): the only read of the files."""
        mask = self._masks[shard]
        return np.asarray(self._tokens[shard][start:stop]), None if mask is None else np.asarray(mask[start:stop])

    def read(self, indices: Int[np.ndarray, " b"]) -> dict[str, np.ndarray]:
        """The packed sequences `indices`, stacked (see the class documentation)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise EquishardError(f"TokenFiles: sequence indices out of range [0, {len(self)}).")
        shards = np.searchsorted(self._ends, indices, side="right")
        t1 = self.seq_len + 1
        windows = np.empty((len(indices), t1), np.int64)
        masks = np.ones((len(indices), t1), np.uint8)
        for row, (i, s) in enumerate(zip(indices, shards)):
            local = int(i - (self._ends[s - 1] if s else 0))
            tokens, mask = self.read_range(int(s), local * self.seq_len, local * self.seq_len + t1)
            windows[row] = tokens
            if mask is not None:
                masks[row] = mask
        has_mask = any(m is not None for m in self._masks)
        return pack_windows(windows, eot=self.eot, bos=self.bos, loss_mask=masks if has_mask else None, cp=self.cp)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a model whose vocabulary does not hold every token id of the files.

        **Raises:**

        `EquishardError` naming both sizes.
        """
        if self.vocab_size > vocab_size:
            raise EquishardError(
                f"{self.directory}: the tokenizer's vocabulary of {self.vocab_size} has token "
                f"ids >= the model's vocabulary of {vocab_size}."
            )


def read_manifest(directory: pathlib.Path) -> dict[str, Any]:
    """The manifest of a tokenized corpus, checked for its format.

    **Raises:**

    `EquishardError` for a missing manifest (no data set, or an interrupted tokenize)
    or one of another format.
    """
    path = directory / MANIFEST
    if not path.is_file():
        raise EquishardError(
            f"{directory} has no {MANIFEST}: not a tokenized corpus, or its tokenize was "
            f"interrupted (a complete one writes its manifest last)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EquishardError(f"{path} does not parse: {err}.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EquishardError(f"{path}: not a manifest of format {FORMAT!r}.")
    return manifest


def _map(path: pathlib.Path, dtype: np.dtype, count: int) -> np.ndarray:
    if not path.is_file():
        raise EquishardError(f"{path}, named by the manifest, is missing.")
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise EquishardError(
            f"{path} holds {size} bytes; the manifest says {count} tokens of {dtype} "
            f"({count * dtype.itemsize} bytes): the file is truncated or not this data set's."
        )
    if count == 0:
        return np.zeros((0,), dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
