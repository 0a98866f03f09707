"""The checkpoint format: a pytree as one flat dictionary `{path: array}` plus JSON metadata.

Every array of the saved pytree (a `TrainState`, a model, any pytree of arrays, `Sharded`
boxes and non-array leaves) is stored under its pytree path as `equishard` prints it
(`model.blocks.attn.wq`, `opt_state[0].mu.blocks.attn.wq`, `key`), or under the key a
`path_map` makes of that path. A box is stored as its array under the box's path. Typed
PRNG keys (`jax.random.key`) are stored as their `key_data` and re-wrapped on restore.
Non-array leaves (static fields, activation functions, Python numbers) are not stored:
they come from the template given at restore. The metadata records the format, the
versions, the step, the caller's metadata and every stored path with its global shape,
dtype and spec, so a template that does not fit is diagnosed, naming the first differing
path, before any array is read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from jaxtyping import PyTree

from .._errors import CheckpointError
from ..sharding import check_spec, is_array_like, is_sharded, path_str, specs_of

FORMAT = "equishard.checkpoint"
FORMAT_VERSION = 2
"""The checkpoint format's version: it changes with the format, and with `TrainState`'s
fields (`TRAIN_STATE_FIELDS`). A checkpoint of an earlier version reads as before: version
2 added `model_state`, whose arrays a state without one does not have."""

TRAIN_STATE_FIELDS: dict[int, tuple[str, ...]] = {
    1: ("step", "model", "opt_state", "key", "data_position", "skipped"),
    2: ("step", "model", "opt_state", "key", "data_position", "skipped", "model_state"),
}
"""The fields of a saved `TrainState`, per `FORMAT_VERSION`. `TrainState` is checked
against `TRAIN_STATE_FIELDS[FORMAT_VERSION]` when it is defined: a field added or renamed
without a new format version (and its entry here) fails at import."""


# ---------------------------------------------------------------------------------------
# Flattening a pytree into {path: array}
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One array of a pytree: where it is among the leaves, its path, value and spec."""

    index: int
    path: str
    value: Any
    spec: P

    @property
    def is_key(self) -> bool:
        return is_key_dtype(self.value.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.value.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.value.shape)


def is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def flatten(
    tree: PyTree, path_map: Callable[[str], str] | None = None
) -> tuple[list[Any], Any, list[Entry]]:
    """The leaves (boxes kept whole), the treedef, and one `Entry` per array.

    An entry's `path` is the key it is stored under: the pytree path as a string, passed
    through `path_map` if given.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
    leaves = [leaf for _, leaf in with_paths]
    entries: list[Entry] = []
    seen: dict[str, str] = {}
    for index, (key_path, leaf) in enumerate(with_paths):
        value = leaf.value if is_sharded(leaf) else leaf
        if not is_array_like(value):
            continue
        original = path_str(key_path)
        path = original if path_map is None else path_map(original)
        if path in seen:
            raise CheckpointError(
                f"the arrays `{seen[path]}` and `{original}` of the tree would both be stored "
                f"under the key `{path}`; rename a field or dictionary key (or fix the "
                f"checkpointer's path_map) so that keys are unique."
            )
        seen[path] = original
        spec = specs_of(leaf)
        entries.append(Entry(index, path, value, spec if isinstance(spec, P) else P()))
    return leaves, treedef, entries


def _key_impl_name(key: Any) -> str:
    return str(jax.random.key_impl(key))


def storable(entry: Entry) -> Any:
    """The array orbax writes for an entry: the key data of a key, else the array."""
    value = entry.value
    if isinstance(value, jax.ShapeDtypeStruct) or isinstance(value, Tracer):
        raise CheckpointError(
            f"cannot save `{entry.path}`: it is {type(value).__name__}, not a concrete "
            f"array (save outside `jit`, the state a step returned)."
        )
    if isinstance(value, jax.Array) and value.is_deleted():
        raise CheckpointError(
            f"cannot save `{entry.path}`: its array has been deleted, most likely donated "
            f"to a jitted train step; save the state the step returned instead."
        )
    if entry.is_key:
        return jax.random.key_data(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def array_record(entry: Entry) -> dict[str, Any]:
    record: dict[str, Any] = {
        "path": entry.path,
        "shape": list(entry.shape),
        "dtype": entry.dtype_name,
        "spec": str(entry.spec),
    }
    if entry.is_key:
        record["key_impl"] = _key_impl_name(entry.value)
    return record


# ---------------------------------------------------------------------------------------
# Restoring: targets, checks, rebuilding
# ---------------------------------------------------------------------------------------


def _target_sharding(entry: Entry, mesh: Mesh | None, where: str) -> jax.sharding.Sharding:
    """Where the restored array goes: the spec on `mesh`, else the template's sharding."""
    if mesh is not None:
        check_spec(entry.path, entry.shape, entry.spec, mesh)
        return NamedSharding(mesh, entry.spec)
    sharding = getattr(entry.value, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if any(axis is not None for axis in entry.spec):
        raise CheckpointError(
            f"cannot restore {where}: `{entry.path}` has spec {entry.spec} in the template "
            f"but no sharding and no mesh was given; pass `mesh=` (templates from "
            f"`eqx.filter_eval_shape` carry specs, not shardings)."
        )
    return SingleDeviceSharding(jax.local_devices()[0])


def target(entry: Entry, mesh: Mesh | None, where: str) -> jax.ShapeDtypeStruct:
    shape, dtype = entry.shape, entry.value.dtype
    if entry.is_key:
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, dtype = data.shape, data.dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_target_sharding(entry, mesh, where))


def rebuild(leaf: Any, entry: Entry, restored: Any, record: Mapping[str, Any]) -> Any:
    """Put a restored array back where the template's leaf was (in its box, as a key)."""
    if entry.is_key:
        restored = jax.random.wrap_key_data(restored, impl=record["key_impl"])
    if isinstance(entry.value, (np.ndarray, np.generic)):
        restored = np.asarray(restored)
    return leaf.with_value(restored) if is_sharded(leaf) else restored


def _describe_config(meta: Mapping[str, Any]) -> str:
    user = meta.get("user")
    if not user:
        return ""
    return f" It was saved with the metadata {json.dumps(user, sort_keys=True)}."


def check_fits(
    meta: Mapping[str, Any], entries: list[Entry], where: str
) -> dict[str, Mapping[str, Any]]:
    """Raise a `CheckpointError` naming the first array where checkpoint and template differ."""
    saved = {r["path"]: r for r in meta["arrays"]}
    counts = f"(the checkpoint holds {len(saved)} arrays, the template {len(entries)})"
    hint = _describe_config(meta)
    template_paths = {e.path for e in entries}
    for e in entries:
        record = saved.get(e.path)
        if record is None:
            raise CheckpointError(
                f"{where} does not fit the template: the template has an array `{e.path}` "
                f"(shape {e.shape}) that the checkpoint lacks {counts}; the checkpoint is of "
                f"a different model.{hint}"
            )
        shape = tuple(record["shape"])
        if shape != e.shape:
            raise CheckpointError(
                f"{where} does not fit the template: `{e.path}` has shape {shape} in the "
                f"checkpoint but {e.shape} in the template; the checkpoint is of a "
                f"different model size.{hint}"
            )
        if record["dtype"] != e.dtype_name:
            raise CheckpointError(
                f"{where} does not fit the template: `{e.path}` has dtype "
                f"{record['dtype']} in the checkpoint but {e.dtype_name} in the template.{hint}"
            )
    extra = [p for p in saved if p not in template_paths]
    if extra:
        raise CheckpointError(
            f"{where} does not fit the template: the checkpoint holds an array `{extra[0]}` "
            f"(shape {tuple(saved[extra[0]]['shape'])}) that the template lacks {counts}; "
            f"the checkpoint is of a different model.{hint}"
        )
    return saved


# ---------------------------------------------------------------------------------------
# Checksums of global arrays, independent of their layout
# ---------------------------------------------------------------------------------------


def _mix(h: Any) -> Any:
    """A 32-bit integer finaliser (xor-shift-multiply): every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _words(x: Any) -> Any:
    """The array's bits as `uint32` words: one per element, two for 64-bit elements (last axis)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # u32[..., 2]
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _global_index(shape: tuple[int, ...]) -> Any:
    """Each element's row-major index in the global array (modulo 2**32), as `uint32`."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return index


@jax.jit
def _checksums(arrays: dict[str, Any]) -> dict[str, Any]:
    """Two 32-bit sums per array over its words mixed with their global positions: u32[2].

    Word `w` at global index `i` contributes `h = mix(w ^ i·φ)` to one sum and
    `h·(i·φ | 1)` to the other (φ the golden-ratio constant). Integer sums modulo 2**32
    do not depend on the order of addition, so the result is the same whichever way
    the array is split: XLA sums each device's block and all-reduces the partial sums,
    never gathering the array.
    """

    def one(x: Any) -> Any:
        words = _words(x)
        weyl = _global_index(words.shape) * jnp.uint32(0x9E3779B9)
        mixed = _mix(words ^ weyl)
        lo = jnp.sum(mixed, dtype=jnp.uint32)
        hi = jnp.sum(mixed * (weyl | jnp.uint32(1)), dtype=jnp.uint32)
        return jnp.stack([lo, hi])

    return {path: one(x) for path, x in arrays.items()}


def checksums(arrays: Mapping[str, Any]) -> dict[str, str]:
    """A 64-bit checksum of each global array, computed on the devices that hold it.

    The checksum is a function of the global array's values and their positions only,
    so a checkpoint saved under one layout (or process count) verifies under another.
    Arrays on different sets of devices are summed by separate programs.

    **Arguments:**

    - `arrays`: `{path: array}` (JAX arrays, possibly sharded over processes, or NumPy).

    **Returns:**

    `{path: 16 hexadecimal digits}`.
    """
    groups: dict[Any, dict[str, Any]] = {}
    for path, x in arrays.items():
        sharding = getattr(x, "sharding", None)
        devices = None if sharding is None else tuple(sorted(d.id for d in sharding.device_set))
        groups.setdefault(devices, {})[path] = x
    sums: dict[str, Any] = {}
    for group in groups.values():
        sums.update(_checksums(group))
    host = jax.device_get(sums)
    return {path: f"{int(v[1]):08x}{int(v[0]):08x}" for path, v in host.items()}
