"""Batch normalisation whose statistics span the global batch, inside `shard_map`.

`eqx.nn.BatchNorm` takes its statistics with `lax.pmean` over its `vmap` axis name,
which cannot be bound inside a `shard_map` with the varying-axes check. `SyncBatchNorm`
is the same layer (same fields, same state, same paths) whose statistics are taken by
`equishard.core.example_mean` over the `vmap`s it names and over the data axes:
PyTorch's SyncBatchNorm. The train step puts it in place of every `eqx.nn.BatchNorm`
while it runs (`sync_batch_norms`); the model a run holds keeps Equinox's layer.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import cast_varying, varying_axes
from ..core import example_mean
from ._parallelize import rebuild


def _set(state: eqx.nn.State, index: eqx.nn.StateIndex, value: PyTree) -> eqx.nn.State:
    """`state.set(index, value)`, `value` typed as the old value (varying over the same
    mesh axes: Equinox refuses a new value of another type)."""
    old = state.get(index)
    return state.set(index, jax.tree.map(lambda v, o: cast_varying(v, varying_axes(o)), value, old))


class SyncBatchNorm(eqx.nn.BatchNorm):
    """`eqx.nn.BatchNorm` with its batch statistics also averaged over `data_axes`.

    Called as `eqx.nn.BatchNorm` is (one example, under `jax.vmap(...,
    axis_name=...)`), in either of its modes (`"batch"`, `"ema"`), with the same running
    statistics and the same update of them; the mean and variance of a channel are over
    the examples of the `vmap`s named `axis_name` and of every device along
    `data_axes` (inside `shard_map`; `()`: this device's examples only). `equishard.unbox`
    gives the `eqx.nn.BatchNorm` back.

    **Fields:** those of `eqx.nn.BatchNorm`, and `data_axes` (static).
    """

    data_axes: tuple[str, ...] = eqx.field(static=True)

    def _stats(self, x: Array) -> tuple[Array, Array]:
        # x: f32[C, *spatial] (one example) -> per-channel mean and variance, f32[C],
        # over the spatial positions and the examples.
        spatial = tuple(range(1, x.ndim))
        mean = example_mean(jnp.mean(x, axis=spatial), self.axis_name, self.data_axes)
        centred = x - mean.reshape((-1,) + (1,) * len(spatial))
        var = example_mean(jnp.mean(centred * jnp.conj(centred), axis=spatial), self.axis_name, self.data_axes)
        return mean, jnp.maximum(0.0, var)

    def _normalise(self, x: Array, mean: Array, var: Array) -> Array:
        shape = (-1,) + (1,) * (x.ndim - 1)  # per channel, broadcast over the positions
        out = (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + self.eps)
        if self.channelwise_affine:
            assert self.weight is not None and self.bias is not None
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out

    def _ema(self, x: Array, state: eqx.nn.State, inference: bool) -> tuple[Array, Array, eqx.nn.State]:
        assert self.ema_first_time_index is not None and self.ema_state_index is not None
        if inference:
            mean, var = state.get(self.ema_state_index)
            return mean, var, state
        first_time = state.get(self.ema_first_time_index)
        state = _set(state, self.ema_first_time_index, jnp.zeros_like(first_time))
        batch_mean, batch_var = self._stats(x)
        running_mean, running_var = state.get(self.ema_state_index)
        m = self.momentum
        mean = jnp.where(first_time, batch_mean, (1 - m) * batch_mean + m * running_mean)
        var = jnp.where(first_time, batch_var, (1 - m) * batch_var + m * running_var)
        return mean, var, _set(state, self.ema_state_index, (mean, var))

    def _batch(self, x: Array, state: eqx.nn.State, inference: bool) -> tuple[Array, Array, eqx.nn.State]:
        assert self.batch_state_index is not None and self.batch_counter is not None
        counter = state.get(self.batch_counter)
        hidden_mean, hidden_var = state.get(self.batch_state_index)
        if inference:  # as Equinox: the running statistics, debiased
            scale = jnp.where(counter == 0, 1, 1 - self.momentum**counter)
            return hidden_mean / scale, hidden_var / scale, state
        mean, var = self._stats(x)
        m = self.momentum
        state = _set(state, self.batch_counter, counter + 1)
        state = _set(state, self.batch_state_index, (hidden_mean * m + mean * (1 - m), hidden_var * m + var * (1 - m)))
        return mean, var, state

    def __call__(
        self, x: Array, state: eqx.nn.State, *, key: PRNGKeyArray | None = None, inference: bool | None = None
    ) -> tuple[Array, eqx.nn.State]:
        """As `eqx.nn.BatchNorm.__call__`: `x: f32[C, *spatial]` normalised, and the state."""
        del key
        if inference is None:
            inference = self.inference
        step = self._ema if self.mode == "ema" else self._batch
        mean, var, state = step(x, state, inference)
        return self._normalise(x, mean, var), state

    def __unbox__(self) -> eqx.nn.BatchNorm:
        """The `eqx.nn.BatchNorm` it was made from, for `equishard.unbox`."""
        return rebuild(eqx.nn.BatchNorm, self)


def _is_batch_norm(x: Any) -> bool:
    return isinstance(x, eqx.nn.BatchNorm)


def sync_batch_norms(model: PyTree, data_axes: tuple[str, ...]) -> PyTree:
    """`model` with every `eqx.nn.BatchNorm` a `SyncBatchNorm` over `data_axes`.

    **Arguments:**

    - `model`: any pytree.
    - `data_axes`: the mesh axes the batch is split over (`()`: per-device statistics).

    **Returns:**

    The model, its other modules unchanged (a model without batch norms is returned as is).
    """

    def convert(x: Any) -> Any:
        return rebuild(SyncBatchNorm, x, data_axes=tuple(data_axes)) if _is_batch_norm(x) else x

    return jax.tree.map(convert, model, is_leaf=_is_batch_norm)
