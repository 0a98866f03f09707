"""Moving a model out of and into equishard as a plain single-device Equinox model file."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._errors import CheckpointError
from .._text import first_line
from ..sharding import gather, is_sharded, unbox

# ---------------------------------------------------------------------------------------
# Plain-Equinox export
# ---------------------------------------------------------------------------------------


def _eqx_path(path: str | os.PathLike[str]) -> pathlib.Path:
    """Equinox's rule: a path without a suffix gets `.eqx`."""
    path = pathlib.Path(path)
    return path.with_suffix(".eqx") if path.suffix == "" else path


def export_model(model: PyTree, path: str | os.PathLike[str], *, state: PyTree = None) -> pathlib.Path:
    """Write a model as a plain single-device Equinox model file.

    Every `Sharded` box is replaced by its array (`unbox`) and the leaves are written
    with `eqx.tree_serialise_leaves`, one array at a time: each is assembled on the host
    from its blocks (`host_array`), written, and freed before the next. No device holds
    more than it did (a model too large for one device is written too); the host holds
    one array and the write buffer. The file has the bytes a gathered model's
    `eqx.tree_serialise_leaves` writes. It is written under a temporary name and
    renamed, so a reader never sees a partial file. Read it back with `import_model`, or with plain
    `eqx.tree_deserialise_leaves(path, like)` where `like` is the model built without
    equishard's boxes. In a multi-process run every process calls it and process 0
    writes.

    **Arguments:**

    - `model`: the model (or any pytree), possibly sharded and boxed.
    - `path`: the file; `.eqx` is appended when it has no suffix (Equinox's rule).
    - `state`: the model's `eqx.nn.State` (`TrainState.model_state`: batch norms'
      running statistics, which inference needs), written after the model: the file
      then holds the pair `(model, state)`, read with `import_model(path, (model_like,
      state_like))` or `eqx.tree_deserialise_leaves(path, eqx.nn.make_with_state(Model)(...))`.

    **Returns:**

    The path written.
    """
    path = _eqx_path(path)
    plain = unbox(model if state is None else (model, state))
    writer = jax.process_index() == 0

    def write(f: Any, x: Any) -> None:
        if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            host = host_array(x)  # every process takes part when other processes hold blocks
            if writer:
                jnp.save(f, host)  # as `eqx.default_serialise_filter_spec` saves the array
            del host
        elif isinstance(x, jax.Array):  # a key array: small, gathered as it is
            x = gather(x)
            if writer:
                eqx.default_serialise_filter_spec(f, x)
        elif writer:
            eqx.default_serialise_filter_spec(f, x)

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") if writer else open(os.devnull, "wb") as f:
            eqx.tree_serialise_leaves(f, plain, filter_spec=write)
        if writer:
            os.replace(tmp, path)
    finally:
        if writer:
            tmp.unlink(missing_ok=True)
    return path


def host_array(x: jax.Array) -> np.ndarray:
    """The global array `x` on the host: its blocks copied out one at a time (a block
    several devices hold once), or, when other processes hold some of them, gathered
    from all processes (`process_allgather`: the array whole on each device for the
    moment)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = np.empty(x.shape, x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in seen:
            seen.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def import_model(path: str | os.PathLike[str], like: PyTree) -> PyTree:
    """Read a model file written by `export_model` (or `eqx.tree_serialise_leaves`).

    **Arguments:**

    - `path`: the file (`.eqx` appended when it has no suffix).
    - `like`: a template: the plain model (e.g. built with `eqx.filter_eval_shape`), or
      an equishard model with `Sharded` boxes, whose boxes are then refilled with the
      loaded arrays (place the result with `equishard.shard(model, mesh)`).

    **Returns:**

    `like` with its arrays read from the file (on the default device).

    **Raises:**

    `CheckpointError` naming the file if it is missing, truncated, holds more or
    fewer arrays than `like`, or an array of another shape or dtype.
    """
    path = _eqx_path(path)
    if not path.is_file():
        raise CheckpointError(f"cannot import a model: there is no file {path.absolute()}.")
    try:
        with open(path, "rb") as f:
            plain = eqx.tree_deserialise_leaves(f, unbox(like))
            trailing = f.read(1)
    except Exception as err:  # noqa: BLE001
        root: BaseException = err
        while root.__cause__ is not None:
            root = root.__cause__
        detail = first_line(err) if root is err else f"{first_line(err)}: {first_line(root)}"
        raise CheckpointError(
            f"cannot import the model in {path.absolute()}: it does not fit the template "
            f"or is truncated ({detail})."
        ) from None
    if trailing:
        raise CheckpointError(
            f"cannot import the model in {path.absolute()}: the file holds more arrays than "
            f"the template; it was exported from a different model."
        )
    return jax.tree.map(
        lambda t, v: t.with_value(v) if is_sharded(t) else v, like, plain, is_leaf=is_sharded
    )
