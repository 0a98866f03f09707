"""`ModelParallelismWrapper`: one independently initialised copy of a module per device."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from .._errors import LayerConfigError
from ..sharding import Sharded, is_sharded
from ._init import axis_size as bound_axis_size, check_positive, value_of
from ._linear import is_bound


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
    inner_boxed: tuple[bool, ...] = eqx.field(static=True)

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
        elif is_bound(model_axis_name):
            count = bound_axis_size(model_axis_name)
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
        leaves, treedef = jax.tree.flatten(stacked, is_leaf=is_sharded)
        inner = tuple(is_sharded(x) for x in leaves)
        # Global shapes: the copies' axis in front of each copy's global shape (inside
        # shard_map the values are this device's [1, ...] blocks).
        boxed = [
            Sharded(x.value, P(model_axis_name, *x.spec), shape=(count, *x.shape))
            if is_sharded(x)
            else Sharded(x, P(model_axis_name), shape=(count, *x.shape[1:]))
            if eqx.is_array(x)
            else x
            for x in leaves
        ]
        self.module = jax.tree.unflatten(treedef, boxed)
        self.inner_boxed = inner
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
        leaves, treedef = jax.tree.flatten(self.module, is_leaf=is_sharded)
        out = []
        for leaf, was_boxed in zip(leaves, self.inner_boxed, strict=True):
            if not is_sharded(leaf):
                out.append(leaf)
                continue
            value = value_of(leaf)
            if value.shape[0] != 1:
                raise LayerConfigError(
                    f"{name}: this device holds {value.shape[0]} copies of the module (the "
                    f"wrapper was built for a model axis {value.shape[0]} times the size "
                    f"{bound_axis_size(self.model_axis_name)} of {self.model_axis_name!r})."
                )
            out.append(Sharded(value[0], P(*leaf.spec[1:]), shape=leaf.shape[1:]) if was_boxed else value[0])
        return jax.tree.unflatten(treedef, out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call this device's copy of the module on `*args, **kwargs`."""
        return self.local_module()(*args, **kwargs)

