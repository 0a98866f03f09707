"""Sharded reading and streamed writing of safetensors checkpoints, for any Equinox model.

A model skeleton (arrays or `jax.ShapeDtypeStruct`s, in `Sharded` boxes that carry their
specs) and a map from its array paths to *sources* (a checkpoint tensor, or tensors
stacked, transposed, padded or permuted) give a model whose every array is built block by
block: each addressable device's block is read from the files by slice (only the rows
and columns of that block) and placed on its device at once. Everything is checked before any tensor
data is read: the files and the index, every source's shape against its array's, and
which checkpoint tensors and model arrays the map leaves out (named, with shapes).

What a process reads is its share of the files and no more, counted in the kernel's pages:
- Blocks of long contiguous runs are read with positional reads (`os.preadv` into the
  block's buffer, the file's readahead off): the kernel fetches their pages and no others.
  `safetensors` offers no such read: its `safe_open` reads through a memory map, whose
  faults make the kernel read ahead beyond the block.
- Where processes split an array across short runs (fsdp's columns of a row-major
  tensor: half of every 4 KiB row to each process), they would share every page. Such an
  array is read in a split along the dimension that varies slowest in the files (each
  process a contiguous share of the same size) and its blocks then move between the
  devices to the layout's sharding (`_read_sharding`).
- In a one-process load such an array is read whole, in long runs, once (its blocks'
  union: every block is this process's), and each block placed from it
  (`_whole_if_short`): reading the columns block by block through memory maps took twice
  as long as reading the files (`benchmarks/RESULTS.md`), and the host holds one array
  beside the model at most.
- The files' headers are parsed and validated here as `safetensors` validates them
  (`_file_tensors` says why it does not open them).

`safetensors` (the `train` extra) is imported when the first block is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._errors import CheckpointError
from ..sharding import check_tree_specs, is_sharded, specs_of

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

Index = tuple[slice, ...]
# A contiguous run of the files shorter than this, when processes split an array across
# it, shares pages with another process's runs: such arrays are read in a file-contiguous
# split and moved to their layout on the devices (`_read_sharding`).
RUN_BYTES = 256 * 2**10


# ----------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class Tensor:
    """The checkpoint tensor `name`, as it is stored."""

    name: str


@dataclasses.dataclass(frozen=True)
class Stacked:
    """The sources `parts` (of one shape) stacked on a new leading axis.

    A stride-3 q/k/v weight `[3, D, D]` is `Stacked((Tensor(q), Tensor(k), Tensor(v)))`;
    a model whose layers are stacked `[L, ...]` stacks each layer's tensor.
    """

    parts: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Transposed:
    """The two-dimensional `source` transposed (`[in, out]` from a `[out, in]` weight)."""

    source: Any


@dataclasses.dataclass(frozen=True)
class Padded:
    """`source` padded with zeros to `size` along `axis` (a vocabulary padded to divide an axis)."""

    source: Any
    axis: int
    size: int


@dataclasses.dataclass(frozen=True)
class Permuted:
    """`source` with its `axis` reordered: entry `i` is `source`'s entry `order[i]`
    (a permutation of the heads' features, e.g. interleaved rotary pairs to halves)."""

    source: Any
    axis: int
    order: tuple[int, ...]


Source = Tensor | Stacked | Transposed | Padded | Permuted


def source_tensors(source: Source) -> Iterator[str]:
    """The checkpoint tensor names `source` reads."""
    if isinstance(source, Tensor):
        yield source.name
    elif isinstance(source, Stacked):
        for part in source.parts:
            yield from source_tensors(part)
    else:
        yield from source_tensors(source.source)


def source_shape(source: Source, shapes: Mapping[str, tuple[int, ...]], where: str) -> tuple[int, ...]:
    """The shape of `source` given the checkpoint's tensor shapes.

    **Raises:**

    `CheckpointError` naming `where` (the model array) for stacked parts of different
    shapes, a transpose of a tensor not of rank 2, a pad smaller than the tensor or a
    permutation of the wrong length.
    """
    if isinstance(source, Tensor):
        return tuple(shapes[source.name])
    if isinstance(source, Stacked):
        parts = [source_shape(p, shapes, where) for p in source.parts]
        if any(s != parts[0] for s in parts):
            names = [next(source_tensors(p)) for p in source.parts]
            raise CheckpointError(
                f"{where}: the tensors stacked into it differ in shape: "
                + ", ".join(f"{n} {s}" for n, s in zip(names, parts))
            )
        return (len(parts), *parts[0])
    inner = source_shape(source.source, shapes, where)
    if isinstance(source, Transposed):
        if len(inner) != 2:
            raise CheckpointError(f"{where}: a transpose of {next(source_tensors(source))} of shape {inner} (not 2-D).")
        return inner[::-1]
    if isinstance(source, Padded):
        if inner[source.axis] > source.size:
            raise CheckpointError(
                f"{where}: {next(source_tensors(source))} of shape {inner} is larger than "
                f"{source.size} on axis {source.axis}."
            )
        return tuple(source.size if i == source.axis % len(inner) else d for i, d in enumerate(inner))
    if sorted(source.order) != list(range(inner[source.axis])):
        raise CheckpointError(f"{where}: the permutation of axis {source.axis} of {inner} is not one of it.")
    return inner


def _read(
    source: Source, index: Index, reader: Callable[[str, Index], np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> np.ndarray:
    """The block `index` (concrete slices of step 1) of `source`, reading only that block."""
    if isinstance(source, Tensor):
        return reader(source.name, index)
    if isinstance(source, Stacked):
        picked = range(len(source.parts))[index[0]]
        return np.stack([_read(source.parts[i], index[1:], reader, shapes) for i in picked])
    if isinstance(source, Transposed):
        return _read(source.source, index[::-1], reader, shapes).T
    if isinstance(source, Padded):
        axis = source.axis % len(index)
        want = index[axis]
        out_shape = [s.stop - s.start for s in index]
        inner_stop = min(want.stop, source_shape(source.source, shapes, '')[axis])
        block = np.zeros(out_shape, dtype=np.float32)
        if inner_stop > want.start:
            sub = list(index)
            sub[axis] = slice(want.start, inner_stop)
            part = _read(source.source, tuple(sub), reader, shapes)
            block = block.astype(part.dtype)
            put = [slice(None)] * len(index)
            put[axis] = slice(0, inner_stop - want.start)
            block[tuple(put)] = part
        return block
    axis = source.axis % len(index)
    rows = source.order[index[axis]]
    runs = _runs(rows)
    pieces = []
    for start, stop in runs:
        sub = list(index)
        sub[axis] = slice(start, stop)
        pieces.append(_read(source.source, tuple(sub), reader, shapes))
    gathered = np.concatenate(pieces, axis=axis)
    # `pieces` hold the rows in sorted runs; put them in the order asked for.
    flat = [r for start, stop in runs for r in range(start, stop)]
    where = {r: i for i, r in enumerate(flat)}
    return np.take(gathered, [where[r] for r in rows], axis=axis)


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """The sorted `rows` as maximal runs `[start, stop)` of consecutive integers."""
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _file_order(source: Source, ndim: int) -> list[int]:
    """The dimensions of the array `source` fills, the one that varies slowest in the
    files first (a stack's axis, then each part's in its tensor's order)."""
    if isinstance(source, Tensor):
        return list(range(ndim))
    if isinstance(source, Stacked):
        return [0, *(d + 1 for d in _file_order(source.parts[0], ndim - 1))]
    if isinstance(source, Transposed):
        return [1 - d for d in _file_order(source.source, 2)]
    return _file_order(source.source, ndim)


def _min_run(source: Source, index: Index, tensors: Mapping[str, TensorInfo]) -> float:
    """The shortest contiguous run of file bytes that reading the block `index` of
    `source` takes (`inf` if it reads nothing)."""
    if isinstance(source, Tensor):
        info = tensors[source.name]
        return float(_run_elements(info.shape, index)[1] * np.dtype(_DTYPES[info.dtype]).itemsize)
    if isinstance(source, Stacked):
        picked = range(len(source.parts))[index[0]]
        return min((_min_run(source.parts[i], index[1:], tensors) for i in picked), default=np.inf)
    if isinstance(source, Transposed):
        return _min_run(source.source, index[::-1], tensors)
    axis = source.axis % len(index)
    inner = source_shape(source.source, {n: t.shape for n, t in tensors.items()}, "")
    if isinstance(source, Padded):
        stop = min(index[axis].stop, inner[axis])
        sub = [*index[:axis], slice(index[axis].start, stop), *index[axis + 1 :]]
        return _min_run(source.source, tuple(sub), tensors) if stop > index[axis].start else np.inf
    runs = _runs(source.order[index[axis]])
    subs = [(*index[:axis], slice(a, b), *index[axis + 1 :]) for a, b in runs]
    return min((_min_run(source.source, sub, tensors) for sub in subs), default=np.inf)


def _blocks(sharding: NamedSharding, shape: tuple[int, ...], addressable: bool) -> dict[Any, Index]:
    """Each device's block of an array of `shape` under `sharding` as concrete slices
    (this process's devices only if `addressable`)."""
    where = sharding.addressable_devices_indices_map(shape) if addressable else sharding.devices_indices_map(shape)
    full = tuple(slice(None) for _ in shape)
    return {d: tuple(slice(*s.indices(n)) for s, n in zip(i or full, shape)) for d, i in where.items()}


def _whole_if_short(
    source: Source, sharding: NamedSharding, shape: tuple[int, ...], tensors: Mapping[str, TensorInfo],
    read: Callable[[str, Index], np.ndarray], shapes: Mapping[str, tuple[int, ...]],
) -> np.ndarray | None:
    """In a one-process load, an array whose blocks cut the files into runs shorter than
    `RUN_BYTES` (columns of a row-major tensor), read whole by positional reads (its bytes
    once, in long runs; the host holds one array beside the model while its blocks are
    placed); `None` for another array, read block by block."""
    if jax.process_count() != 1 or not shape:
        return None
    distinct = {tuple((s.start, s.stop) for s in i): i for i in _blocks(sharding, shape, True).values()}
    if len(distinct) == 1 or min(_min_run(source, i, tensors) for i in distinct.values()) >= RUN_BYTES:
        return None
    return _read(source, tuple(slice(0, n) for n in shape), read, shapes)


def _read_sharding(
    source: Source, sharding: NamedSharding, shape: tuple[int, ...], tensors: Mapping[str, TensorInfo]
) -> NamedSharding | None:
    """The sharding in which to read an array that several processes share, when its
    layout's blocks cut the files into runs shorter than `RUN_BYTES`; `None` to read the
    layout's blocks themselves.

    Several processes holding columns of a row-major tensor each need a part of the same
    4 KiB pages: each process's kernel then reads whole pages, and with its own page
    cache (one host each) reads the rows entire. The array is then read split along the
    dimension that varies slowest in the files, over the mesh's axes (the longest
    leading run of them that divides it; the leading axes are the ones split over
    processes), so that each process reads contiguous runs of its share of the bytes,
    and the devices exchange the blocks afterwards.
    """
    mesh = sharding.mesh
    if jax.process_count() == 1 or not shape:
        return None

    def shortest(split: NamedSharding) -> float:  # over the distinct blocks
        distinct = {tuple((s.start, s.stop) for s in i): i for i in _blocks(split, shape, False).values()}
        return min(_min_run(source, i, tensors) for i in distinct.values())

    layout_run = shortest(sharding)
    if layout_run >= RUN_BYTES:
        return None
    names = list(mesh.axis_names)
    for dim in _file_order(source, len(shape)):
        for k in range(len(names), 0, -1):
            size = int(np.prod([mesh.shape[n] for n in names[:k]]))
            if size > 1 and shape[dim] % size == 0:
                spec = P(*(tuple(names[:k]) if d == dim else None for d in range(len(shape))))
                split = NamedSharding(mesh, spec)
                return split if shortest(split) > layout_run else None
    return None


# -------------------------------------------------------------------------- the files


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lies: its file, shape, dtype (safetensors' name) and
    the byte offset of its data in the file."""

    file: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


def _header(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset of its data.

    Read as the blocks are, readahead off: a buffered read would leave the kernel's
    readahead mark on the pages after the header, and a block read through them later
    would make it read tens of MiB ahead (measured: 33 MiB on a 16 MiB read).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = int.from_bytes(os.pread(fd, 8, 0), "little")
            if size > 100_000_000:  # safetensors' own limit
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(os.pread(fd, size, 8))
        finally:
            os.close(fd)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"safetensors file {path}: unreadable header ({err}).") from None
    return header, 8 + size


def _file_tensors(path: str) -> dict[str, TensorInfo]:
    """The tensors of one file, validated as `safetensors` validates a file it opens:
    known dtypes, each tensor's byte range of its shape's size, the ranges tiling the
    data with no hole or overlap, and the file as long as its header says.

    Written here rather than by opening the file with `safe_open`: that maps the file,
    and the first read of the header through the mapping makes the kernel read ahead
    the next 8 MiB of the file (measured: 40 MiB for the 5 files of the benchmark's
    checkpoint, in every process) — bytes of tensor blocks other processes hold, which
    would break each process's bound on the bytes it reads.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file {path} does not exist.")
    header, start = _header(path)
    out, ranges = {}, []
    try:
        for name, h in header.items():
            if name == "__metadata__":
                continue
            shape, (begin, end) = tuple(int(d) for d in h["shape"]), (int(o) for o in h["data_offsets"])
            if h["dtype"] not in _DTYPES:
                raise ValueError(f"tensor {name} has the dtype {h['dtype']}, which is not read here")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[h["dtype"]]).itemsize:
                raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} of {h['dtype']}")
            out[name] = TensorInfo(path, shape, h["dtype"], start + begin)
            ranges.append((begin, end, name))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"safetensors file {path} is incomplete or corrupt: {err}") from None
    at = 0
    for begin, end, name in sorted(ranges):
        if begin != at:
            raise CheckpointError(f"safetensors file {path} is incomplete or corrupt: tensor {name} starts at {begin}, not {at}.")
        at = end
    if os.path.getsize(path) != start + at:
        raise CheckpointError(
            f"safetensors file {path} is incomplete or corrupt: {os.path.getsize(path)} bytes, its header "
            f"describes {start + at}."
        )
    return out


def checkpoint_tensors(folder: str, *, single: str = SINGLE) -> dict[str, TensorInfo]:
    """Every tensor of the safetensors checkpoint in `folder` (one `model.safetensors`,
    or several files listed by `model.safetensors.index.json`; `single`: the one file's
    name, e.g. PEFT's `adapter_model.safetensors`).

    **Raises:**

    `CheckpointError` naming the file and tensor: no checkpoint in `folder`, a file the
    index names missing or truncated, a tensor the index lists missing from its file,
    or a file holding a tensor the index does not list.
    """
    index_path = os.path.join(folder, INDEX)
    if not os.path.exists(index_path):
        path = os.path.join(folder, single)
        if not os.path.exists(path):
            raise CheckpointError(f"{folder}: neither {single} nor {INDEX} is there.")
        return _file_tensors(path)
    try:
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{index_path}: not a safetensors index ({err!r}).") from None
    out: dict[str, TensorInfo] = {}
    for file in sorted(set(weight_map.values())):
        tensors = _file_tensors(os.path.join(folder, file))
        listed = {n for n, f in weight_map.items() if f == file}
        for name in sorted(listed - tensors.keys()):
            raise CheckpointError(f"{index_path} lists tensor {name} in {file}, which does not hold it.")
        for name in sorted(tensors.keys() - listed):
            raise CheckpointError(
                f"{os.path.join(folder, file)} holds tensor {name}, which {index_path} does not list."
            )
        out.update(tensors)
    return out


def _run_elements(shape: Sequence[int], index: Index) -> tuple[int, int]:
    """How the C-ordered block `index` (concrete slices) of a tensor of `shape` lies in
    its bytes: `(outer, elements per run)`, one contiguous run for each index of the
    block's first `outer` dimensions."""
    j = len(shape)
    while j > 0 and (index[j - 1].start, index[j - 1].stop) == (0, shape[j - 1]):
        j -= 1
    if j == 0:
        return 0, int(np.prod(shape, dtype=np.int64))
    return j - 1, (index[j - 1].stop - index[j - 1].start) * int(np.prod(shape[j:], dtype=np.int64))


def _pread_block(info: TensorInfo, index: Index) -> np.ndarray:
    """The block `index` of the tensor `info`, read run by run with `os.preadv` into the
    result's buffer, the file's readahead off (`POSIX_FADV_RANDOM`): the kernel fetches
    the pages of the block's bytes and no others."""
    dtype = np.dtype(_DTYPES[info.dtype])
    out = np.empty([s.stop - s.start for s in index], dtype)
    if out.size == 0:
        return out
    outer, run = _run_elements(info.shape, index)
    # Elements per step of each dimension of the tensor (C order).
    strides = [int(np.prod(info.shape[d + 1 :], dtype=np.int64)) for d in range(len(info.shape))]
    starts = [s.start for s in index]
    flat, step = out.reshape(-1).view(np.uint8), run * dtype.itemsize
    fd = os.open(info.file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for i, at in enumerate(itertools.product(*(range(s.start, s.stop) for s in index[:outer]))):
            first = sum(a * st for a, st in zip((*at, *starts[outer:]), strides))
            where, done = info.offset + first * dtype.itemsize, 0
            while done < step:
                got = os.preadv(fd, [flat.data[i * step + done : (i + 1) * step]], where + done)
                if got <= 0:
                    raise CheckpointError(f"safetensors file {info.file} is truncated (byte {where + done}).")
                done += got
    finally:
        os.close(fd)
    return out


def _reader(infos: Mapping[str, TensorInfo]) -> Callable[[str, Index], np.ndarray]:
    """A function reading the block `index` of a tensor from its file.

    A block made of runs of at least `RUN_BYTES` (or of one run) is read with positional
    reads (`_pread_block`): exactly its bytes, with no readahead. A block of many short
    runs (columns of a row-major tensor) through `safe_open(...).get_slice`, or for
    bfloat16, which NumPy's backend of safetensors cannot return, through a read-only
    memory map of the tensor's bytes, sliced the same way. Each such read maps the file
    anew and unmaps it once the block is copied out: a block split over columns touches
    every page of its tensor, and those pages then leave the process's resident memory
    at once instead of piling up beside the model (one tensor's at most; measured in
    `benchmarks/RESULTS.md`).
    """
    from safetensors import safe_open

    def read(name: str, index: Index) -> np.ndarray:
        info = infos[name]
        outer, run = _run_elements(info.shape, index)
        if outer == 0 or run * np.dtype(_DTYPES[info.dtype]).itemsize >= RUN_BYTES:
            return _pread_block(info, index)
        if info.dtype == "BF16":
            whole = np.memmap(info.file, dtype=ml_dtypes.bfloat16, mode="r", offset=info.offset, shape=info.shape)
            block = np.array(whole[index])
            del whole  # unmapped
            return block
        with safe_open(info.file, framework="numpy") as f:
            return np.asarray(f.get_slice(name)[index] if info.shape else f.get_tensor(name))

    return read


# ------------------------------------------------------------------------- the loader


def array_paths(skeleton: PyTree) -> dict[str, tuple[Any, P]]:
    """The arrays of `skeleton` by path (`jax.tree_util.keystr`, a box's path without
    `.value`): `{path: (array or ShapeDtypeStruct, spec)}` (`P()` for unboxed arrays)."""
    out: dict[str, tuple[Any, P]] = {}
    leaves = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=is_sharded)[0]
    for path, leaf in leaves:
        value, spec = (leaf.value, leaf.spec) if is_sharded(leaf) else (leaf, P())
        if isinstance(value, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
            out[jax.tree_util.keystr(path)] = (value, spec)
    return out


def check_mapping(
    skeleton: PyTree, mapping: Mapping[str, Source], tensors: Mapping[str, TensorInfo],
    *, ignore: Iterable[str] = (),
) -> None:  # fmt: skip
    """Check `mapping` against the model and the checkpoint before anything is read.

    **Arguments:**

    - `skeleton`: the model (see `load_safetensors`).
    - `mapping`: `{array path: source}`.
    - `tensors`: the checkpoint's (`checkpoint_tensors`).
    - `ignore`: checkpoint tensors that may stay unused.

    **Raises:**

    `CheckpointError` naming, with shapes, every model array no source fills, every
    checkpoint tensor no source reads (outside `ignore`), a source naming a tensor the
    checkpoint lacks, a source whose shape is not its array's, and a floating array
    filled from a tensor that is not floating.
    """
    arrays = array_paths(skeleton)
    problems = []
    for path in sorted(mapping.keys() - arrays.keys()):
        problems.append(f"the map names {path}, which is no array of the model")
    for path in sorted(arrays.keys() - mapping.keys()):
        problems.append(f"model array {path} {tuple(arrays[path][0].shape)} is filled by no tensor")
    used = {n for s in mapping.values() for n in source_tensors(s)}
    for name in sorted(used - tensors.keys()):
        problems.append(f"tensor {name} is not in the checkpoint")
    for name in sorted(tensors.keys() - used - set(ignore)):
        problems.append(f"checkpoint tensor {name} {tensors[name].shape} ({tensors[name].file}) is unused")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model:\n  " + "\n  ".join(problems))
    shapes = {n: t.shape for n, t in tensors.items()}
    for path, source in mapping.items():
        value = arrays[path][0]
        shape = source_shape(source, shapes, path)
        names = sorted(set(source_tensors(source)))
        if shape != tuple(value.shape):
            raise CheckpointError(
                f"model array {path} has shape {tuple(value.shape)} but its tensors "
                f"{', '.join(f'{n} {shapes[n]} ({tensors[n].file})' for n in names)} give {shape}."
            )
        floating = np.issubdtype(np.dtype(value.dtype), np.inexact)
        for n in names:
            if floating != (tensors[n].dtype in ("F64", "F32", "F16", "BF16")):
                raise CheckpointError(
                    f"tensor {n} ({tensors[n].file}) has dtype {tensors[n].dtype}, which does "
                    f"not fit model array {path} of dtype {np.dtype(value.dtype)}."
                )


def load_safetensors(
    skeleton: PyTree, mapping: Mapping[str, Source], folder: str, *, mesh: Mesh,
    ignore: Iterable[str] = (), single: str = SINGLE,
) -> PyTree:  # fmt: skip
    """Fill every array of `skeleton` from the safetensors checkpoint in `folder`.

    ```python
    model = load_safetensors(skeleton, {".linear.weight": Tensor("fc.weight")}, "ckpt/", mesh=mesh)
    ```

    **Arguments:**

    - `skeleton`: the model, its arrays real or `jax.ShapeDtypeStruct`s (e.g.
      `eqx.filter_eval_shape(make)`), in `Sharded` boxes carrying their specs (an
      unboxed array is replicated).
    - `mapping`: `{array path: source}`: the path as `jax.tree_util.keystr` writes it (a
      box's without `.value`), the source a `Tensor`, `Stacked`, `Transposed`, `Padded`
      or `Permuted`. Each block is cast to its array's dtype.
    - `folder`: a folder with `model.safetensors`, or several files and
      `model.safetensors.index.json`.
    - `mesh`: the mesh the arrays are placed on, each by its spec.
    - `ignore`: checkpoint tensors that may stay unused.
    - `single`: the name of a one-file checkpoint (`checkpoint_tensors`).

    **Returns:**

    `skeleton` with every array a `jax.Array` on `mesh`. Each process reads only the
    blocks of its own devices, or, for an array whose blocks would have the processes
    read the same pages of the files, a contiguous share of the array's bytes of the same
    size, the devices exchanging the blocks afterwards; one process reads such an array
    whole (all its blocks are its own), once.

    **Raises:**

    `SpecError` for a spec that does not fit `mesh`; `CheckpointError` before any
    tensor data is read (see `checkpoint_tensors` and `check_mapping`).
    """
    check_tree_specs(skeleton, specs_of(skeleton), mesh)
    tensors = checkpoint_tensors(folder, single=single)
    check_mapping(skeleton, mapping, tensors, ignore=ignore)
    shapes = {n: t.shape for n, t in tensors.items()}
    arrays = array_paths(skeleton)

    def fill(path: str, value: Any, spec: P) -> jax.Array:
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        read = _reader(tensors)
        sharding = NamedSharding(mesh, spec)
        split = _read_sharding(mapping[path], sharding, shape, tensors)
        # As `jax.make_array_from_callback`, but each block is placed on its device as
        # soon as it is read (that function reads every block first): the host holds
        # one block at a time, not a whole array beside the model. A block several
        # devices share is read once.
        placed: dict[Any, list[jax.Array]] = {}
        blocks = []
        whole = _whole_if_short(mapping[path], sharding, shape, tensors, read, shapes)
        for device, index in _blocks(split or sharding, shape, True).items():
            key = tuple((s.start, s.stop) for s in index)
            if key not in placed:
                block = _read(mapping[path], index, read, shapes) if whole is None else whole[index]
                data = block.astype(dtype, copy=False)
                placed[key] = [jax.device_put(data, device)]
                del data
            else:
                placed[key].append(jax.device_put(placed[key][0], device))
            blocks.append(placed[key][-1])
        array = jax.make_array_from_single_device_arrays(shape, split or sharding, blocks)
        # Read in a file-contiguous split: the devices exchange the blocks (one array's
        # worth of device memory beside it, freed at once).
        return array if split is None else jax.device_put(array, sharding)

    filled = {path: fill(path, v, spec) for path, (v, spec) in arrays.items()}

    def put(path: Any, leaf: Any) -> Any:
        key = jax.tree_util.keystr(path)
        if key not in filled:
            return leaf
        return leaf.with_value(filled[key]) if is_sharded(leaf) else filled[key]

    return jax.tree_util.tree_map_with_path(put, skeleton, is_leaf=is_sharded)


# ------------------------------------------------------------------------- the writer


def tensor_of(source: Source, name: str, array: Any, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """The checkpoint tensor `name` cut from `array`, the array `source` fills: the
    inverse of `source` (stacked parts indexed out, transposes undone, padding stripped,
    permutations inverted; `shapes` are the tensors' shapes). Works on `jax.Array`s (sharded ones too) and NumPy arrays;
    `None` if `source` does not read `name`."""
    if isinstance(source, Tensor):
        return array if source.name == name else None
    if isinstance(source, Stacked):
        for i, part in enumerate(source.parts):
            if name in set(source_tensors(part)):
                return tensor_of(part, name, array[i], shapes)
        return None
    if name not in set(source_tensors(source)):
        return None
    if isinstance(source, Transposed):
        return tensor_of(source.source, name, array.T, shapes)
    if isinstance(source, Padded):
        extent = source_shape(source.source, shapes, name)[source.axis]
        index = [slice(None)] * array.ndim
        index[source.axis] = slice(0, extent)
        return tensor_of(source.source, name, array[tuple(index)], shapes)
    inverse = np.argsort(np.asarray(source.order))
    return tensor_of(source.source, name, array.take(inverse, axis=source.axis), shapes)


@dataclasses.dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its name, shape, dtype (NumPy's) and a function that makes
    its data (called once, when the tensor's turn comes)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    make: Callable[[], np.ndarray]


def write_safetensors(
    folder: str, tensors: Sequence[OutTensor], *, max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None, single: str = SINGLE,
) -> list[str]:  # fmt: skip
    """Write `tensors` into `folder` as safetensors files of at most `max_shard_bytes`
    (one tensor larger than that gets a file of its own), one tensor at a time.

    Each file's header is written first (the shapes and dtypes are known), then each
    tensor's bytes as `make()` returns them: the host holds one tensor at a time. With
    more than one file, `model.safetensors.index.json` lists them
    (`model-00001-of-0000N.safetensors`, ...); with one it is `single`
    (`model.safetensors` unless given).

    **Returns:**

    The names of the files written.

    **Raises:**

    `CheckpointError` naming the tensor whose data does not have its declared shape.
    """
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    n = len(groups)
    names = [single] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, group in zip(names, groups):
        _write_file(os.path.join(folder, file), group, metadata or {"format": "pt"})
    if n > 1:
        total = sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize for t in tensors)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: file for file, group in zip(names, groups) for t in group},
        }
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _write_file(path: str, tensors: Sequence[OutTensor], metadata: Mapping[str, str]) -> None:
    """One safetensors file: the header (padded to 8 bytes), then each tensor's bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        header[t.name] = {
            "dtype": _NAMES[np.dtype(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes],
        }  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors:
            data = np.ascontiguousarray(np.asarray(t.make()).astype(t.dtype, copy=False))
            if data.shape != tuple(t.shape):
                raise CheckpointError(f"{path}: tensor {t.name} has shape {data.shape}, declared {t.shape}.")
            f.write(data.tobytes())


def model_arrays(model: PyTree) -> dict[str, Any]:
    """The arrays of `model` by path, as `array_paths` names them (boxes looked through)."""
    return {path: value for path, (value, _) in array_paths(model).items()}
