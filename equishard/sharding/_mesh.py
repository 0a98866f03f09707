"""Meshes from layout strings: `make_mesh("dp=2,fsdp=2,tp=2")`.

One parser serves the Python API and the command line's `--layout`.

**Axis types.** JAX's own `jax.make_mesh` defaults to `AxisType.Explicit`;
equishard's `make_mesh` builds `AxisType.Auto` axes, deliberately (see
[Meshes and specs](../guides/meshes-and-specs.md#a-mesh)):

- every collective equishard issues is explicit, inside `shard_map`, where all axes are
  manual and the outer axis type changes nothing;
- outside `shard_map`, what a user runs on placed arrays (an optimizer's `init`,
  metrics, data preparation) works as plain JAX code with Auto axes, while Explicit axes
  make eager operations on sharded arrays demand a `jax.set_mesh` context
  (`optax.adafactor(...).init(params)` fails without one).

Meshes with Explicit axes (a user's own `jax.make_mesh`) are supported everywhere:
`shard` and `filter_shard_map` place arrays with `jax.sharding.reshard` on them, and
the tests run on both kinds. `axis_types=AxisType.Explicit` builds one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from .._errors import MeshError

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_layout(layout: str | Mapping[str, int], num_devices: int | None = None) -> dict[str, int]:
    """Parse a layout such as `"dp=2,fsdp=2,tp=2"` into an ordered `{axis: size}` dict.

    One size may be `-1`: it takes whatever the other axes leave of `num_devices`.

    **Arguments:**

    - `layout`: a string `"name=size,name=size"` (spaces allowed) or a mapping.
    - `num_devices`: the devices the mesh will use; defaults to `jax.device_count()`.

    **Returns:**

    A dict from axis name to size, in the order given, whose product is at most
    `num_devices`.

    **Raises:**

    `MeshError` for a malformed string, a repeated axis, a size below 1 (other than one
    `-1`), or a mesh bigger than the devices.
    """
    if num_devices is None:
        num_devices = jax.device_count()
    if isinstance(layout, str):
        items: list[tuple[str, int]] = []
        text = layout.strip()
        if not text:
            raise MeshError("empty layout: expected axes like 'dp=2,fsdp=2,tp=2'.")
        for part in text.split(","):
            name, eq, size_text = part.partition("=")
            name, size_text = name.strip(), size_text.strip()
            if not eq or not _AXIS_NAME.fullmatch(name):
                raise MeshError(
                    f"malformed layout {layout!r}: {part.strip()!r} is not of the form "
                    f"'name=size' (e.g. 'dp=2,fsdp=2,tp=2')."
                )
            try:
                size = int(size_text)
            except ValueError:
                raise MeshError(
                    f"malformed layout {layout!r}: the size of axis {name!r} is "
                    f"{size_text!r}, not an integer."
                ) from None
            items.append((name, size))
    else:
        items = [(str(k), int(v)) for k, v in layout.items()]
    names = [n for n, _ in items]
    for name in names:
        if names.count(name) > 1:
            raise MeshError(f"layout {layout!r} names axis {name!r} twice.")
    fill = [n for n, s in items if s == -1]
    bad = [(n, s) for n, s in items if s < 1 and s != -1]
    if bad or len(fill) > 1:
        what = f"axis {bad[0][0]!r} has size {bad[0][1]}" if bad else "more than one axis is -1"
        raise MeshError(f"layout {layout!r}: {what}; sizes are positive, and at most one may be -1.")
    known = math.prod(s for _, s in items if s != -1)
    if fill:
        if num_devices % known:
            raise MeshError(
                f"layout {layout!r}: the fixed axes use {known} devices, which does not "
                f"divide the {num_devices} devices, so axis {fill[0]!r}=-1 cannot fill them."
            )
        items = [(n, num_devices // known if s == -1 else s) for n, s in items]
    total = math.prod(s for _, s in items)
    if total > num_devices:
        raise MeshError(
            f"layout {layout!r} needs {total} devices but only {num_devices} exist "
            f"({jax.devices()[0].platform}). On the CPU, set "
            f"jax.config.update('jax_num_cpu_devices', N) before JAX starts."
        )
    return dict(items)


def make_mesh(
    layout: str | Mapping[str, int],
    *,
    devices: Sequence[Any] | None = None,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
) -> Mesh:
    """Build a device mesh from a layout: `make_mesh("dp=2,fsdp=2,tp=2")`.

    **Arguments:**

    - `layout`: `"name=size,..."` or a mapping (see `parse_layout`); one size may be -1.
    - `devices`: the devices to use (default: all of `jax.devices()`); a layout smaller
      than the device list uses its first devices.
    - `axis_types`: one type for all axes or one per axis. equishard's default is
      `AxisType.Auto` (see this module's documentation for why).

    **Returns:**

    A `jax.sharding.Mesh` with the axes in the order given.
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = parse_layout(layout, len(devices))
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(axes)
    axis_types = tuple(axis_types)
    if len(axis_types) != len(axes):
        raise MeshError(f"{len(axis_types)} axis types given for the {len(axes)} axes of {layout!r}.")
    total = math.prod(axes.values())
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes.keys()),
        axis_types=axis_types,
        devices=devices[:total],
    )
