"""Data sources indexed by global example, packed documents and per-process batches.

**The protocol.** A data source is anything with `len(source)` (examples per epoch) and
`source[i]` (example `i`: an array, or a dict of arrays of one shape each): a NumPy
array of windows, a Grain `MapDataset`, or `TokenFiles` (memory-mapped token files,
see the "Training on your own data" guide). A source may also define
`read(indices) -> batch` (the examples stacked), which `batch_at` then calls once
instead of indexing example by example.

**The order.** Global example `g` of a run is example `order(seed, e)[g mod n]` of the
source, `e = g div n` its epoch and `n = len(source)`: a permutation of the examples
per epoch keyed by `(seed, e)` only (`epoch_permutation`), so every example is seen
once per epoch and a batch is a pure function of `(seed, position)`, whatever the
layout or the number of processes.

**The rows.** `batch_at` reads, in each process, only the rows of the global batch its
devices hold (`equishard.distributed.global_array_from_rows`), and builds the global
arrays from them.

**Packing.** `pack_windows` turns windows of a flat token stream (documents each ended
by the tokenizer's end-of-text token) into a packed batch: a new document starts after
each end-of-text token, before each beginning-of-text token where the tokenizer has
one, and at the start of each window. `segment_ids` number the documents of a row,
`document_positions` restart at 0 at each document, and the label of a document's last
token (which would be the next document's first token) is `IGNORE_LABEL`: no token is
predicted across a boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import Int, Int32, Int64, Integer

from .._errors import EquishardError
from ..core import zigzag_indices
from ..distributed import global_array_from_rows, process_rows

IGNORE_LABEL = -1
"""The label of a token that is not predicted (a document's last token in a packed
sequence; a prompt's tokens under a loss mask): no loss, no gradient, not counted."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@runtime_checkable
class DataSource(Protocol):
    """Anything indexable by global example: `len(source)` and `source[i]`.

    `source[i]` is one example: an array (e.g. a window of `seq_len + 1` token ids) or a
    dict of arrays (e.g. `TokenFiles`' packed fields). NumPy arrays and Grain
    `MapDataset`s fit as they are.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective mix of `uint64` values (wrapping arithmetic).

    **Arguments:**

    - `x`: a `uint64` array.

    **Returns:**

    The mixed `uint64` array, same shape.
    """
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_bits(seed: int, counters: Int[np.ndarray, " n"]) -> np.ndarray:
    """`uint64` random bits, each a function of `(seed, counter)` only.

    Counter `c`'s bits are `mix(mix(seed) + (c + 1) * φ)` (`mix64`, φ =
    0x9E3779B97F4A7C15): SplitMix64's `c`-th output from the state `mix(seed)`, in NumPy
    `uint64` arithmetic, so they depend on neither the NumPy version nor the order of
    evaluation.

    **Arguments:**

    - `seed`: a non-negative integer below 2**64.
    - `counters`: non-negative integers.

    **Returns:**

    `uint64[n]`.

    **Raises:**

    `EquishardError` for a seed out of range.
    """
    if not 0 <= seed < 2**64:
        raise EquishardError(f"seed must be in [0, 2**64), got {seed}.")
    with np.errstate(over="ignore"):
        state = mix64(np.array([seed], dtype=np.uint64))
        counter = np.asarray(counters, dtype=np.uint64) + np.uint64(1)
        return mix64(state + counter * _GOLDEN)


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # The epoch's key: bits of (seed, epoch); the order: examples sorted by their bits.
    key = int(counter_bits(seed, np.array([epoch]))[0])
    order = np.argsort(counter_bits(key, np.arange(n, dtype=np.int64)), kind="stable")
    order.setflags(write=False)
    return order


def epoch_permutation(seed: int, epoch: int, n: int) -> Int64[np.ndarray, " n"]:
    """The order of a source's `n` examples in an epoch, keyed by `(seed, epoch)` only.

    **Arguments:**

    - `seed`: the data seed.
    - `epoch`: the epoch (0, 1, ...).
    - `n`: the number of examples.

    **Returns:**

    A permutation of `range(n)` (read-only; cached for the last epochs asked).
    """
    if n < 1:
        raise EquishardError(f"epoch_permutation: a source of {n} examples has no order.")
    return _permutation(int(seed), int(epoch), int(n))


def example_indices(
    source_len: int, positions: Int[np.ndarray, " b"], *, seed: int, shuffle: bool = True
) -> Int64[np.ndarray, " b"]:
    """The source's example index of each global example `positions[j]` of a run.

    Global example `g` is `epoch_permutation(seed, g // n, n)[g % n]` (`n = source_len`),
    or `g % n` without `shuffle`.

    **Arguments:**

    - `source_len`: `len(source)`.
    - `positions`: global example indices (a data position plus the batch's rows).
    - `seed`: the data seed.
    - `shuffle`: permute each epoch.

    **Returns:**

    `int64[b]`.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if source_len < 1:
        raise EquishardError("the data source is empty: it has no example to read.")
    within = positions % source_len
    if not shuffle:
        return within
    epochs = positions // source_len
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        rows = epochs == epoch
        out[rows] = epoch_permutation(seed, int(epoch), source_len)[within[rows]]
    return out


def read_examples(source: Any, indices: Int[np.ndarray, " b"]) -> Any:
    """The examples `indices` of `source`, stacked: an array `[b, ...]` or a dict of them.

    Calls `source.read(indices)` where the source defines it, otherwise `source[i]` for
    each index.

    **Arguments:**

    - `source`: a `DataSource`.
    - `indices`: the source's example indices.

    **Returns:**

    The batch, as NumPy arrays.
    """
    if hasattr(source, "read"):
        return source.read(np.asarray(indices, dtype=np.int64))
    examples = [source[int(i)] for i in indices]
    if isinstance(examples[0], dict):
        return {k: np.stack([np.asarray(e[k]) for e in examples]) for k in examples[0]}
    return np.stack([np.asarray(e) for e in examples])


def batch_at(
    source: Any,
    position: int,
    batch_size: int,
    *,
    seed: int,
    sharding: jax.sharding.Sharding | None = None,
    shuffle: bool = True,
    transform: Callable[[Any], Any] | None = None,
) -> Any:
    """The global batch at a data position: rows `position, ..., position + batch_size - 1`.

    Row `j` is global example `position + j` (see `example_indices`), a pure function of
    `(seed, position + j)`. With a `sharding` in a multi-process run, this process
    reads only the rows its devices hold (`equishard.distributed.process_rows`), each
    once, and the result is global `jax.Array`s (`global_array_from_rows`); otherwise
    the whole batch, as NumPy arrays.

    **Arguments:**

    - `source`: a `DataSource`.
    - `position`: the number of examples consumed before this batch.
    - `batch_size`: the global number of rows.
    - `seed`: the data seed.
    - `sharding`: the batch's sharding (rows split over the data axes).
    - `shuffle`: permute each epoch (`False`: examples in the source's order).
    - `transform`: applied to the rows read (e.g. `functools.partial(token_batch, cp=2)`).

    **Returns:**

    An array `[batch_size, ...]` or a dict of them.

    **Raises:**

    `EquishardError` for a source shorter than one batch or a negative position.
    """
    n = len(source)
    if position < 0 or batch_size < 1:
        raise EquishardError(f"batch_at: position={position} and batch_size={batch_size}.")
    if n < batch_size:
        raise EquishardError(
            f"the data source has {n} examples, fewer than one batch of {batch_size}: use a "
            f"smaller batch or sequence length, or more data."
        )

    def rows(start: int, stop: int) -> Any:
        indices = example_indices(n, np.arange(position + start, position + stop), seed=seed, shuffle=shuffle)
        batch = read_examples(source, indices)
        return batch if transform is None else transform(batch)

    if sharding is None or jax.process_count() == 1:
        return rows(0, batch_size)
    # This process's runs of rows, each read once (all fields at a time): only the rows
    # are split over processes, so a shape of the sharding's rank with any trailing sizes
    # names the same rows. f32[b_run, ...] per run
    rank = max(len(getattr(sharding, "spec", ())), 1)
    probe = (batch_size,) + (len(sharding.device_set),) * (rank - 1)
    local = {(r.start, r.stop): rows(r.start, r.stop) for r in process_rows(sharding, probe)}
    first = next(iter(local.values()))
    shape = lambda a: (batch_size, *np.shape(a)[1:])  # noqa: E731
    if isinstance(first, dict):
        return {
            k: global_array_from_rows(sharding, shape(first[k]), lambda a, b, k=k: local[(a, b)][k])
            for k in first
        }
    return global_array_from_rows(sharding, shape(first), lambda a, b: local[(a, b)])


def pack_windows(
    windows: Integer[np.ndarray, "b t_plus_1"],
    *,
    eot: int,
    bos: int | None = None,
    loss_mask: np.ndarray | None = None,
    cp: int = 1,
) -> dict[str, Int32[np.ndarray, "b t"]]:
    """A packed batch from windows of a token stream whose documents end in `eot`.

    A new document starts at each window's start, after each `eot` and at each `bos`
    (where given). For inputs `windows[:, :-1]`: `labels` are `windows[:, 1:]` except
    where the next token starts a new document or is masked by `loss_mask` (both
    `IGNORE_LABEL`), `segment_ids` number the documents of each row from 0,
    `document_positions` count from 0 at each document's first token, and `positions`
    are `0, ..., T - 1` (for `GPTConfig(document_masking=False)`). With `cp > 1` all five
    are permuted along the sequence by `equishard.core.zigzag_indices(T, cp)`, as
    `equishard.models.token_batch` does.

    **Arguments:**

    - `windows`: `int[b, T + 1]` or `uint[b, T + 1]` (as token files hold them).
    - `eot`: the end-of-text token id.
    - `bos`: the beginning-of-text token id, or `None`.
    - `loss_mask`: `[b, T + 1]`, nonzero where a token is to be predicted (e.g. zero
      on a prompt's tokens); default: every token.
    - `cp`: the context-parallel axis size.

    **Returns:**

    `{"inputs", "labels", "positions", "segment_ids", "document_positions"}`, each
    `int32[b, T]`.
    """
    # Signed: a uint16 array would turn the ignored labels' -100 into 65535.
    windows = np.asarray(windows).astype(np.int64, copy=False)
    b, t1 = windows.shape
    t = t1 - 1
    # bool[b, T + 1]: token j starts a document.
    starts = np.zeros((b, t1), bool)
    starts[:, 0] = True
    starts[:, 1:] |= windows[:, :-1] == eot
    if bos is not None:
        starts |= windows == bos
    segments = np.cumsum(starts, axis=1) - 1  # int[b, T + 1]
    index = np.broadcast_to(np.arange(t1), (b, t1))
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    keep = ~starts[:, 1:]
    if loss_mask is not None:
        keep &= np.asarray(loss_mask)[:, 1:] != 0
    out = {
        "inputs": windows[:, :-1],
        "labels": np.where(keep, windows[:, 1:], IGNORE_LABEL),
        "positions": np.broadcast_to(np.arange(t), (b, t)),
        "segment_ids": segments[:, :-1],
        "document_positions": (index - first)[:, :-1],
    }
    out = {k: np.ascontiguousarray(v, dtype=np.int32) for k, v in out.items()}
    if cp > 1:
        order = zigzag_indices(t, cp)
        out = {k: v[:, order] for k, v in out.items()}
    return out
