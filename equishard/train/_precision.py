"""The precision hook of the train step, applied around the gradient computation."""

from __future__ import annotations

import contextlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._errors import LayerConfigError
from ..nn import fsdp_dtypes
from ..sharding import is_sharded
from ..sharding._internal import spec_axes


class Precision:
    """How the gradient computation sees the parameters, and how the gradients leave it.

    The step differentiates `loss(precision.compute(model))` with respect to `model`
    inside `precision.context()`, and hands `precision.gradients(grads)` on; the
    gradients of parameters replicated over the data axes are summed in
    `precision.reduce_dtype` once, after the last micro-step (`None`: where autodiff
    sums them, in their dtype there). This one is the identity: every array in its own
    dtype.
    """

    reduce_dtype: Any = None

    def compute(self, model: PyTree) -> PyTree:
        """The model the loss function sees (inside the differentiated function)."""
        return model

    def context(self) -> contextlib.AbstractContextManager:
        """The context the loss function is traced in."""
        return contextlib.nullcontext()

    def gradients(self, grads: PyTree) -> PyTree:
        """The gradients the step goes on with."""
        return grads


FULL_PRECISION = Precision()


class MixedPrecision(Precision):
    """Float32 master weights and optimizer state; the loss computed in `compute_dtype`.

    Inside the differentiated function every floating array of the model is cast to
    `compute_dtype`, so the gradients arrive in the parameters' own dtype (the cast's
    transpose). Arrays split over a data axis (FSDP's shards, in the local view) are
    left to their gathers, which cast them to `gather_dtype` before the all-gather and
    reduce-scatter their gradients in `reduce_dtype` (`fsdp_dtypes`); the gradients
    of replicated parameters are all-reduced in `reduce_dtype` too.

    **Arguments:**

    - `compute_dtype`: the dtype the loss function computes in (e.g. `jnp.bfloat16`).
    - `gather_dtype`: the dtype FSDP gathers in (`None`: `compute_dtype`).
    - `reduce_dtype`: the dtype gradients are reduced in (`None`: float32, as torch
      FSDP2's `reduce_dtype` default under mixed precision).
    - `data_axes`: the batch's mesh axes; `()` in the global view (every array cast).
    """

    def __init__(
        self, compute_dtype: Any, gather_dtype: Any = None, reduce_dtype: Any = None,
        data_axes: tuple[str, ...] = (),
    ):
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.gather_dtype = jnp.dtype(gather_dtype if gather_dtype is not None else compute_dtype)
        self.reduce_dtype = jnp.dtype(reduce_dtype if reduce_dtype is not None else jnp.float32)
        self.data_axes = data_axes

    def _cast(self, leaf: Any) -> Any:
        if is_sharded(leaf):
            if set(spec_axes(leaf.spec)) & set(self.data_axes):
                return leaf  # an FSDP shard: its gather casts it
            return leaf.with_value(self._cast(leaf.value))
        return leaf.astype(self.compute_dtype) if eqx.is_inexact_array(leaf) else leaf

    def compute(self, model: PyTree) -> PyTree:
        """`model` with its floating arrays in `compute_dtype` (FSDP shards as they are)."""
        return jax.tree.map(self._cast, model, is_leaf=is_sharded)

    def context(self) -> contextlib.AbstractContextManager:
        """FSDP's gathers in `gather_dtype`, their gradients reduced in `reduce_dtype`."""
        return fsdp_dtypes(self.gather_dtype, self.reduce_dtype)


def _floating(name: str, dtype: Any) -> Any:
    try:
        ok = dtype is not None and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if dtype is not None and not ok:
        raise LayerConfigError(
            f"make_train_step: {name} must be a floating dtype (e.g. jnp.bfloat16) or None, "
            f"got {dtype!r}."
        )
    return dtype


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
            "make_train_step: compute_dtype=float16 is not supported: the step does no loss "
            "scaling, without which float16 gradients underflow and its activations overflow "
            "(every step would be skipped as non-finite). Use compute_dtype=jnp.bfloat16 "
            "(float32's range, no scaling needed)."
        )
    if jnp.finfo(dtype).bits < 16:
        raise LayerConfigError(
            f"make_train_step: compute_dtype={name} is an 8-bit (or smaller) float: a loss "
            f"cannot be computed in it without per-tensor scales, which the step does not "
            f"keep. Use compute_dtype=jnp.bfloat16; fp8 matmuls belong to an fp8 precision "
            f"policy (scaled per tensor), not to the compute dtype."
        )


def precision_of(
    compute_dtype: Any, gather_dtype: Any, reduce_dtype: Any, data_axes: tuple[str, ...]
) -> Precision:
    """The step's precision from its options (validated), `FULL_PRECISION` if none is set.

    **Raises:**

    `LayerConfigError` for a dtype that is not floating, or `gather_dtype` /
    `reduce_dtype` without `compute_dtype`.
    """
    for name, dtype in (("compute_dtype", compute_dtype), ("gather_dtype", gather_dtype),
                        ("reduce_dtype", reduce_dtype)):  # fmt: skip
        _floating(name, dtype)
    _refuse_unscaled(compute_dtype)
    if compute_dtype is None:
        if gather_dtype is not None or reduce_dtype is not None:
            raise LayerConfigError(
                "make_train_step: gather_dtype and reduce_dtype are options of mixed "
                "precision: set compute_dtype too (e.g. compute_dtype=jnp.bfloat16), or "
                "give FSDP units their own gather_dtype / grad_scatter_dtype."
            )
        return FULL_PRECISION
    return MixedPrecision(compute_dtype, gather_dtype, reduce_dtype, data_axes)
