"""Randomness that belongs to the example, not to the device.

A per-example random draw (dropout, noise, sampling) that splits the step's key by the
*local* batch gives each device the same few keys, and a different set of masks on every
layout. These functions derive keys from *global* positions instead — the example's
index in the global batch, a feature's index in the global activation — so every draw
is the one the one-device program makes, whatever the mesh, the process count or the
number of micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, Key, PRNGKeyArray, UInt32

from ._collectives import AxisName, axis_tuple, combined_axis_size


def global_index(size: int, axis_name: AxisName | None = None) -> Int[Array, " size"]:
    """The global indices of this device's `size` positions of a split dimension.

    Inside `shard_map`, a dimension split over `axis_name` (one mesh axis or a tuple,
    blocks in the order the tuple names them, as in `P(("dp", "fsdp"))`) holds positions
    `i * size, ..., (i + 1) * size - 1` on the device with combined index `i`. With
    `axis_name=None` (or outside `shard_map`) the dimension is whole: `0, ..., size - 1`.

    **Arguments:**

    - `size`: the local length of the dimension.
    - `axis_name`: the mesh axis or axes it is split over, or `None`.

    **Returns:**

    `int32[size]`, the global positions.
    """
    local = jnp.arange(size, dtype=jnp.int32)
    if axis_name is None:
        return local
    return jax.lax.axis_index(axis_tuple(axis_name)).astype(jnp.int32) * size + local


def example_keys(key: PRNGKeyArray, index: Int[Array, " batch"]) -> Key[Array, " batch"]:
    """One key per example, from its global index: `fold_in(key, index[b])`.

    The same example gets the same key on one device and on any mesh, in any
    micro-batch: `make_train_step` hands a loss function that takes `index` the global
    indices of its local examples (see the "Your own model" guide, section Dropout).

    **Arguments:**

    - `key`: the step's key (the same on every device).
    - `index`: `int32[batch]`, the global indices of the local examples.

    **Returns:**

    A key array of shape `[batch]`, e.g. for `jax.vmap(model)(x, key=keys)`.
    """
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


def bernoulli_block(
    key: PRNGKeyArray,
    p: float | Array,
    shape: tuple[int, ...],
    *,
    axis_name: AxisName | None = None,
    dim: int = -1,
) -> Bool[Array, "..."]:
    """This device's block of the mask `jax.random.bernoulli(key, p, global_shape)`.

    For dropout on an activation split over `axis_name` along `dim` (the hidden
    features of a column-parallel layer): every feature draws by its global index, so
    the mask equals the one-device mask of the whole activation. The global mask is
    drawn on every device and sliced (random bits cost the whole activation, not its
    block).

    **Arguments:**

    - `key`: the key the one-device program would use for this activation.
    - `p`: the probability of `True`.
    - `shape`: the local shape.
    - `axis_name`: the mesh axis or axes `dim` is split over (`None`: not split).
    - `dim`: the split dimension.

    **Returns:**

    `bool[*shape]`.
    """
    if axis_name is None:
        return jax.random.bernoulli(key, p, shape)
    dim = dim % len(shape)
    n = combined_axis_size(axis_name)
    full = list(shape)
    full[dim] *= n
    mask = jax.random.bernoulli(key, p, tuple(full))
    start = jax.lax.axis_index(axis_tuple(axis_name)) * shape[dim]
    return jax.lax.dynamic_slice_in_dim(mask, start, shape[dim], axis=dim)


def _u32(value: int) -> np.uint32:
    return np.uint32(value)


def _rotl(x: Array, r: int) -> Array:
    return (x << _u32(r)) | (x >> _u32(32 - r))


def _fmix32(h: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: a bijection of `uint32` whose every output bit
    depends on every input bit."""
    h = h ^ (h >> _u32(16))
    h = h * _u32(0x85EBCA6B)
    h = h ^ (h >> _u32(13))
    h = h * _u32(0xC2B2AE35)
    return h ^ (h >> _u32(16))


def hash_seed(key: PRNGKeyArray) -> UInt32[Array, "2"]:
    """The two words `hash_bits` starts from, drawn from `key` (any key implementation).

    **Arguments:**

    - `key`: a PRNG key, the same on every device (e.g. the train step's).

    **Returns:**

    `uint32[2]`.
    """
    return jax.random.bits(key, (2,), jnp.uint32)


def hash_bits(seed: UInt32[Array, "2"], *coords: Int[Array, "..."] | int) -> UInt32[Array, "..."]:
    """Random bits that are a pure function of a seed and integer coordinates.

    A counter-based draw: element `e` of the result hashes `seed` with `coords[0][e],
    coords[1][e], ...` (the coordinates broadcast against one another; MurmurHash3's
    block mix per coordinate and its finaliser at the end). Where the coordinates are
    *global* (an example's index in the global batch, a token's position in its
    sequence, a feature's index in the whole activation), each device computes exactly
    its block of the one-device draw, with no communication, whatever the mesh, the
    micro-batches or the order in which the blocks are visited. Each coordinate is
    broadcast only when it is mixed in: put the largest last (e.g. `example[:, None,
    None], position[:, :, None], feature`) so that the earlier rounds run on the smaller
    shapes.

    **Arguments:**

    - `seed`: `uint32[2]`, e.g. `hash_seed(key)`.
    - `coords`: integer arrays (or Python ints) that broadcast together; their values
      are taken modulo 2**32.

    **Returns:**

    `uint32` bits of the coordinates' broadcast shape, each bit 0 or 1 with probability
    1/2 (to the quality of a 32-bit hash: enough for dropout masks, not for
    cryptography).
    """
    arrays = [jnp.asarray(c) for c in coords]
    rank = max((a.ndim for a in arrays), default=0)
    h = seed[0]
    for c in arrays:
        c = c.reshape((1,) * (rank - c.ndim) + c.shape)  # ranks made equal: broadcast, not promoted
        k = c.astype(jnp.uint32) * _u32(0xCC9E2D51)
        k = _rotl(k, 15) * _u32(0x1B873593)
        h = _rotl(h ^ k, 13) * _u32(5) + _u32(0xE6546B64)
    return _fmix32(h ^ seed[1])


def hash_keep(seed: UInt32[Array, "2"], rate: float, *coords: Int[Array, "..."] | int) -> Bool[Array, "..."]:
    """A dropout's keep mask from `hash_bits(seed, *coords)`: each element `True` with
    probability `1 - rate` (to within 2**-32).

    **Arguments:**

    - `seed`, `coords`: as `hash_bits`.
    - `rate`: the probability of dropping, in `[0, 1)`.

    **Returns:**

    `bool` of the coordinates' broadcast shape.
    """
    threshold = _u32(min(round(float(rate) * 2.0**32), 2**32 - 1))
    return hash_bits(seed, *coords) >= threshold
