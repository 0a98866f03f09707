"""A byte-level corpus every machine has, and position-indexed batches.

**The corpus.** The Python standard library's own source files, read from the running
interpreter's `sysconfig.get_paths()["stdlib"]` directory, so nothing is downloaded
and nothing depends on the working directory or on installed site-packages. The
selection is fixed (`stdlib_files`): every top-level `*.py` file of that directory
(no subdirectories, so no `test/`, no `site-packages/`), sorted by file name, except
the build-generated `_sysconfigdata*.py` and the site-local `sitecustomize.py` /
`usercustomize.py`. On CPython 3.11.7 that is 167 files and 4.66 MB, on 3.12.1 163
files and 4.53 MB. The corpus is their bytes concatenated in that order, with nothing
in between. The vocabulary is the 256 byte values; the unigram (context-free) entropy
of the training bytes is 3.14 nats per byte on both versions.

**The split.** Whole files are held out: in the sorted list, file `i` goes to
validation if `i % 20 == 19` (every 20th file: 8 files, 266 kB or 5.7 % of the bytes
on CPython 3.11.7; 124 kB or 2.7 % on 3.12.1) and to training otherwise. No file
contributes to both, so validation text is never trained on.

**Batches.** `get_batch` is a pure function of the data position (the number of
samples consumed so far): sample `g` of the run starts at an offset given by a
counter-based random number generator keyed on `(seed, g)` only. A batch is therefore
the same whatever the number of processes or devices, and a run resumed at position
`p` sees exactly the batches an uninterrupted run saw from `p` on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sysconfig
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from jaxtyping import Int, Int32, Int64, UInt8

from .._errors import EquishardError
from ..train import counter_bits

VAL_EVERY = 20
"""One file in `VAL_EVERY` (sorted index `i % VAL_EVERY == VAL_EVERY - 1`) is validation."""

_EXCLUDED_PREFIXES = ("_sysconfigdata",)
_EXCLUDED_NAMES = frozenset({"sitecustomize.py", "usercustomize.py"})


def stdlib_dir() -> pathlib.Path:
    """The directory of the running interpreter's standard library.

    **Returns:**

    `sysconfig.get_paths()["stdlib"]` as an absolute path (inside a virtual environment
    this is the base interpreter's standard library).
    """
    return pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files() -> tuple[pathlib.Path, ...]:
    """The fixed selection of standard-library source files the corpus is made of.

    Every top-level `*.py` file of `stdlib_dir()`, sorted by file name, except the
    build-generated `_sysconfigdata*.py` and the site-local `sitecustomize.py` /
    `usercustomize.py`.

    **Returns:**

    The absolute paths, in corpus order.
    """
    return _stdlib_files()


@functools.cache
def _stdlib_files() -> tuple[pathlib.Path, ...]:
    root = stdlib_dir()
    files = [
        p
        for p in root.glob("*.py")
        if p.is_file()
        and p.name not in _EXCLUDED_NAMES
        and not p.name.startswith(_EXCLUDED_PREFIXES)
    ]
    if not files:
        raise EquishardError(
            f"found no standard-library source files (*.py) in {root}, the directory "
            f"sysconfig reports for this interpreter; this Python installation ships no "
            f"sources, so the built-in corpus is unavailable."
        )
    return tuple(sorted(files, key=lambda p: p.name))


@functools.cache
def _stdlib_documents() -> tuple[bytes, ...]:
    return tuple(p.read_bytes() for p in stdlib_files())


def stdlib_corpus() -> bytes:
    """The whole corpus: the bytes of `stdlib_files()` concatenated in order.

    Read once per process and cached.

    **Returns:**

    The corpus as `bytes` (several MB).
    """
    return _stdlib_corpus()


@functools.cache
def _stdlib_corpus() -> bytes:
    return b"".join(_stdlib_documents())


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """A training and a held-out validation split of a byte corpus.

    **Arguments:**

    - `train`: the training bytes, `uint8[n_train]`.
    - `val`: the validation bytes, `uint8[n_val]`.
    """

    train: UInt8[np.ndarray, " n_train"]
    val: UInt8[np.ndarray, " n_val"]
    vocab_size: ClassVar[int] = 256

    @classmethod
    def from_documents(
        cls, documents: Sequence[bytes], *, val_every: int = VAL_EVERY
    ) -> "ByteCorpus":
        """Split whole documents: document `i` is validation iff `i % val_every == val_every - 1`.

        **Arguments:**

        - `documents`: the documents (e.g. files' bytes), in a fixed order.
        - `val_every`: one document in this many is held out (at least 2).

        **Returns:**

        A `ByteCorpus` whose splits are the concatenations of their documents (read-only
        arrays).
        """
        if val_every < 2:
            raise EquishardError(f"val_every must be at least 2, got {val_every}.")
        if len(documents) < val_every:
            raise EquishardError(
                f"{len(documents)} documents cannot be split one in {val_every}: there "
                f"would be no validation document."
            )
        held_out = [i % val_every == val_every - 1 for i in range(len(documents))]
        train = b"".join(d for d, h in zip(documents, held_out) if not h)
        val = b"".join(d for d, h in zip(documents, held_out) if h)
        return cls(
            train=_readonly(np.frombuffer(train, dtype=np.uint8).copy()),
            val=_readonly(np.frombuffer(val, dtype=np.uint8).copy()),
        )


def corpus_identity(*, val_every: int = VAL_EVERY) -> dict[str, object]:
    """What a checkpoint records of the corpus it was trained on, to refuse resuming on another.

    **Arguments:**

    - `val_every`: the validation split's rule (see `load_stdlib_corpus`).

    **Returns:**

    `{"files": count, "bytes": size, "sha256": hash of the concatenated bytes,
    "val_every": val_every}`: two Pythons whose standard libraries differ give
    different identities (and different batches at the same data position).
    """
    data = stdlib_corpus()
    return {
        "files": len(stdlib_files()),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "val_every": val_every,
    }


def load_stdlib_corpus(*, val_every: int = VAL_EVERY) -> ByteCorpus:
    """The standard-library corpus split into training and validation bytes.

    Files are those of `stdlib_files()`; file `i` (in that order) is validation iff
    `i % val_every == val_every - 1`. Cached per process.

    **Arguments:**

    - `val_every`: one file in this many is held out (default 20, about 5 %).

    **Returns:**

    A `ByteCorpus` (vocabulary 256).
    """
    return _load_stdlib_corpus(val_every)


@functools.cache
def _load_stdlib_corpus(val_every: int) -> ByteCorpus:
    return ByteCorpus.from_documents(_stdlib_documents(), val_every=val_every)


def sample_offsets(
    sample_indices: Int[np.ndarray, " n"], num_offsets: int, *, seed: int
) -> Int64[np.ndarray, " n"]:
    """The window offsets of samples, each a function of `(seed, sample index)` only.

    Sample `g`'s offset is the `g`-th output of a SplitMix64 stream whose state starts at
    `mix(seed)` (`mix` is SplitMix64's finaliser), i.e. `mix(mix(seed) + (g + 1) * φ)`
    with φ = 0x9E3779B97F4A7C15, reduced modulo `num_offsets`. It is counter-based (no
    state carried from sample to sample) and written in NumPy `uint64` arithmetic, so
    the values depend on neither the NumPy version nor the order of evaluation.

    **Arguments:**

    - `sample_indices`: a 1-D array of global sample indices (non-negative integers).
    - `num_offsets`: offsets are drawn from `range(num_offsets)`.
    - `seed`: a non-negative integer below 2**64.

    **Returns:**

    An `int64` array of offsets, one per index.
    """
    bits = counter_bits(seed, sample_indices)  # mix(mix(seed) + (g + 1) φ), uint64
    return (bits % np.uint64(num_offsets)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class ByteWindows:
    """A byte corpus as a data source (`equishard.train.DataSource`): example `g` is the
    window of `seq_len + 1` bytes at `sample_offsets([g], len(data) - seq_len, seed=seed)`.

    Its examples are random windows, not an epoch's permutation: read it with
    `equishard.train.batch_at(..., shuffle=False)` (its length is unbounded in practice).

    **Arguments:**

    - `data`: the bytes (`ByteCorpus.train` or `.val`), more than `seq_len` of them.
    - `seq_len`: tokens per input sequence.
    - `seed`: the data seed.
    """

    data: UInt8[np.ndarray, " n"]
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        if len(self.data) - self.seq_len < 1:
            raise EquishardError(
                f"the data holds {len(self.data)} bytes, too few for one window of seq_len + 1 = "
                f"{self.seq_len + 1} bytes."
            )

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read(np.array([index]))[0]

    def read(self, indices: Int[np.ndarray, " b"]) -> Int32[np.ndarray, "b seq_len_plus_1"]:
        """The windows of examples `indices`, `int32[b, seq_len + 1]`."""
        starts = sample_offsets(indices, len(self.data) - self.seq_len, seed=self.seed)
        windows = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
        return np.asarray(self.data)[windows].astype(np.int32)


def get_batch(
    data: UInt8[np.ndarray, " n"],
    position: int,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
) -> Int32[np.ndarray, "batch_size seq_len_plus_1"]:
    """The global batch at a data position.

    Row `j` is sample `g = position + j` of the run: the `seq_len + 1` bytes of `data`
    starting at `sample_offsets([g], len(data) - seq_len, seed=seed)`. Inputs are
    `batch[:, :-1]`, targets `batch[:, 1:]` (see `split_batch`). Advance `position` by
    `batch_size` per step.

    **Arguments:**

    - `data`: the bytes to sample from (`ByteCorpus.train` or `.val`).
    - `position`: the number of samples consumed before this batch.
    - `batch_size`: the global number of rows.
    - `seq_len`: tokens per input sequence; each row holds `seq_len + 1` bytes.
    - `seed`: the data seed.

    Across processes, each process reads only the rows its devices hold: see
    `ByteWindows` and `equishard.train.batch_at`.

    **Returns:**

    `int32[batch_size, seq_len + 1]`.
    """
    if position < 0 or batch_size < 1 or seq_len < 1:
        raise EquishardError(
            f"get_batch needs position >= 0, batch_size >= 1 and seq_len >= 1; got "
            f"position={position}, batch_size={batch_size}, seq_len={seq_len}."
        )
    indices = np.arange(position, position + batch_size, dtype=np.int64)
    return ByteWindows(data, seq_len, seed).read(indices)


def split_batch(
    batch: Int32[np.ndarray, "b t_plus_1"],
) -> tuple[Int32[np.ndarray, "b t"], Int32[np.ndarray, "b t"]]:
    """Inputs and next-byte targets of a batch from `get_batch`.

    **Arguments:**

    - `batch`: `int32[b, seq_len + 1]`.

    **Returns:**

    `(batch[:, :-1], batch[:, 1:])`, each `int32[b, seq_len]`.
    """
    return batch[:, :-1], batch[:, 1:]


def unigram_entropy(data: UInt8[np.ndarray, " n"]) -> float:
    """The entropy of the byte frequencies of `data`, in nats per byte.

    The loss of the best model that ignores context: a baseline a language model must
    beat.

    **Arguments:**

    - `data`: bytes.

    **Returns:**

    `-sum(p * log p)` over the byte values that occur.
    """
    if len(data) == 0:
        raise EquishardError("the unigram entropy of empty data is undefined.")
    counts = np.bincount(np.asarray(data), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

