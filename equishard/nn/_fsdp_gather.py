"""The all-gathers of FSDP-split parameters: `fsdp_gather_params` (equishard's, under the
global-loss convention) and `gather_params` (xLSTM-JAX's, with mean gradients under the
local-loss convention).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._axes import (
    AxisName,
    entry_axes,
    is_bound,
)
from .._errors import LayerConfigError
from ..core import gather_array, gather_array_with_mean_grads
from ..sharding import (
    AutoSharded,
    Sharded,
    is_array_like,
    is_sharded,
)


def _check_dtype(name: str, dtype: Any) -> None:
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise LayerConfigError(f"{name} must be a floating dtype or None, got {dtype!r}.")


class GathersFSDP:
    """A module that all-gathers FSDP shards in dtypes of its own: fields `gather_dtype`
    and `grad_scatter_dtype` (static; `None`: each array's dtype), which a precision
    policy fills through `with_fsdp_dtypes` where they are `None`. `FSDP` units and
    the reference GPT (for its embedding, final norm and head) are such modules."""


def with_fsdp_dtypes(tree: PyTree, gather_dtype: Any = None, grad_scatter_dtype: Any = None) -> PyTree:
    """`tree` with every FSDP gather's unset dtypes set: a mixed-precision policy.

    As torch FSDP2's `MixedPrecisionPolicy(param_dtype, reduce_dtype)`: every module of
    `tree` that gathers FSDP shards (`FSDP` units, the reference GPT: `GathersFSDP`) and
    whose own `gather_dtype` or `grad_scatter_dtype` is `None` is given these — the
    float32 shards cast to `gather_dtype` before the all-gather (half the bytes in
    bfloat16), their gradients reduce-scattered in `grad_scatter_dtype` and kept in the
    shards' dtype. A unit's own dtypes take precedence. The train step's
    `MixedPrecision` policy applies it (see the training guide's "Mixed precision").

    **Arguments:**

    - `tree`: a model (or any pytree holding modules).
    - `gather_dtype`: the dtype to gather in; `None` leaves the modules' own.
    - `grad_scatter_dtype`: the dtype of the gradients' reduce-scatter; `None` leaves
      the modules' own.

    **Returns:**

    `tree`, its gathering modules' fields filled (nothing else changes).
    """
    _check_dtype("gather_dtype", gather_dtype)
    _check_dtype("grad_scatter_dtype", grad_scatter_dtype)

    def fill(node: Any) -> Any:
        if not isinstance(node, GathersFSDP):
            return node
        # The modules inside first (a unit inside a unit), then this one's own fields:
        # `node` was rebuilt by the map, so setting its static fields changes no other.
        node = jax.tree.map(fill, node, is_leaf=lambda x: x is not node and isinstance(x, GathersFSDP))
        if node.gather_dtype is None and gather_dtype is not None:
            object.__setattr__(node, "gather_dtype", gather_dtype)
        if node.grad_scatter_dtype is None and grad_scatter_dtype is not None:
            object.__setattr__(node, "grad_scatter_dtype", grad_scatter_dtype)
        return node

    return jax.tree.map(fill, tree, is_leaf=lambda x: isinstance(x, GathersFSDP))


def _split_entry(spec: P, axes: tuple[str, ...]) -> tuple[int, Any] | None:
    """The dimension whose spec entry ends with `axes`, and the entry left after them."""
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        if len(names) >= len(axes) and tuple(names[len(names) - len(axes):]) == axes:
            rest = tuple(names[: len(names) - len(axes)])
            return dim, (None if not rest else rest[0] if len(rest) == 1 else rest)
    return None


def fsdp_gather_params(
    params: PyTree,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
    *,
    mean_grads: bool = False,
    skip_units: bool = False,
) -> PyTree:
    """All-gather every array of `params` that is split over `axis_name` (inside `shard_map`).

    equishard's gather of FSDP parameters (the one `FSDP` uses): the backward pass
    reduce-scatters each gathered array's gradient (in `grad_scatter_dtype`) instead of
    all-reducing it, and by default *sums* it — the gradient of the global loss under
    equishard's convention. `gather_params` is xLSTM-JAX's function (mean gradients,
    local-loss convention).

    **Arguments:**

    - `params`: the local blocks of a module or parameter tree, with their boxes.
    - `axis_name`: the FSDP axis, or a tuple of axes. An array is gathered when its spec
      entry for some dimension ends with these axes (`"fsdp"` in `P(("tp", "fsdp"))`:
      the minor axes, whose blocks are contiguous); that entry keeps the others.
    - `gather_dtype`: the dtype to gather in (e.g. `jnp.bfloat16` for mixed precision);
      `None`: each array's dtype.
    - `grad_scatter_dtype`: the dtype of the gradient reduce-scatter; `None`: the
      gathered dtype.
    - `mean_grads`: `False` (default) for equishard's convention (the function
      differentiated returns the global loss; gradients are summed). `True` for the
      local-loss convention: `gather_array_with_mean_grads`, gradients averaged (with
      the varying-axes check on or off, as the reference).
    - `skip_units`: leave the `FSDP` units nested in `params` as they are (each gathers
      its own parameters when it is called): what a unit wrapped around other units
      gathers.

    Outside `shard_map` (the axis not bound) the arrays are already whole and are only
    unwrapped, so an `FSDP` module also runs in the global view.

    **Returns:**

    `params` with the split arrays whole along `axis_name`: boxes equishard added
    (`AutoSharded`) become plain arrays again, a user's boxes keep their spec minus
    `axis_name`.
    """
    _check_dtype("gather_dtype", gather_dtype)
    _check_dtype("grad_scatter_dtype", grad_scatter_dtype)
    gather = gather_array_with_mean_grads if mean_grads else gather_array

    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    # Outside shard_map (the global view) the arrays are already whole.
    bound = all(is_bound(a) for a in axes)

    def whole(leaf: Any) -> Any:
        if not is_sharded(leaf) or not is_array_like(leaf.value):
            return leaf
        found = _split_entry(leaf.spec, axes)
        value = leaf.value
        spec = leaf.spec
        if found is not None and bound:
            dim, rest = found
            # f32[.., K/fsdp, ..] -> f32[.., K, ..]
            value = gather(value, dim, axes, gather_dtype, grad_scatter_dtype)
            spec = P(*(rest if d == dim else e for d, e in enumerate(spec)))
        if isinstance(leaf, AutoSharded):
            return value
        return Sharded(value, spec, leaf.global_shape)

    def nested_unit(x: Any) -> bool:
        return skip_units and x is not params and is_unit(x)

    return jax.tree.map(
        lambda x: x if nested_unit(x) else whole(x), params, is_leaf=lambda x: is_sharded(x) or nested_unit(x)
    )


def is_unit(x: Any) -> bool:
    """Whether `x` is an `FSDP` unit (a module marked `__fsdp_unit__`)."""
    return bool(getattr(type(x), "__fsdp_unit__", False))


def gather_params(
    params: PyTree,
    axis_name: AxisName,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
) -> PyTree:
    """xLSTM-JAX's `gather_params`: all-gather the split arrays, gradients *averaged*.

    As `xlstm_jax.distributed.data_parallel.gather_params`: every array whose spec
    names `axis_name` is all-gathered with `gather_array_with_mean_grads`, so its
    gradient is reduce-scattered and divided by the axis size — the local-loss
    convention (each device differentiates its own loss, then `sync_gradients`), with
    the varying-axes check on or off as the reference. Under equishard's global-loss
    convention use `fsdp_gather_params` (the mean would be `n` times too small).

    **Arguments:**

    - `params`: the local blocks, with their boxes (from `shard_params`).
    - `axis_name`: the axis to gather over.
    - `gather_dtype`: the dtype to gather in; `None` keeps each array's dtype.
    - `grad_scatter_dtype`: the dtype of the gradient reduce-scatter; `None` uses each
      parameter's dtype.

    **Returns:**

    `params` with the split arrays whole along `axis_name` (boxes `shard_params` added
    become plain arrays again).

    **Raises:**

    `ConventionError` if, with the varying-axes check on, an array to gather is typed
    invariant along `axis_name` (see `gather_array_with_mean_grads`).
    """
    return fsdp_gather_params(params, axis_name, gather_dtype, grad_scatter_dtype, mean_grads=True)
