"""FSDP spec rules: which arrays get split over a data axis, and along which dimension.

`shard_params` is xLSTM-JAX's function of the same name, with its rules;
`fsdp_split_params` is equishard's own rule (the one `FSDP` uses). Both work on any
pytree (an unmodified Equinox module too) in both views:

- outside `shard_map` (global arrays) it only changes specs — the arrays are placed by
  `shard` or born sharded under `sharded_init`;
- inside `shard_map` (local blocks, the reference's way of initialising inside the mapped
  function) it also keeps just this device's slice of each newly split array.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import bound_axis_size, bound_sizes, global_shape
from .._errors import LayerConfigError, SpecError
from ._box import Sharded, is_sharded
from ._specs import describe_mesh, is_array_like, path_str, spec_axes

logger = logging.getLogger("equishard")

DEFAULT_MIN_WEIGHT_SIZE = 2**10
"""The default `min_weight_size` of `fsdp_split_params`, `FSDP`, `fsdp_wrap` and
`Layout`: arrays of fewer elements (norm scales, biases) stay replicated. Small, so that
FSDP splits a small model too; xLSTM-JAX's `shard_params` keeps its own 2**18."""


class AutoSharded(Sharded):
    """A `Sharded` box that equishard put around an array that had none.

    `shard_params` boxes the plain arrays it splits in this subclass, so that
    `gather_params` can hand the wrapped module back exactly as it was written: plain
    arrays where it had plain arrays, boxes where it had boxes.
    """


def axis_size_and_bound(axis_name: str, mesh: Mesh | AbstractMesh | None, fn_name: str) -> tuple[int, bool]:
    """`(size, inside_shard_map)` for `axis_name`."""
    bound = bound_axis_size(axis_name)
    if bound is not None:
        return bound, True
    if mesh is None:
        ambient = jax.sharding.get_abstract_mesh()
        mesh = None if ambient.empty else ambient
    if mesh is None:
        raise SpecError(
            f"{fn_name}(axis_name={axis_name!r}) outside shard_map needs the mesh: pass "
            f"mesh=..., or call it inside the shard_map where {axis_name!r} is bound."
        )
    if axis_name not in mesh.shape:
        raise SpecError(
            f"{fn_name}: axis_name {axis_name!r} is not an axis of "
            f"{describe_mesh(mesh)} (its axes are {tuple(mesh.shape)})."
        )
    return int(mesh.shape[axis_name]), False


def _global_shape(shape: tuple[int, ...], spec: P, local: bool) -> tuple[int, ...]:
    sizes = bound_sizes(spec) if local else None
    return shape if sizes is None else global_shape(shape, spec, sizes)


def fsdp_dimension(shape: tuple[int, ...], spec: P, size: int) -> int | None:
    """The dimension equishard's FSDP splits: the largest one not already split and divisible by `size`.

    Ties go to the earlier dimension. `None` if no dimension qualifies.
    """
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if not free:
        return None
    return max(free, key=lambda d: (shape[d], -d))


def reference_dimension(shape: tuple[int, ...], spec: P, size: int) -> int | None:
    """The dimension xLSTM-JAX's `shard_params` splits: the largest free one divisible by `size`.

    Ties go to the *later* dimension (the reference walks `np.argsort(shape)[::-1]`).
    `None` if no dimension qualifies.
    """
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if not free:
        return None
    return max(free, key=lambda d: (shape[d], d))


def _check_min_weight_size(fn_name: str, min_weight_size: Any) -> None:
    if not isinstance(min_weight_size, int) or min_weight_size < 0:
        raise LayerConfigError(
            f"{fn_name}: min_weight_size must be a non-negative int, got {min_weight_size!r}."
        )


def _split_tree(params: PyTree, axis_name: str, min_weight_size: int, mesh: Any, reference: bool) -> PyTree:
    """Add `axis_name` to the spec of every qualifying array (slicing it inside `shard_map`).

    `reference=False`: equishard's rule (global size `< min_weight_size` stays, ties to the
    earlier dimension). `reference=True`: xLSTM-JAX's rule (the size of the array in
    hand — the local block inside `shard_map` — `<= min_weight_size` stays, ties to the
    later dimension, divisibility of the array in hand).
    """
    fn_name = "shard_params" if reference else "fsdp_split_params"
    _check_min_weight_size(fn_name, min_weight_size)
    size, local = axis_size_and_bound(axis_name, mesh, fn_name)

    def split(path: Any, leaf: Any) -> Any:
        boxed = is_sharded(leaf)
        value = leaf.value if boxed else leaf
        if not is_array_like(value):
            return leaf
        spec = leaf.spec if boxed else P(*((None,) * value.ndim))
        if axis_name in spec_axes(spec):
            return leaf
        shape = _global_shape(tuple(value.shape), spec, local)
        # The shape the rule reads: the global one (equishard), the one in hand (xLSTM-JAX).
        ruled = tuple(value.shape) if reference else shape
        name = path_str(path)
        elements = math.prod(ruled)
        if (elements <= min_weight_size) if reference else (elements < min_weight_size):
            logger.info(
                "%s: `%s` %s (%d elements) stays unsplit over %r: %s min_weight_size=%d.",
                fn_name, name, ruled, elements, axis_name, "not above" if reference else "below",
                min_weight_size,
            )
            return leaf
        dim = (reference_dimension if reference else fsdp_dimension)(ruled, spec, size)
        if dim is None:
            logger.info(
                "%s: `%s` %s with spec %s stays unsplit over %r: no free "
                "dimension is divisible by %d.", fn_name, name, ruled, spec, axis_name, size,
            )
            return leaf
        new_spec = P(*(axis_name if d == dim else e for d, e in enumerate(spec)))
        if local:
            block = value.shape[dim] // size
            start = jax.lax.axis_index(axis_name) * block
            value = jax.lax.dynamic_slice_in_dim(value, start, block, axis=dim)
        return (type(leaf) if boxed else AutoSharded)(value, new_spec, shape)

    return jax.tree_util.tree_map_with_path(split, params, is_leaf=is_sharded)


def fsdp_split_params(
    params: PyTree,
    axis_name: str,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    *,
    mesh: Mesh | AbstractMesh | None = None,
) -> PyTree:
    """Split every large enough array of `params` over `axis_name`: equishard's FSDP rule.

    For each array of at least `min_weight_size` elements (its *global* size, on any
    mesh the same decision), `axis_name` is added to its spec on the largest dimension
    that is divisible by the axis size and not already split (ties: the earlier
    dimension) — a tensor-parallel dimension stays as it is, so FSDP composes with TP.
    Arrays that are too small, or divisible on no free dimension, stay as they are and
    are reported through `logging` (logger `"equishard"`, level INFO). `FSDP`, `Layout`
    and the reference GPT split by this rule; `shard_params` is xLSTM-JAX's rule.

    **Arguments:**

    - `params`: any pytree: a model (an unmodified Equinox module too), parameters.
    - `axis_name`: the mesh axis to split over (e.g. `"fsdp"`).
    - `min_weight_size`: arrays with fewer elements (global) stay unsplit.
    - `mesh`: outside `shard_map`, the mesh (for the axis size; default: the mesh set
      by `jax.set_mesh`, if any). Inside `shard_map` the bound axis is used.

    **Returns:**

    `params` with the split arrays in boxes whose specs name `axis_name` (plain arrays
    that were split are boxed in `AutoSharded`). Inside `shard_map`, those arrays are
    this device's slices.

    **Raises:**

    `LayerConfigError` if `min_weight_size < 0`; `SpecError` if `axis_name` is not on
    the mesh.
    """
    return _split_tree(params, axis_name, min_weight_size, mesh, reference=False)


def shard_params(
    params: PyTree,
    axis_name: str,
    min_weight_size: int = 2**18,
    *,
    mesh: Mesh | AbstractMesh | None = None,
) -> PyTree:
    """Split every large enough array of `params` over `axis_name`, by xLSTM-JAX's rule.

    As `xlstm_jax.distributed.data_parallel.shard_params`: an array whose size is at
    most `min_weight_size` stays unsplit (inside `shard_map` the size of the local block
    in hand, as the reference reads it); otherwise `axis_name` goes on the largest
    dimension of that array divisible by the axis size and not already split, ties to
    the *later* dimension. An array already split over `axis_name` is left alone.
    Arrays left unsplit are reported through `logging` (logger `"equishard"`, INFO).
    (equishard's own FSDP rule, global sizes and ties to the earlier dimension, is
    `fsdp_split_params`.)

    Works in both views: inside `shard_map` it keeps this device's slice of each newly
    split array (the reference's way); outside it only changes specs (the arrays are
    placed by `shard` or born sharded under `sharded_init`).

    **Arguments:**

    - `params`: any pytree: a model (an unmodified Equinox module too), parameters.
    - `axis_name`: the mesh axis to split over (e.g. `"fsdp"`).
    - `min_weight_size`: arrays of at most this many elements stay unsplit.
    - `mesh`: outside `shard_map`, the mesh (for the axis size; default: the mesh set
      by `jax.set_mesh`, if any). Inside `shard_map` the bound axis is used.

    **Returns:**

    `params` with the split arrays in boxes whose specs name `axis_name` (plain arrays
    that were split are boxed in `AutoSharded`).

    **Raises:**

    `LayerConfigError` if `min_weight_size < 0`; `SpecError` if `axis_name` is not on
    the mesh.
    """
    return _split_tree(params, axis_name, min_weight_size, mesh, reference=True)
