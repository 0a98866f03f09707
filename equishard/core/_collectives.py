"""Collectives on local blocks, valid inside `shard_map`.

- `ring_shift`: one step round a ring of devices, over one mesh axis or several.
- `ring_all_gather*` / `ring_reduce_scatter*`: all-gather and reduce-scatter built from
  ring steps (collective-permutes only), so compute can be scheduled between the steps;
  blocks in device order.
- `async_gather*` / `async_scatter*`: the same rings with the xLSTM library's
  semantics: blocks listed by ring offset (the order in which they arrive).
- `mp_copy` / `mp_reduce` / `mp_scatter` / `mp_gather`: the conjugate region operators
  of model-parallel (Megatron-style) training.

Every function takes `axis_name` as one mesh axis name or a tuple of them. A tuple
names one combined axis whose devices are ordered as the tuple names them (the
*logical* order of `P(("tp", "dp"))`), which need not be the mesh's order.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree, Shaped

from .._axes import (
    AxisName as AxisName,
    axis_sizes,
    axis_tuple as axis_tuple,
    cast_varying,
    combined_axis_size,
    is_bound,
    mesh_ordered,
    varying_axes as varying_axes,
    vma_checked,
)
from .._errors import MeshError, SpecError

# ---------------------------------------------------------------------------
# Axis bookkeeping (axis names, sizes and varying types live in `equishard._axes`)


def bound_axes(axis_name: AxisName, fn_name: str) -> tuple[str, ...]:
    """The axes of `axis_name`, each checked to be bound where `fn_name` is traced.

    **Raises:**

    `MeshError` naming the unbound axis and the mesh axes that are bound here.
    """
    axes = axis_tuple(axis_name)
    for name in axes:
        if not is_bound(name):
            mesh_axes = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()) or ())
            bound = tuple(a for a in mesh_axes if is_bound(a))
            where = (
                f"the bound mesh axes are {bound}"
                if bound
                else "no mesh axis is bound: call it inside `filter_shard_map` (or "
                "`jax.shard_map`) over a mesh with that axis"
            )
            raise MeshError(f"{fn_name}: the axis {name!r} is not bound here; {where}.")
    return axes



def ring_index(i: Array, offset: int, n: int) -> Array:
    """`(i + offset) mod n` for a traced position `0 <= i < n` and a static `offset`.

    Cheaper than `%` on a traced value (which must handle negative operands).
    """
    return jax.lax.rem(i + offset % n, n)


def _linear_index(coords: dict[str, int], order: tuple[str, ...], sizes: dict[str, int]) -> int:
    index = 0
    for a in order:
        index = index * sizes[a] + coords[a]
    return index


def _ring_permutation(axes: tuple[str, ...], sizes: tuple[int, ...], shift: int, order: tuple[str, ...]):
    """Pairs (source, destination) in `order`'s linearisation for a shift in `axes`' linearisation."""
    n = math.prod(sizes)
    size_of = dict(zip(axes, sizes))
    perm = []
    for logical in range(n):
        src = dict(zip(axes, (int(c) for c in np.unravel_index(logical, sizes))))
        dst = dict(zip(axes, (int(c) for c in np.unravel_index((logical + shift) % n, sizes))))
        perm.append((_linear_index(src, order, size_of), _linear_index(dst, order, size_of)))
    return perm


# ---------------------------------------------------------------------------
# Ring shift


def ring_shift(x: PyTree[Shaped[Array, "..."]], axis_name: AxisName, offset: int = 1) -> PyTree[Shaped[Array, "..."]]:
    """Send each device's `x` `offset` places round the ring of `axis_name`.

    The device at (logical) position `i` of the axis receives the value held by the
    device at position `i - offset` (mod the axis size). With a tuple of axes the ring
    follows the order the tuple names them, as in `P(("tp", "dp"))`: on a
    `(dp=4, tp=2)` mesh, shifting `arange(8)` laid out as `P(("tp", "dp"))` forward
    by one gives `[7, 0, 1, ..., 6]`. (`jax.lax.ppermute` itself linearises a tuple
    in mesh order, and JAX ≥ 0.12 refuses a tuple not in mesh order; this function
    passes the axes in mesh order and remaps the permutation.)

    One `collective-permute` in the compiled program; its transpose is the shift by
    `-offset`.

    **Arguments:**

    - `x`: an array or pytree of arrays (the local block).
    - `axis_name`: a mesh axis name or a tuple of them.
    - `offset`: how many places to shift; negative shifts backwards.

    **Returns:**

    A pytree like `x` holding the block of the device `offset` places behind.
    """
    axes = bound_axes(axis_name, "ring_shift")
    sizes = axis_sizes(axes)
    n = math.prod(sizes)
    shift = offset % n
    if shift == 0:
        return x
    order = mesh_ordered(axes)
    perm = _ring_permutation(axes, sizes, shift, order)
    return jax.lax.ppermute(x, order, perm)


# ---------------------------------------------------------------------------
# Ring all-gather


def _stack(trees: Sequence[PyTree]) -> PyTree:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _cyclic(trees: Sequence[PyTree], start) -> list[PyTree]:
    """`[trees[(start + k) % n] for k in range(n)]` for a traced `0 <= start < n`: one dynamic slice per leaf."""
    n = len(trees)
    doubled = _stack([*trees, *trees])
    window = jax.tree.map(lambda s: jax.lax.dynamic_slice_in_dim(s, start, n, axis=0), doubled)
    return [jax.tree.map(lambda w: w[k], window) for k in range(n)]


def _in_axis_order(by_offset: list[PyTree], axis_name: AxisName) -> list[PyTree]:
    """Reorder blocks received from `i - d` (`by_offset[d]`) into axis order (block `j` from device `j`)."""
    n = len(by_offset)
    if n == 1:
        return list(by_offset)
    i = jax.lax.axis_index(axis_tuple(axis_name))
    # Block j is by_offset[(i - j) % n] = by_offset[::-1][(j - i - 1) % n].
    return _cyclic(by_offset[::-1], n - 1 - i)


def _ring_pass(x: PyTree, axis_name: AxisName, direction: int, steps: int) -> list[PyTree]:
    """`[x, shift(x), shift(shift(x)), ...]`: `steps` ring shifts by `direction`."""
    received = [x]
    for _ in range(steps):
        received.append(ring_shift(received[-1], axis_name, direction))
    return received


def ring_all_gather(
    x: PyTree[Shaped[Array, "..."]], axis_name: AxisName, shift_up: bool = True
) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather by ring permutation: `n - 1` collective-permutes, one block each.

    Each step forwards the block received in the previous step, so work on a block can
    start as soon as it arrives. The result is in axis order: element `j` is the block
    of device `j`, so `jnp.concatenate(result, axis=d)` equals
    `jax.lax.all_gather(x, axis_name, axis=d, tiled=True)`. (Putting arrivals into axis
    order is a local dynamic index by the device's position; no communication.)

    **Arguments:**

    - `x`: an array or pytree of arrays, this device's block.
    - `axis_name`: a mesh axis name or a tuple of them (logical order of the tuple).
    - `shift_up`: send blocks to the next device (`True`) or the previous one (`False`).

    **Returns:**

    A list of `n` pytrees like `x`, the blocks of devices `0, ..., n - 1`.
    """
    n = combined_axis_size(axis_name)
    direction = 1 if shift_up else -1
    received = _ring_pass(x, axis_name, direction, n - 1)
    # received[k] came from device i - direction * k; index it by offset d = i - source.
    by_offset = [received[(direction * d) % n] for d in range(n)]
    return _in_axis_order(by_offset, axis_name)


def ring_all_gather_bidirectional(
    x: PyTree[Shaped[Array, "..."]], axis_name: AxisName, shift_up: bool = True
) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather by ring permutation in both directions at once.

    Blocks travel up and down the ring alternately, so each reaches the far side in
    about `n / 2` steps instead of `n - 1`; still `n - 1` collective-permutes of one
    block in all. Result order as in `ring_all_gather`.

    **Arguments:**

    - `x`: an array or pytree of arrays, this device's block.
    - `axis_name`: a mesh axis name or a tuple of them.
    - `shift_up`: whether the first (and, for even `n`, the extra) step goes up.

    **Returns:**

    A list of `n` pytrees like `x`, the blocks of devices `0, ..., n - 1`.
    """
    n = combined_axis_size(axis_name)
    first = 1 if shift_up else -1
    steps_first = n // 2  # ceil((n - 1) / 2)
    steps_second = n - 1 - steps_first
    chain_first = [x]
    chain_second = [x]
    for step in range(steps_first):
        chain_first.append(ring_shift(chain_first[-1], axis_name, first))
        if step < steps_second:
            chain_second.append(ring_shift(chain_second[-1], axis_name, -first))
    # chain_first[e] came from i - first * e, chain_second[e] from i + first * e.
    by_first_offset = chain_first + chain_second[:0:-1]  # offsets 0..n-1 in direction `first`
    by_offset = [by_first_offset[(first * d) % n] for d in range(n)]
    return _in_axis_order(by_offset, axis_name)


def _split_last(x: PyTree, fn_name: str, even: bool = True) -> tuple[PyTree, PyTree]:
    """`(x[..., :d // 2], x[..., d // 2:])` per leaf; `even`: refuse an odd `d`."""

    def check(leaf):
        if leaf.ndim == 0 or (even and leaf.shape[-1] % 2):
            need = "it must be even" if even else "it needs one"
            raise SpecError(
                f"{fn_name} splits the last dimension into halves sent in opposite directions; "
                f"{need}, got shape {tuple(leaf.shape)}"
            )

    jax.tree.map(check, x)
    lo = jax.tree.map(lambda leaf: leaf[..., : leaf.shape[-1] // 2], x)
    hi = jax.tree.map(lambda leaf: leaf[..., leaf.shape[-1] // 2 :], x)
    return lo, hi


def ring_all_gather_split(x: PyTree[Shaped[Array, "..."]], axis_name: AxisName) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather by two ring passes of half blocks in opposite directions.

    The last (feature) dimension of each block is split in halves; the first half goes
    up the ring and the second down, `n - 1` collective-permutes of half a block each
    way, so both directions of each link carry data. Result order as in `ring_all_gather`.

    **Arguments:**

    - `x`: an array or pytree of arrays whose last dimension is even.
    - `axis_name`: a mesh axis name or a tuple of them.

    **Returns:**

    A list of `n` pytrees like `x`, the blocks of devices `0, ..., n - 1`.

    **Raises:**

    `SpecError` if a last dimension is odd.
    """
    lo, hi = _split_last(x, "ring_all_gather_split")
    los = ring_all_gather(lo, axis_name, shift_up=True)
    his = ring_all_gather(hi, axis_name, shift_up=False)
    return [jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), l, h) for l, h in zip(los, his)]


# ---------------------------------------------------------------------------
# Ring reduce-scatter


def ring_reduce_scatter(
    xs: Sequence[PyTree[Shaped[Array, "..."]]], axis_name: AxisName, shift_up: bool = True
) -> PyTree[Shaped[Array, "..."]]:
    """Reduce-scatter by ring permutation: `n - 1` collective-permutes, one block each.

    `xs[j]` is this device's partial contribution to device `j`'s block. A running sum
    travels round the ring, each device adding its contribution as it passes, and
    arrives complete at its owner: device `i` returns `sum over devices d of xs_d[i]`,
    i.e. `jax.lax.psum_scatter(jnp.stack(xs), axis_name)`.

    **Arguments:**

    - `xs`: a sequence of `n` pytrees of identical structure and shapes, in axis order.
    - `axis_name`: a mesh axis name or a tuple of them.
    - `shift_up`: send sums to the next device (`True`) or the previous one (`False`).

    **Returns:**

    This device's summed block, a pytree like `xs[0]`.

    **Raises:**

    `SpecError` if `len(xs)` differs from the size of the axis.
    """
    n = _check_partials(xs, axis_name, "ring_reduce_scatter")
    if n == 1:
        return xs[0]
    direction = 1 if shift_up else -1
    i = jax.lax.axis_index(axis_tuple(axis_name))
    # The sum bound for device t starts on device t + direction and moves on by
    # `direction`: at step s device i adds its partial for t = i - direction * (1 + s).
    if shift_up:
        parts = _cyclic(list(xs)[::-1], jax.lax.rem(n - i, n))  # parts[s] = xs[(i - 1 - s) % n]
    else:
        parts = _cyclic(list(xs), ring_index(i, 1, n))  # parts[s] = xs[(i + 1 + s) % n]
    acc = parts[0]
    for step in range(1, n):
        acc = ring_shift(acc, axis_name, direction)
        acc = jax.tree.map(jnp.add, acc, parts[step])
    return acc


def ring_reduce_scatter_split(xs: Sequence[PyTree[Shaped[Array, "..."]]], axis_name: AxisName) -> PyTree[Shaped[Array, "..."]]:
    """Reduce-scatter by two ring passes of half blocks in opposite directions.

    The last dimension of each partial is split in halves; the first halves are summed
    going up the ring and the second going down. Same result as `ring_reduce_scatter`.

    **Arguments:**

    - `xs`: a sequence of `n` pytrees of identical structure and shapes with an even last
      dimension, in axis order.
    - `axis_name`: a mesh axis name or a tuple of them.

    **Returns:**

    This device's summed block, a pytree like `xs[0]`.

    **Raises:**

    `SpecError` if `len(xs)` differs from the size of the axis or a last dimension is odd.
    """
    halves = [_split_last(x, "ring_reduce_scatter_split") for x in xs]
    lo = ring_reduce_scatter([h[0] for h in halves], axis_name, shift_up=True)
    hi = ring_reduce_scatter([h[1] for h in halves], axis_name, shift_up=False)
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), lo, hi)


# ---------------------------------------------------------------------------
# Ring all-gather and reduce-scatter in the xLSTM library's ring-offset order
#
# Element k of a gathered list is the block that arrived after k ring shifts (the
# device's own block first); `async_scatter` adds `xs[k]` to the running sum after k
# shifts. Both are what `xlstm_jax.distributed.tensor_parallel` returns; equishard's
# device-index-ordered variants are `ring_all_gather*` / `ring_reduce_scatter*`.


def _check_partials(xs: Sequence[PyTree], axis_name: AxisName, fn_name: str) -> int:
    n = combined_axis_size(axis_name)
    if len(xs) != n:
        raise SpecError(
            f"{fn_name} needs one partial per device of axis {axis_name!r} (size {n}), got {len(xs)}"
        )
    return n


def async_gather(
    x: PyTree[Shaped[Array, "..."]], axis_name: AxisName, shift_up: bool = True
) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather by ring permutation, in ring-offset order (the xLSTM library's order).

    `n - 1` collective-permutes, each forwarding the block received in the previous step.
    Element `k` of the result is the block that arrived after `k` shifts: on device `i`,
    the block of device `i - k` (`shift_up=True`) or `i + k` (`shift_up=False`), mod `n`;
    element 0 is the device's own block. So `jnp.concatenate(result)` is *not* the
    all-gather on any device but device `0` of a downward ring; for blocks in device
    order use `ring_all_gather`.

    **Arguments:**

    - `x`: an array or pytree of arrays, this device's block.
    - `axis_name`: a mesh axis name or a tuple of them (logical order of the tuple).
    - `shift_up`: send blocks to the next device (device 0 sends to device 1) or to the
      previous one.

    **Returns:**

    A list of `n` pytrees like `x`, by ring offset.
    """
    n = combined_axis_size(axis_name)
    return _ring_pass(x, axis_name, 1 if shift_up else -1, n - 1)


def async_gather_bidirectional(
    x: PyTree[Shaped[Array, "..."]], axis_name: AxisName, shift_up: bool = True
) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather by ring permutation in both directions, in ring-offset order.

    Odd steps shift a chain of blocks up the ring, even steps another chain down, so
    each block arrives in about `n / 2` steps instead of `n - 1`; `n - 1`
    collective-permutes in all. The list has the order of `async_gather` with the same
    `shift_up`: element `k` is the block of device `i - k` (`shift_up=True`) or `i + k`
    (`shift_up=False`), mod `n`.

    **Arguments:**

    - `x`: an array or pytree of arrays, this device's block.
    - `axis_name`: a mesh axis name or a tuple of them.
    - `shift_up`: which unidirectional order the list follows.

    **Returns:**

    A list of `n` pytrees like `x`, by ring offset.
    """
    n = combined_axis_size(axis_name)
    ups: list[PyTree] = []
    downs: list[PyTree] = []
    for step in range(1, n):
        if step % 2:
            ups.append(ring_shift(ups[-1] if ups else x, axis_name, 1))
        else:
            downs.append(ring_shift(downs[-1] if downs else x, axis_name, -1))
    # ups[e] came from i - 1 - e, downs[e] from i + 1 + e.
    return [x, *ups, *downs[::-1]] if shift_up else [x, *downs, *ups[::-1]]


def async_gather_split(x: PyTree[Shaped[Array, "..."]], axis_name: AxisName) -> list[PyTree[Shaped[Array, "..."]]]:
    """All-gather of half blocks in opposite directions, in ring-offset order.

    The last dimension of each block is split in halves; the first half goes up the ring
    and the second down, `n - 1` collective-permutes of half a block each way. The
    result is the `2n` half blocks: `async_gather(first_half, shift_up=True)` followed by
    `async_gather(second_half, shift_up=False)` — element `k < n` is the first half of
    device `i - k`'s block, element `n + k` the second half of device `i + k`'s.

    **Arguments:**

    - `x`: an array or pytree of arrays whose last dimension is even.
    - `axis_name`: a mesh axis name or a tuple of them.

    **Returns:**

    A list of `2n` pytrees of half blocks.

    **Raises:**

    `SpecError` if a last dimension is odd.
    """
    lo, hi = _split_last(x, "async_gather_split")
    return async_gather(lo, axis_name, shift_up=True) + async_gather(hi, axis_name, shift_up=False)


def _ring_sum(xs: Sequence[PyTree], axis_name: AxisName, direction: int) -> PyTree:
    """`y = xs[0]`, then `n - 1` times: shift `y` by `direction`, add the next partial."""
    y = xs[0]
    for x in xs[1:]:
        y = jax.tree.map(jnp.add, ring_shift(y, axis_name, direction), x)
    return y


def async_scatter(
    xs: Sequence[PyTree[Shaped[Array, "..."]]], axis_name: AxisName, shift_up: bool = True
) -> PyTree[Shaped[Array, "..."]]:
    """Reduce-scatter by ring permutation, partials in ring-offset order (the xLSTM library's).

    A running sum starts as `xs[0]`, is shifted one place round the ring and has the
    next partial added, `n - 1` times. So device `j`'s `xs[k]` ends on device
    `j - k - 1` (`shift_up=True`) or `j + k + 1` (`shift_up=False`), mod `n`: device `i`
    returns `sum_k xs[k] of device i + k + 1` (resp. `i - k - 1`). For partials in
    device order (`xs[j]` for device `j`) use `ring_reduce_scatter`.

    **Arguments:**

    - `xs`: a sequence of `n` pytrees of identical structure and shapes.
    - `axis_name`: a mesh axis name or a tuple of them.
    - `shift_up`: shift the running sums up (device 0 sends to device 1) or down.

    **Returns:**

    This device's summed block, a pytree like `xs[0]`.

    **Raises:**

    `SpecError` if `len(xs)` differs from the size of the axis.
    """
    _check_partials(xs, axis_name, "async_scatter")
    return _ring_sum(xs, axis_name, 1 if shift_up else -1)


def async_scatter_split(xs: Sequence[PyTree[Shaped[Array, "..."]]], axis_name: AxisName) -> PyTree[Shaped[Array, "..."]]:
    """Reduce-scatter of half partials in opposite directions, in ring-offset order.

    The last dimension `d` of each partial is split as the reference splits it,
    `x[..., :d // 2]` and `x[..., d // 2:]` (an odd `d` too: the second part is one
    longer); the first parts are summed as `async_scatter(..., shift_up=True)` and the
    second as `async_scatter(..., shift_up=False)`, and the two sums concatenated. The
    parts of one partial therefore end on different devices (`j - k - 1` and `j + k + 1`).

    **Arguments:**

    - `xs`: a sequence of `n` pytrees of identical structure and shapes, each of at
      least one dimension.
    - `axis_name`: a mesh axis name or a tuple of them.

    **Returns:**

    This device's summed block, a pytree like `xs[0]`.

    **Raises:**

    `SpecError` if `len(xs)` differs from the size of the axis or a leaf is a scalar.
    """
    _check_partials(xs, axis_name, "async_scatter_split")
    halves = [_split_last(x, "async_scatter_split", even=False) for x in xs]
    lo = _ring_sum([h[0] for h in halves], axis_name, 1)
    hi = _ring_sum([h[1] for h in halves], axis_name, -1)
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), lo, hi)


# ---------------------------------------------------------------------------
# Conjugate region operators
#
# With the varying-axes check on (equishard's convention) JAX's typed collectives already
# transpose into their conjugates: `pvary` <-> `psum`, and an all-gather to an
# invariant value <-> taking this device's slice. The operators use them, so the
# gradient is the true one whatever the types of the inputs. With `check_vma=False`
# nothing is typed (a `psum` transposes to another `psum`), and the operators fall back
# to `custom_vjp` rules that state Megatron's conjugates literally.


def _normalise_dim(x: Array, dim: int, fn_name: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise SpecError(f"{fn_name}: dim {dim} is out of range for an array of shape {tuple(x.shape)}")
    return dim % x.ndim


def _local_slice(x: Array, axes: tuple[str, ...], dim: int) -> Array:
    """This device's block of `x` along `dim`, blocks in the logical order of `axes`."""
    size = x.shape[dim] // combined_axis_size(axes)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, axis=dim)


class ReduceOp(str, enum.Enum):
    """The reductions `mp_copy` / `mp_reduce` accept as `op` (torch's `ReduceOp` names).

    `SUM` (`jax.lax.psum`), `MEAN` (`jax.lax.pmean`, torch's `AVG`), `MAX` (`pmax`),
    `MIN` (`pmin`): the reductions JAX's collectives support. The plain strings
    `"sum"`, `"mean"` (or `"avg"`), `"max"`, `"min"` are accepted too; torch's `PRODUCT`
    and bitwise reductions have no JAX collective and raise `SpecError`.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


_REDUCERS = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _check_op(fn_name: str, op: Any) -> str:
    value = op.value if isinstance(op, ReduceOp) else op
    value = "mean" if value == "avg" else value
    if isinstance(value, str) and value in _REDUCERS:
        return value
    raise SpecError(
        f"{fn_name}: op {op!r} is not a reduction JAX's collectives support; use one of "
        f"ReduceOp.SUM, ReduceOp.MEAN (torch's AVG), ReduceOp.MAX, ReduceOp.MIN."
    )


def _check_dim(fn_name: str, dim: Any) -> int:
    if not isinstance(dim, int):
        raise SpecError(f"{fn_name}: dim must be an int, got {dim!r}.")
    return dim


def _reduce(x: Array, axes: tuple[str, ...], op: str) -> Array:
    return _REDUCERS[op](x, mesh_ordered(axes))


def _was_varying(x: Array, axes: tuple[str, ...]) -> bool:
    """Whether `x` is typed varying along any of `axes` (its cotangent must be too)."""
    return bool(set(axes) & varying_axes(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _copy_conjugate(x, axes, op, typed, was_varying):
    return cast_varying(x, axes) if typed else x


def _copy_conjugate_fwd(x, axes, op, typed, was_varying):
    return _copy_conjugate(x, axes, op, typed, was_varying), None


def _copy_conjugate_bwd(axes, op, typed, was_varying, _, g):
    g = _reduce(g, axes, op)
    return (cast_varying(g, axes) if was_varying else g,)


_copy_conjugate.defvjp(_copy_conjugate_fwd, _copy_conjugate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _reduce_conjugate(x, axes, op, was_varying):
    return _reduce(x, axes, op)


def _reduce_conjugate_fwd(x, axes, op, was_varying):
    return _reduce(x, axes, op), None


def _reduce_conjugate_bwd(axes, op, was_varying, _, g):
    # Identity: each device gets the cotangent of the reduced value unchanged.
    return (cast_varying(g, axes) if was_varying else g,)


_reduce_conjugate.defvjp(_reduce_conjugate_fwd, _reduce_conjugate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _scatter_conjugate(x, axes, dim, typed):
    return _local_slice(cast_varying(x, axes) if typed else x, axes, dim)


def _scatter_conjugate_fwd(x, axes, dim, typed):
    return _scatter_conjugate(x, axes, dim, typed), None


def _scatter_conjugate_bwd(axes, dim, typed, _, g):
    if typed:
        # f32[.., N/n, ..]{V: axes} -> f32[.., N, ..] (invariant, as the primal input was)
        return (jax.lax.all_gather(g, axes, axis=dim, tiled=True, to="invarying"),)
    return (jax.lax.all_gather(g, axes, axis=dim, tiled=True),)


_scatter_conjugate.defvjp(_scatter_conjugate_fwd, _scatter_conjugate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_untyped(x, axes, dim):
    return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


def _gather_untyped_fwd(x, axes, dim):
    return _gather_untyped(x, axes, dim), None


def _gather_untyped_bwd(axes, dim, _, g):
    return (_local_slice(g, axes, dim),)


_gather_untyped.defvjp(_gather_untyped_fwd, _gather_untyped_bwd)


def mp_copy(
    x: Shaped[Array, "*shape"], op: ReduceOp | str = ReduceOp.SUM, *, axis_name: AxisName
) -> Shaped[Array, "*shape"]:
    """Enter a model-parallel region: forward identity, backward reduction over the axis.

    `ml.models.parallel.mp_copy` (Megatron's `f` operator), placed before a
    column-parallel layer whose input is replicated.

    Backward, by convention:

    - `check_vma=False` (the reference's convention): the cotangent is reduced with
      `op` over the axis (`psum` for `SUM`), exactly as the reference does.
    - With the varying-axes check on (equishard's default) and `op=SUM`, `x` is cast to
      varying along the axes on which it is still invariant, whose transpose is the
      `psum`; an input already varying along the axis is passed through untouched,
      since each device's value then has its own gradient (where the reference would
      still sum). Other ops reduce the cotangent with `op` as the reference does.

    **Arguments:**

    - `x`: the (replicated) input.
    - `op`: the reduction of the backward pass: `ReduceOp.SUM` (default), `MEAN`, `MAX`,
      `MIN`, or their strings.
    - `axis_name`: the model-parallel mesh axis, or a tuple of them (keyword-only,
      required).

    **Returns:**

    `x`, typed as varying along `axis_name`.

    **Raises:**

    `SpecError` if `op` is not a supported reduction.
    """
    op = _check_op("mp_copy", op)
    axes = bound_axes(axis_name, "mp_copy")
    typed = vma_checked(axes)
    if typed and op == "sum":
        return cast_varying(x, axes)
    return _copy_conjugate(x, axes, op, typed, typed and _was_varying(x, axes))


def mp_reduce(
    x: Shaped[Array, "*shape"], op: ReduceOp | str = ReduceOp.SUM, *, axis_name: AxisName
) -> Shaped[Array, "*shape"]:
    """Leave a model-parallel region: forward reduction over the axis, backward identity.

    `ml.models.parallel.mp_reduce` (Megatron's `g` operator), placed after a
    row-parallel layer whose outputs are partial sums.

    Backward, by convention: with `check_vma=False` (the reference's) and for every
    `op`, each device gets the cotangent of the reduced value unchanged, as in the
    reference. With the varying-axes check on (equishard's default) and `op=SUM`, it is
    `jax.lax.psum`, whose transpose does the same for a varying input (the reduced value
    is invariant, so its cotangent is the same on every device); other ops use the
    identity backward explicitly.

    **Arguments:**

    - `x`: this device's partial value.
    - `op`: the forward reduction: `ReduceOp.SUM` (default), `MEAN`, `MAX`, `MIN`, or
      their strings.
    - `axis_name`: the model-parallel mesh axis, or a tuple of them (keyword-only,
      required).

    **Returns:**

    The reduction of `x` over the devices of `axis_name`, the same on each of them.

    **Raises:**

    `SpecError` if `op` is not a supported reduction.
    """
    op = _check_op("mp_reduce", op)
    axes = bound_axes(axis_name, "mp_reduce")
    typed = vma_checked(axes)
    if typed and op == "sum":
        return jax.lax.psum(x, mesh_ordered(axes))
    return _reduce_conjugate(x, axes, op, typed and _was_varying(x, axes))


def _check_divisible(x: Array, dim: int, n: int, axis_name: AxisName, fn_name: str) -> None:
    if x.shape[dim] % n:
        raise SpecError(
            f"{fn_name}: dimension {dim} of an array of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the {n} devices of axis {axis_name!r}"
        )


def mp_scatter(
    x: Shaped[Array, "..."], dim: int = -1, *, axis_name: AxisName
) -> Shaped[Array, "..."]:
    """Split a replicated array across the model-parallel axis: keep this device's slice.

    Forward keeps block `i` (of `n` equal blocks along `dim`, in the logical order of
    `axis_name`); backward all-gathers the cotangent. With the varying-axes check on and
    `x` invariant along the axis, the backward is an all-gather to an invariant value;
    an `x` already varying along the axis gets the plain slice's gradient (zero outside
    the slice). With `check_vma=False` the all-gather backward is a `custom_vjp`.

    **Arguments:**

    - `x`: the replicated array, shape `(..., N, ...)`.
    - `dim`: the dimension to split; `N` must be divisible by the axis size.
    - `axis_name`: the model-parallel mesh axis, or a tuple of them (keyword-only,
      required).

    **Returns:**

    This device's block, shape `(..., N // n, ...)`.

    **Raises:**

    `SpecError` if `dim` is out of range or `N` is not divisible by the axis size.
    """
    dim = _normalise_dim(x, _check_dim("mp_scatter", dim), "mp_scatter")
    axes = bound_axes(axis_name, "mp_scatter")
    _check_divisible(x, dim, combined_axis_size(axes), axis_name, "mp_scatter")
    if not vma_checked(axes):
        return _scatter_conjugate(x, axes, dim, False)
    varying = varying_axes(x)
    if not any(a in varying for a in axes):
        return _scatter_conjugate(x, axes, dim, True)
    return _local_slice(cast_varying(x, axes), axes, dim)


def mp_gather(
    x: Shaped[Array, "..."], dim: int = -1, *, axis_name: AxisName
) -> Shaped[Array, "..."]:
    """Gather a split array from the model-parallel axis: backward keeps this device's slice.

    Forward concatenates the blocks of all devices along `dim` (in the logical order of
    `axis_name`); the result is the same on every device and, with the varying-axes
    check on, typed invariant (`jax.lax.all_gather(..., to="invarying")`), whose
    transpose is taking this device's slice. With `check_vma=False` that backward is a
    `custom_vjp`.

    **Arguments:**

    - `x`: this device's block, shape `(..., N, ...)`.
    - `dim`: the dimension to gather along.
    - `axis_name`: the model-parallel mesh axis, or a tuple of them (keyword-only,
      required).

    **Returns:**

    The gathered array, shape `(..., N * n, ...)`.
    """
    dim = _normalise_dim(x, _check_dim("mp_gather", dim), "mp_gather")
    axes = bound_axes(axis_name, "mp_gather")
    if vma_checked(axes):
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True, to="invarying")
    return _gather_untyped(x, axes, dim)

