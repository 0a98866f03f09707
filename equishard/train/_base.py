"""The frozen base of a fine-tuning run: which stored arrays it is, and its fingerprint.

A checkpoint of the trained part (`Checkpointer.save(..., trainable=...)`) leaves the
frozen arrays out and records a fingerprint of them; restoring takes them from a base
given again (`Checkpointer.restore(..., base=model)`) and refuses a base whose
fingerprint differs. The fingerprint reuses the checkpoints' own checksums (a 64-bit
integer sum of each global array's bits weighted by position, computed on the devices
that hold it: the same under every layout and process count), combined with each array's
stored path, shape and dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from ._format import Entry, checksums, flatten, storable
from ._trainable import PathFilter, Trainable, trainable_mask


class _Holder(eqx.Module):
    """A model under the field `model`, so that its arrays have the paths a saved
    `TrainState`'s have (`model.embed.weight`)."""

    model: Any


def frozen_keys(model: PyTree, trainable: Trainable | PathFilter | PyTree, path_map: Callable[[str], str] | None) -> set[str]:
    """The keys the frozen arrays of `model` (a `TrainState`'s `model`) are stored under."""
    mask = trainable_mask(model, trainable)
    paths = {"model" if p == "<root>" else f"model.{p}" for p in mask.frozen_paths()}
    return {p if path_map is None else path_map(p) for p in paths}


def base_entries(model: PyTree, keys: Iterable[str], path_map: Callable[[str], str] | None) -> list[Entry]:
    """The entries of `model`'s arrays stored under `keys` (paths as in a `TrainState`)."""
    wanted = set(keys)
    return [e for e in flatten(_Holder(model), path_map)[2] if e.path in wanted]


def fingerprint(entries: list[Entry]) -> str:
    """32 hexadecimal digits: a hash of each entry's path, shape, dtype and checksum."""
    sums = checksums({e.path: storable(e) for e in entries})
    digest = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        digest.update(f"{e.path}|{list(e.shape)}|{e.dtype_name}|{sums[e.path]}\n".encode())
    return digest.hexdigest()[:32]


def base_fingerprint(
    model: PyTree, trainable: Trainable | PathFilter | PyTree, *, path_map: Callable[[str], str] | None = None
) -> str:
    """The fingerprint of `model`'s frozen arrays, as a checkpoint of its trained part
    records it.

    Independent of the layout and the process count: the same base loaded under
    `fsdp=8` or `dp=2,tp=4` gives the same value (give the `Checkpointer`'s `path_map`
    where the layouts name the arrays differently).

    **Arguments:**

    - `model`: the model (global arrays).
    - `trainable`: the trainable filter (see `make_train_step`); the other arrays are
      the base.
    - `path_map`: the `Checkpointer`'s `path_map`.

    **Returns:**

    32 hexadecimal digits.
    """
    keys = frozen_keys(model, trainable, path_map)
    return fingerprint(base_entries(model, keys, path_map))
