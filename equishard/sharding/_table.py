"""The per-parameter sharding table: path, global shape, spec, bytes per device."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import local_shape
from .._text import human_bytes, text_table
from ._specs import leaves_with_specs


@dataclass(frozen=True)
class ParamRow:
    """One row of a sharding table.

    **Attributes:**

    - `path`: the parameter's path, e.g. `blocks[3].mlp.w1`.
    - `shape`: its global shape.
    - `dtype`: its dtype name.
    - `spec`: its `PartitionSpec`.
    - `local_shape`: the shape of one device's block.
    - `bytes_per_device`: the bytes one device holds.
    - `total_bytes`: the bytes of the whole global array.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    local_shape: tuple[int, ...]
    bytes_per_device: int
    total_bytes: int


def param_table(tree: PyTree, mesh: Mesh | AbstractMesh) -> list[ParamRow]:
    """One `ParamRow` per array of `tree`, in tree order.

    **Arguments:**

    - `tree`: a model, optimizer state or any pytree (arrays or `jax.ShapeDtypeStruct`s).
    - `mesh`: the mesh it is (or will be) placed on; a `jax.sharding.AbstractMesh`
      (axis names and sizes, no devices) does as well.

    **Returns:**

    A list of rows; see `format_param_table` to print them.
    """
    rows = []
    for path, value, spec in leaves_with_specs(tree):
        shape = tuple(value.shape)
        itemsize = np.dtype(value.dtype).itemsize
        local = local_shape(shape, spec, mesh.shape)
        rows.append(
            ParamRow(
                path=path,
                shape=shape,
                dtype=np.dtype(value.dtype).name,
                spec=spec,
                local_shape=local,
                bytes_per_device=math.prod(local) * itemsize,
                total_bytes=math.prod(shape) * itemsize,
            )
        )
    return rows


def format_param_rows(
    rows: Sequence[ParamRow],
    width: int | None = None,
    *,
    block_shapes: bool = False,
    digits: int = 2,
    total: bool = True,
) -> str:
    """`ParamRow`s as aligned text: path, global shape, dtype, spec, bytes per device.

    The one renderer of a parameter table: `format_param_table` and the report's
    parameter section (`equishard.report.format_report`) both print through it.

    **Arguments:**

    - `rows`: the rows (`param_table`).
    - `width`: the most columns a line takes (`None`: no limit; see `text_table`).
    - `block_shapes`: add the shape of one device's block ("per device").
    - `digits`: decimals of the byte counts.
    - `total`: end with a total row of the bytes per device.

    **Returns:**

    The table as a string.
    """
    header = ("parameter", "global shape", "dtype", "spec") + (("per device",) if block_shapes else ()) + ("bytes/device",)
    body = [
        (
            r.path,
            "x".join(map(str, r.shape)) or "()",
            r.dtype,
            str(r.spec).removeprefix("PartitionSpec"),
            *(("x".join(map(str, r.local_shape)) or "()",) if block_shapes else ()),
            human_bytes(r.bytes_per_device, digits=digits),
        )
        for r in rows
    ]
    last = None
    if total:
        per_device = sum(r.bytes_per_device for r in rows)
        last = ("total", *("" for _ in header[1:-1]), human_bytes(per_device, digits=digits))
    return text_table(header, body, last, width=width)


def format_param_table(tree: PyTree, mesh: Mesh) -> str:
    """The sharding table of `tree` on `mesh` as aligned text, with a total line.

    **Arguments:**

    - `tree`: a model or any pytree whose arrays carry specs.
    - `mesh`: the mesh.

    **Returns:**

    A multi-line string: path, global shape, dtype, spec, per-device shape and bytes.
    """
    rows = param_table(tree, mesh)
    total = sum(r.total_bytes for r in rows)
    per_device = sum(r.bytes_per_device for r in rows)
    axes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        format_param_rows(rows, block_shapes=True, digits=1, total=False)
        + f"\n{len(rows)} arrays, {human_bytes(total, digits=1)} in all, "
        f"{human_bytes(per_device, digits=1)} per device on mesh ({axes})."
    )
