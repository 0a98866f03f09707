"""Collective matmuls: a matmul and the all-gather or reduce-scatter around it, split
into ring steps so that each step's communication can overlap the previous step's
compute.

- `all_gather_matmul`: `all_gather(x) @ w` (tensor/sequence-parallel gather) or
  `x @ all_gather(w)` (the FSDP forward), without ever holding the gathered operand's
  blocks longer than one product needs them.
- `matmul_reduce_scatter`: `psum_scatter(x @ w)` (row-parallel output, FSDP backward),
  the partial products accumulated while travelling round the ring.

Both run over one mesh axis or a tuple of axes (logical order of the tuple, as
`ring_shift`), in one direction or in both (each block split in halves sent opposite
ways), and compile to collective-permutes only. Their gradients are JAX's transposes of
the ring: again collective-permutes interleaved with the matmuls of the backward pass.

The dimension that is gathered or scattered is the second-to-last of `x` (its rows):
`x` may carry leading batch dimensions, e.g. `f32[B, T/n, D]` for sequence parallelism
over `T`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._axes import AxisName, axis_tuple, combined_axis_size
from .._errors import LayerConfigError, SpecError
from ._collectives import ring_index, ring_shift


def _rows(x: Array, start, size: int) -> Array:
    """Rows `[start, start + size)` of `x` (its second-to-last dimension); `start` may be traced."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 2)


def _cols(x: Array, start, size: int) -> Array:
    """Columns `[start, start + size)` of `x` (its last dimension); `start` may be traced."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)


def _put_rows(out: Array, value: Array, start) -> Array:
    """`out` with rows `[start, start + value rows)` replaced by `value`."""
    return jax.lax.dynamic_update_slice_in_dim(out, value, start, axis=out.ndim - 2)


def _describe(name: str, x: Array, w: Array, axis_name: AxisName, n: int) -> str:
    return f"{name}: x {tuple(x.shape)}, w {tuple(w.shape)} over axis {axis_name!r} of {n} devices"


def _check_operands(name: str, x: Array, w: Array, axis_name: AxisName, n: int) -> None:
    if x.ndim < 2 or w.ndim != 2:
        raise SpecError(f"{_describe(name, x, w, axis_name, n)}: x needs rank >= 2 ([..., rows, k]) and w rank 2 ([k, n])")


def all_gather_matmul(
    x: Float[Array, "*batch rows xk"],
    w: Float[Array, "wk cols"],
    axis_name: AxisName,
    *,
    gathered: str = "x",
    bidirectional: bool = False,
) -> Float[Array, "*batch out_rows cols"]:
    """A matmul with one operand all-gathered, the gather split into ring steps.

    - `gathered="x"`: `all_gather(x, rows) @ w`. Local `x: f32[..., M/n, K]`,
      `w: f32[K, N]` -> `f32[..., M, N]`: the `n` row blocks of the product are computed
      one per step, each as its block of `x` arrives (tensor-parallel "gather" mode,
      sequence parallelism's gather before a column-parallel layer).
    - `gathered="w"`: `x @ all_gather(w, rows)`. Local `x: f32[..., B/n, K]`,
      `w: f32[K/n, N]` -> `f32[..., B/n, N]`: `n` products `x[:, block j] @ w_j`
      summed while the next `w_j` travels (the FSDP forward).

    With `bidirectional=True` each travelling block is split in halves along its rows,
    one half sent up the ring and the other down: `2(n - 1)` collective-permutes of half a
    block instead of `n - 1` of a whole one, using both directions of every link.

    Equal in value and gradient to `jax.lax.all_gather(..., tiled=True)` followed by the
    matmul.

    **Arguments:**

    - `x`: the left operand's local block, `[..., rows, k]`.
    - `w`: the right operand's local block, `[k, cols]`.
    - `axis_name`: the mesh axis (or tuple of axes, in logical order) to gather over.
    - `gathered`: which operand is gathered, `"x"` or `"w"`.
    - `bidirectional`: send half blocks both ways round the ring.

    **Returns:**

    `all_gather(x) @ w` (`[..., n * rows, cols]`) or `x @ all_gather(w)`
    (`[..., rows, cols]`).

    **Raises:**

    `SpecError` when the shapes do not fit: the contracting dimensions differ, `x`'s `K`
    is not `n` times `w`'s rows (`gathered="w"`), or, for `bidirectional`, the
    travelling block has an odd number of rows (the gathered dimension is not divisible
    by `2n`). `LayerConfigError` for an unknown `gathered`.
    """
    axes = axis_tuple(axis_name)
    n = combined_axis_size(axes)
    _check_operands("all_gather_matmul", x, w, axis_name, n)
    if gathered == "x":
        if x.shape[-1] != w.shape[0]:
            raise SpecError(
                f"{_describe('all_gather_matmul', x, w, axis_name, n)}: gathered='x' contracts "
                f"x's last dimension ({x.shape[-1]}) with w's first ({w.shape[0]}); they must be equal"
            )
        if bidirectional and x.shape[-2] % 2:
            raise SpecError(
                f"{_describe('all_gather_matmul', x, w, axis_name, n)}: bidirectional sends half "
                f"of x's {x.shape[-2]} local rows each way; the gathered dimension "
                f"({n * x.shape[-2]}) must be divisible by 2n = {2 * n}"
            )
        return _gather_x_matmul(x, w, axes, n, bidirectional)
    if gathered == "w":
        if x.shape[-1] % n or x.shape[-1] // n != w.shape[0]:
            raise SpecError(
                f"{_describe('all_gather_matmul', x, w, axis_name, n)}: gathered='w' needs x's "
                f"last dimension ({x.shape[-1]}) to be n = {n} times w's local rows ({w.shape[0]})"
            )
        if bidirectional and w.shape[0] % 2:
            raise SpecError(
                f"{_describe('all_gather_matmul', x, w, axis_name, n)}: bidirectional sends half "
                f"of w's {w.shape[0]} local rows each way; the contracting dimension "
                f"({x.shape[-1]}) must be divisible by 2n = {2 * n}"
            )
        return _matmul_gather_w(x, w, axes, n, bidirectional)
    raise LayerConfigError(f"all_gather_matmul: gathered must be 'x' or 'w', got {gathered!r}")


def _gather_x_matmul(x: Array, w: Array, axes: tuple[str, ...], n: int, bidirectional: bool) -> Array:
    i = jax.lax.axis_index(axes)
    m = x.shape[-2]
    out = None
    if not bidirectional:
        chunk = x
        for step in range(n):
            # The block of device i - step: f32[..., M/n, K] @ f32[K, N] -> f32[..., M/n, N]
            following = ring_shift(chunk, axes, 1) if step < n - 1 else chunk
            product = chunk @ w
            if out is None:
                out = jnp.zeros((*product.shape[:-2], n * m, product.shape[-1]), product.dtype)
            out = _put_rows(out, product, ring_index(i, -step, n) * m)
            chunk = following
        assert out is not None
        return out
    half = m // 2
    up, down = x[..., :half, :], x[..., half:, :]
    for step in range(n):
        # First halves travel up (from device i - step), second halves down (from i + step).
        following = (ring_shift(up, axes, 1), ring_shift(down, axes, -1)) if step < n - 1 else (up, down)
        product_up, product_down = up @ w, down @ w
        if out is None:
            out = jnp.zeros((*product_up.shape[:-2], n * m, product_up.shape[-1]), product_up.dtype)
        out = _put_rows(out, product_up, ring_index(i, -step, n) * m)
        out = _put_rows(out, product_down, ring_index(i, step, n) * m + half)
        up, down = following
    assert out is not None
    return out


def _matmul_gather_w(x: Array, w: Array, axes: tuple[str, ...], n: int, bidirectional: bool) -> Array:
    i = jax.lax.axis_index(axes)
    k = w.shape[0]
    acc = None
    if not bidirectional:
        chunk = w
        for step in range(n):
            # f32[..., B/n, K/n] (columns of block i - step) @ f32[K/n, N] -> f32[..., B/n, N]
            following = ring_shift(chunk, axes, 1) if step < n - 1 else chunk
            product = _cols(x, ring_index(i, -step, n) * k, k) @ chunk
            acc = product if acc is None else acc + product
            chunk = following
        assert acc is not None
        return acc
    half = k // 2
    up, down = w[:half], w[half:]
    for step in range(n):
        following = (ring_shift(up, axes, 1), ring_shift(down, axes, -1)) if step < n - 1 else (up, down)
        # First halves of w's blocks travel up (from device i - step), second halves down.
        # f32[..., B/n, K/2n] @ f32[K/2n, N] -> f32[..., B/n, N], twice
        product = _cols(x, ring_index(i, -step, n) * k, half) @ up + _cols(x, ring_index(i, step, n) * k + half, half) @ down
        acc = product if acc is None else acc + product
        up, down = following
    assert acc is not None
    return acc


def matmul_reduce_scatter(
    x: Float[Array, "*batch rows xk"],
    w: Float[Array, "wk cols"],
    axis_name: AxisName,
    *,
    bidirectional: bool = False,
) -> Float[Array, "*batch out_rows cols"]:
    """`psum_scatter(x @ w)` over the rows, the reduce-scatter split into ring steps.

    Local `x: f32[..., M, K/n]`, `w: f32[K/n, N]` (a matmul contracting a sharded
    dimension, so each device holds a partial sum) -> `f32[..., M/n, N]`, this device's
    row block of the summed product. At each step a device computes its partial product
    for the row block whose running sum is passing through and adds it before passing it
    on; after `n - 1` collective-permutes each sum has reached its owner (row-parallel
    output with a sequence-parallel scatter, the FSDP backward).

    With `bidirectional=True` each row block is split in halves, the first halves'
    sums travelling up the ring and the second halves' down.

    Equal in value and gradient to
    `jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=rows, tiled=True)`.

    **Arguments:**

    - `x`: the left operand's local block, `[..., rows, k]`.
    - `w`: the right operand's local block, `[k, cols]`.
    - `axis_name`: the mesh axis (or tuple of axes, in logical order) to sum and scatter over.
    - `bidirectional`: send half blocks both ways round the ring.

    **Returns:**

    This device's block of the summed product, `[..., rows / n, cols]`.

    **Raises:**

    `SpecError` when the contracting dimensions differ, or the rows are not divisible by
    `n` (by `2n` for `bidirectional`).
    """
    axes = axis_tuple(axis_name)
    n = combined_axis_size(axes)
    _check_operands("matmul_reduce_scatter", x, w, axis_name, n)
    if x.shape[-1] != w.shape[0]:
        raise SpecError(
            f"{_describe('matmul_reduce_scatter', x, w, axis_name, n)}: x's last dimension "
            f"({x.shape[-1]}) and w's first ({w.shape[0]}) must be equal"
        )
    parts = 2 * n if bidirectional else n
    if x.shape[-2] % parts:
        raise SpecError(
            f"{_describe('matmul_reduce_scatter', x, w, axis_name, n)}: the scattered dimension "
            f"(x's rows, {x.shape[-2]}) must be divisible by "
            + (f"2n = {parts} (bidirectional splits each block in halves)" if bidirectional else f"n = {n}")
        )
    i = jax.lax.axis_index(axes)
    m = x.shape[-2] // n
    if not bidirectional:
        # At step s device i adds its partial for row block i - 1 - s; the running sum
        # moves up, so the sum for block t ends on device t after n - 1 steps.
        # f32[..., M/n, K/n] @ f32[K/n, N] -> f32[..., M/n, N]
        acc = _rows(x, ring_index(i, -1, n) * m, m) @ w
        for step in range(1, n):
            acc = ring_shift(acc, axes, 1) + _rows(x, ring_index(i, -1 - step, n) * m, m) @ w
        return acc
    half = m // 2
    # First halves of the row blocks: sums move up; second halves: sums move down.
    # f32[..., M/2n, K/n] @ f32[K/n, N] -> f32[..., M/2n, N]
    up = _rows(x, ring_index(i, -1, n) * m, half) @ w
    down = _rows(x, ring_index(i, 1, n) * m + half, half) @ w
    for step in range(1, n):
        up = ring_shift(up, axes, 1) + _rows(x, ring_index(i, -1 - step, n) * m, half) @ w
        down = ring_shift(down, axes, -1) + _rows(x, ring_index(i, 1 + step, n) * m + half, half) @ w
    return jnp.concatenate([up, down], axis=-2)
