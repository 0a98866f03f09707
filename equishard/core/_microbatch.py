"""Micro-batches: a batch split along its first dimension, the one home of that split.

Gradient accumulation (the train step, in either view) and the pipeline schedules
(GPipe, circular, the explicit executor and the pipeline module's loss) all cut a batch
`[B, ...]` into `M` equal micro-batches `[M, B/M, ...]` with `split_microbatches`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._errors import LayerConfigError


def split_microbatches(
    tree: PyTree,
    num: int,
    *,
    what: str,
    name: str = "num_microbatches",
    shards: int = 1,
    hint: str = "the batch per device must be divisible by {name}.",
) -> PyTree:
    """Every array of `tree`, `[B, ...]`, as `num` micro-batches `[num, B/num, ...]`.

    Micro-batch `m` holds rows `[m B/num, (m+1) B/num)`. With `shards > 1` the batch is
    read as `shards` consecutive blocks (a global batch whose blocks are the data
    shards' local batches) and micro-batch `m` takes the `m`-th slice of every block, the
    rows each shard's own split would give it.

    **Arguments:**

    - `tree`: a pytree of arrays with a leading batch dimension (`None` leaves pass).
    - `num`: `M`, the number of micro-batches.
    - `what`: the caller, named in the error (e.g. `"make_train_step"`).
    - `name`: the option that set `num`, named in the error (e.g. `"grad_accum"`).
    - `shards`: the number of blocks the batch is made of (see above).
    - `hint`: the error's last sentence (`{name}` is filled in).

    **Returns:**

    The tree with each array reshaped to `[num, B/num, ...]`.

    **Raises:**

    `LayerConfigError` naming the array's shape, `name` and `num` when an array has no
    leading dimension or `shards * num` does not divide it.
    """

    def split(x: Array) -> Array:
        if x.ndim < 1 or x.shape[0] % (shards * num):
            into = f"{shards} data shards x " if shards > 1 else ""
            raise LayerConfigError(
                f"{what}: an input of shape {tuple(x.shape)} cannot be split into "
                f"{into}{name}={num} equal micro-batches; {hint.format(name=name)}"
            )
        if shards == 1:
            # f32[B, ...] -> f32[M, B/M, ...]
            return x.reshape(num, x.shape[0] // num, *x.shape[1:])
        # f32[B, ...] -> f32[S, M, B/(S M), ...] -> f32[M, S B/(S M), ...]
        x = x.reshape(shards, num, x.shape[0] // (shards * num), *x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape(num, -1, *x.shape[3:])

    return jax.tree.map(split, tree)
