"""`ModelParallelismWrapper`: one independently initialised copy of a module per device."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from .._axes import bound_axis_size, is_bound
from .._errors import LayerConfigError
from ..sharding import add_leading_axis, drop_leading_axis, is_sharded, plain_arrays
from ._initializers import check_positive, value_of


def _fold_keys(key: PRNGKeyArray, index: Any, split_rngs: bool) -> PRNGKeyArray:
    return jax.random.fold_in(key, index) if split_rngs else key


def _mask(tree: PyTree, keep: Any) -> PyTree:
    """Zero the floating arrays of `tree` where `keep` (broadcast from the leading axis) is False."""

    def one(x: Any) -> Any:
        if not eqx.is_inexact_array(x):
            return x
        k = jnp.reshape(keep, keep.shape + (1,) * (x.ndim - keep.ndim))
        return jnp.where(k, x, jnp.zeros((), x.dtype))

    return jax.tree.map(one, tree)


class ModelParallelismWrapper(eqx.Module):
    """Give each device of the model axis its own copy of a module (the xLSTM library's wrapper).

    The copies are initialised independently (the key folded with the device's index
    along the axis when `split_rngs`) and stacked along a new leading axis that is split
    over `model_axis_name`: inside `shard_map` each device calls its own copy on its
    input. Being per-device by design, the wrapper is exempt from mesh invariance; its
    single-device reference is the same modules built with `eqx.filter_vmap` over the
    folded keys.

    It can be built in two ways with the same result: outside `shard_map` with
    `axis_size` (all copies at once, e.g. under `equishard.sharded_init`), or inside a
    `shard_map` over `model_axis_name` (each device builds its own copy, as the xLSTM
    library does at `init`) and returned with the spec it carries.

    Fields: `module`, the stacked copies, every array in a `Sharded` box whose spec
    starts with `model_axis_name` (boxes the wrapped module had keep their spec after it).
    """

    module: PyTree
    model_axis_name: str = eqx.field(static=True)
    mask_except_model_idx: int | None = eqx.field(static=True)
    split_rngs: bool = eqx.field(static=True)
    was_plain: tuple[bool, ...] = eqx.field(static=True, repr=False)

    def __init__(
        self,
        model_axis_name: str | Callable[..., PyTree],
        module_fn: Callable[..., PyTree] | str,
        mask_except_model_idx: int | None = None,
        split_rngs: bool = True,
        module_kwargs: Mapping[str, Any] | None = None,
        *,
        axis_size: int | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `model_axis_name`: the mesh axis the copies are split over.
        - `module_fn`: builds one copy: `module_fn(key=key, **module_kwargs)`.

        The order is the xLSTM library's (`model_axis_name` first). The order of earlier
        equishard releases, `(module_fn, model_axis_name, ...)`, is recognised (a
        callable first, a string second) and still accepted.
        - `mask_except_model_idx`: if given, every copy but this one starts with its
          floating-point parameters at zero (e.g. a bias that the sum over the axis
          should count once).
        - `split_rngs`: fold the device index into the key, so the copies differ;
          otherwise all copies are the same.
        - `module_kwargs`: further keyword arguments for `module_fn`.
        - `axis_size`: the size of the model axis, to build all copies outside
          `shard_map`; leave it out inside a `shard_map` over `model_axis_name`.
        - `key`: a PRNG key.
        """
        name = "ModelParallelismWrapper"
        if callable(model_axis_name) and isinstance(module_fn, str):
            model_axis_name, module_fn = module_fn, model_axis_name  # the earlier order
        if not isinstance(model_axis_name, str) or not callable(module_fn):
            raise LayerConfigError(
                f"{name}(model_axis_name, module_fn, ...): expected a mesh axis name and a "
                f"callable, got {model_axis_name!r} and {module_fn!r}."
            )
        kwargs = dict(module_kwargs or {})
        if axis_size is not None:
            check_positive(name, "axis_size", axis_size)
            count = axis_size
            indices = jnp.arange(axis_size)
            keys = jax.vmap(lambda i: _fold_keys(key, i, split_rngs))(indices)
            stacked = eqx.filter_vmap(lambda k: module_fn(key=k, **kwargs))(keys)
        elif (bound := bound_axis_size(model_axis_name)) is not None:
            count = bound
            indices = jax.lax.axis_index(model_axis_name)[None]
            module = module_fn(key=_fold_keys(key, indices[0], split_rngs), **kwargs)
            stacked = jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x, module)
        else:
            raise LayerConfigError(
                f"{name}: outside a shard_map over {model_axis_name!r} the number of copies "
                "is unknown; pass axis_size=<size of the model axis>."
            )
        if mask_except_model_idx is not None:
            if not -count <= mask_except_model_idx < count:
                raise LayerConfigError(
                    f"{name}: mask_except_model_idx={mask_except_model_idx} is out of range "
                    f"for {count} copies."
                )
            mask_except_model_idx %= count
            stacked = _mask(stacked, indices == mask_except_model_idx)
        # Global shapes: the copies' axis in front of each copy's global shape (inside
        # shard_map the values are this device's [1, ...] blocks).
        self.was_plain = plain_arrays(stacked)
        self.module = add_leading_axis(stacked, model_axis_name, size=count, box_arrays=True)
        self.model_axis_name = model_axis_name
        self.mask_except_model_idx = mask_except_model_idx
        self.split_rngs = split_rngs

    def local_module(self) -> PyTree:
        """This device's copy of the module (inside a `shard_map` over the model axis)."""
        name = "ModelParallelismWrapper"
        if not is_bound(self.model_axis_name):
            raise LayerConfigError(
                f"{name}: each device calls its own copy, so the wrapper runs inside a "
                f"shard_map over {self.model_axis_name!r}."
            )
        def mine(leaf: Any) -> Any:
            if not is_sharded(leaf):
                return leaf
            value = value_of(leaf)
            if value.shape[0] != 1:
                raise LayerConfigError(
                    f"{name}: this device holds {value.shape[0]} copies of the module (the "
                    f"wrapper was built for a model axis {value.shape[0]} times the size "
                    f"{bound_axis_size(self.model_axis_name)} of {self.model_axis_name!r})."
                )
            return leaf.with_value(value[0])

        local = jax.tree.map(mine, self.module, is_leaf=is_sharded)
        return drop_leading_axis(local, unbox=self.was_plain)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call this device's copy of the module on `*args, **kwargs`."""
        return self.local_module()(*args, **kwargs)

