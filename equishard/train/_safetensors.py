"""Sharded reading and streamed writing of safetensors checkpoints, for any Equinox model.

A model skeleton (arrays or `jax.ShapeDtypeStruct`s, in `Sharded` boxes that carry their
specs) and a map from its array paths to *sources* (a checkpoint tensor, or tensors
stacked, transposed, padded or permuted) give a model whose every array is built block by
block: each addressable device's block is read from the files by slice (only the rows
and columns of that block) and placed on its device at once. Everything is checked before any tensor
data is read: the files and the index, every source's shape against its array's, and
which checkpoint tensors and model arrays the map leaves out (named, with shapes).

`safetensors` (the `train` extra) is imported when a checkpoint is first opened.
"""

from __future__ import annotations

import dataclasses
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
    """The JSON header of a safetensors file and the offset of its data."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"safetensors file {path}: unreadable header ({err}).") from None
    return header, 8 + size


def _file_tensors(path: str) -> dict[str, TensorInfo]:
    """The tensors of one file, validated by `safetensors` (header, offsets, file size)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file {path} does not exist.")
    try:
        with safe_open(path, framework="numpy"):
            pass
    except Exception as err:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"safetensors file {path} is incomplete or corrupt: {err}") from None
    header, start = _header(path)
    return {
        name: TensorInfo(path, tuple(h["shape"]), h["dtype"], start + h["data_offsets"][0])
        for name, h in header.items()
        if name != "__metadata__"
    }


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


def _reader(infos: Mapping[str, TensorInfo]) -> Callable[[str, Index], np.ndarray]:
    """A function reading the block `index` of a tensor from its file.

    Through `safe_open(...).get_slice` (only the block's rows and columns are read);
    bfloat16, which NumPy's backend of safetensors cannot return, through a read-only
    memory map of the tensor's bytes, sliced the same way. Each read maps the file anew
    and unmaps it once the block is copied out: a block split over columns touches every
    page of its tensor, and those pages then leave the process's resident memory at once
    instead of piling up beside the model (one tensor's at most; measured in
    `benchmarks/RESULTS.md`).
    """
    from safetensors import safe_open

    def read(name: str, index: Index) -> np.ndarray:
        info = infos[name]
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
    blocks of its own devices.

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
        # As `jax.make_array_from_callback`, but each block is placed on its device as
        # soon as it is read (that function reads every block first): the host holds
        # one block at a time, not a whole array beside the model. A block several
        # devices share is read once.
        placed: dict[Any, list[jax.Array]] = {}
        blocks = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            full = tuple(slice(None) for _ in shape) if index is None else index
            concrete = tuple(slice(*s.indices(d)) for s, d in zip(full, shape))
            key = tuple((s.start, s.stop) for s in concrete)
            if key not in placed:
                data = _read(mapping[path], concrete, read, shapes).astype(dtype, copy=False)
                placed[key] = [jax.device_put(data, device)]
                del data
            else:
                placed[key].append(jax.device_put(placed[key][0], device))
            blocks.append(placed[key][-1])
        return jax.make_array_from_single_device_arrays(shape, sharding, blocks)

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
