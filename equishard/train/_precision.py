"""The precision policy of the train step: one value that decides every cast.

A policy is one of the step's parts (`make_train_step(..., precision=...)`), held by the
`TrainStep` as a field, bound to the step's data axes (`bind`). The step differentiates
`loss(policy.compute(model))` with respect to `model` and hands `policy.gradients(grads)` on; the gradients of
parameters replicated over the data axes are summed in `policy.reduce_dtype`. FSDP's
gathers learn their dtypes from the policy through their own fields
(`equishard.nn.with_fsdp_dtypes`, applied in `compute`): nothing module-level steers a
computation.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._errors import LayerConfigError
from ..nn import with_fsdp_dtypes
from ..sharding import is_sharded
from ..sharding._internal import spec_axes


class Precision(eqx.Module):
    """Full precision (the default policy): every array in its own dtype.

    The base of the step's precision policies (see the training guide's "Mixed
    precision"): `compute` is the model the loss function sees (inside the
    differentiated function), `gradients` the gradients the step goes on with, and
    `reduce_dtype` the dtype the data axes' gradient sums run in (`None`: where autodiff
    sums them, in their dtype there).
    """

    @property
    def reduce_dtype(self) -> Any:
        """The dtype the gradients are summed over the data axes in (`None`: their own)."""
        return None

    @property
    def compute_dtype(self) -> Any:
        """The dtype the loss function computes in (`None`: the parameters')."""
        return None

    def bind(self, data_axes: tuple[str, ...]) -> "Precision":
        """This policy for a step whose loss runs inside `shard_map` over `data_axes`
        (`()` in the global view): arrays split over them are FSDP shards, which their
        gathers cast."""
        return self

    def compute(self, model: PyTree) -> PyTree:
        """The model the loss function sees (inside the differentiated function)."""
        return model

    def batch(self, batch: PyTree) -> PyTree:
        """The batch the loss function sees."""
        return batch

    def gradients(self, grads: PyTree) -> PyTree:
        """The gradients the step goes on with."""
        return grads


FULL_PRECISION = Precision()
"""The default policy: no cast."""


def _floating(name: str, dtype: Any) -> Any:
    """`dtype` as a floating `jnp.dtype` (or `None`), refused by name otherwise."""
    try:
        ok = dtype is not None and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if dtype is not None and not ok:
        raise LayerConfigError(
            f"MixedPrecision: {name} must be a floating dtype (e.g. jnp.bfloat16) or None, "
            f"got {dtype!r}."
        )
    return None if dtype is None else jnp.dtype(dtype)


def _refuse_unscaled(dtype: Any) -> None:
    """Refuse compute dtypes that need scaling the step does not do: float16 (no loss
    scaling: its gradients underflow and its activations overflow, so steps would be
    skipped silently) and the 8-bit floats (no per-tensor scales; they are storage
    formats for an fp8 policy, not a dtype to compute a whole loss in)."""
    if dtype is None:
        return
    name = jnp.dtype(dtype).name
    if name == "float16":
        raise LayerConfigError(
            "MixedPrecision: compute_dtype=float16 is not supported: the step does no loss "
            "scaling, without which float16 gradients underflow and its activations overflow "
            "(every step would be skipped as non-finite). Use MixedPrecision(jnp.bfloat16) "
            "(float32's range, no scaling needed)."
        )
    if jnp.finfo(dtype).bits < 16:
        raise LayerConfigError(
            f"MixedPrecision: compute_dtype={name} is an 8-bit (or smaller) float: a loss "
            f"cannot be computed in it without per-tensor scales, which the step does not "
            f"keep. Use MixedPrecision(jnp.bfloat16); fp8 matmuls belong to an fp8 precision "
            f"policy (scaled per tensor), not to the compute dtype."
        )


class MixedPrecision(Precision):
    """Float32 master weights and optimizer state; the loss computed in `compute_dtype`.

    Inside the differentiated function every floating array of the model is cast to
    `compute_dtype`, so the gradients arrive in the parameters' own dtype (the cast's
    transpose). Arrays split over a data axis (FSDP's shards, in the local view) are
    left to their gathers, which cast them to `gather_dtype` before the all-gather and
    reduce-scatter their gradients in `reduce_dtype` (each FSDP unit's own dtypes, where
    it sets none: `equishard.nn.with_fsdp_dtypes`); the gradients of replicated
    parameters are all-reduced in `reduce_dtype` too. Float32 stays where numerics need
    it: the layers compute norm statistics, the softmax and the loss in float32.

    **Arguments:**

    - `compute_dtype`: the dtype the loss function computes in (e.g. `jnp.bfloat16`).
    - `gather_dtype`: the dtype FSDP gathers in (`None`: `compute_dtype`).
    - `reduce_dtype`: the dtype gradients are reduced in (`None`: float32, as torch
      FSDP2's `reduce_dtype` default under mixed precision).
    - `cast_batch`: cast the batch's floating arrays (images, float features, a time
      embedding's input) to `compute_dtype` too, as the model's layers expect inputs of
      their own dtype (default); `False`: the loss function gets the batch as it is and
      casts what it wants itself. Integer arrays (token ids, labels, masks) are never cast.
    - `data_axes`: set by the train step (`bind`): the axes FSDP shards are split over.

    **Raises:**

    `LayerConfigError` for a dtype that is not floating.
    """

    dtypes: tuple[Any, Any, Any] = eqx.field(static=True)
    cast_batch: bool = eqx.field(static=True)
    data_axes: tuple[str, ...] = eqx.field(static=True)

    def __init__(
        self, compute_dtype: Any, gather_dtype: Any = None, reduce_dtype: Any = None, *,
        cast_batch: bool = True, data_axes: tuple[str, ...] = (),
    ):
        compute = _floating("compute_dtype", compute_dtype)
        if compute is None:
            raise LayerConfigError(
                "MixedPrecision: compute_dtype must be a floating dtype (e.g. jnp.bfloat16); "
                "for no cast use the default policy, equishard.train.FULL_PRECISION."
            )
        _refuse_unscaled(compute)
        gather = _floating("gather_dtype", gather_dtype)
        reduce = _floating("reduce_dtype", reduce_dtype)
        reduce = jnp.dtype(jnp.float32) if reduce is None else reduce
        self.dtypes = (compute, compute if gather is None else gather, reduce)
        self.cast_batch = cast_batch
        self.data_axes = tuple(data_axes)

    def bind(self, data_axes: tuple[str, ...]) -> "MixedPrecision":
        return MixedPrecision(*self.dtypes, cast_batch=self.cast_batch, data_axes=data_axes)

    def batch(self, batch: PyTree) -> PyTree:
        """The batch with its floating arrays in `compute_dtype` (with `cast_batch`;
        integer arrays, token ids and masks, as they are)."""
        if not self.cast_batch:
            return batch
        return jax.tree.map(lambda x: x.astype(self.compute_dtype) if eqx.is_inexact_array(x) else x, batch)

    @property
    def compute_dtype(self) -> Any:
        return self.dtypes[0]

    @property
    def gather_dtype(self) -> Any:
        """The dtype FSDP gathers in."""
        return self.dtypes[1]

    @property
    def reduce_dtype(self) -> Any:
        return self.dtypes[2]

    def _cast(self, leaf: Any) -> Any:
        if is_sharded(leaf):
            if set(spec_axes(leaf.spec)) & set(self.data_axes):
                return leaf  # an FSDP shard: its gather casts it
            return leaf.with_value(self._cast(leaf.value))
        return leaf.astype(self.compute_dtype) if eqx.is_inexact_array(leaf) else leaf

    def compute(self, model: PyTree) -> PyTree:
        """`model` with its floating arrays in `compute_dtype` (FSDP shards as they are,
        their gathers told `gather_dtype` and `reduce_dtype`)."""
        model = with_fsdp_dtypes(model, self.gather_dtype, self.reduce_dtype)
        return jax.tree.map(self._cast, model, is_leaf=is_sharded)


def check_precision(precision: Any, what: str) -> Precision:
    """`precision` if it is a policy (`None`: `FULL_PRECISION`), refused by name otherwise."""
    if precision is None:
        return FULL_PRECISION
    if not isinstance(precision, Precision):
        raise LayerConfigError(
            f"{what}: precision must be a policy, equishard.train.MixedPrecision(compute_dtype) "
            f"or FULL_PRECISION (the default), got {precision!r}."
        )
    return precision
