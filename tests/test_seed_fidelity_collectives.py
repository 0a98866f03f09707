"""xLSTM-JAX's ring collectives: equishard's `async_*` against the reference's oracle.

Values and gradients on distinct per-device inputs, on axes of size 2, 3 (a 3-device
sub-mesh) and 4; `async_scatter_split` also on an odd last dimension (3), which the
reference (xlstm_jax/distributed/tensor_parallel.py, `async_scatter_split`) splits as
`x[..., :1]` up the ring and `x[..., 1:]` down. One compiled program per axis size holds every function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import equishard as es
from equishard.core import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
    ring_all_gather,
    ring_reduce_scatter,
)

from . import seed_oracles as ref

SIZES = (2, 3, 4)


@functools.cache
def line_mesh(n: int) -> Mesh:
    """A one-axis mesh `x` of the first `n` devices (a sub-mesh when n < 8)."""
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _ours(n):
    return {
        "gather_up": lambda x: async_gather(x[0], "x"),
        "gather_down": lambda x: async_gather(x[0], "x", shift_up=False),
        "bidir_up": lambda x: async_gather_bidirectional(x[0], "x"),
        "bidir_down": lambda x: async_gather_bidirectional(x[0], "x", False),
        "split": lambda x: async_gather_split(x[0], "x"),
        "scatter_up": lambda x: async_scatter(list(x), "x"),
        "scatter_down": lambda x: async_scatter(list(x), "x", False),
        "scatter_split": lambda x: async_scatter_split(list(x), "x"),
        "scatter_split_odd": lambda x: async_scatter_split(list(x[..., :3]), "x"),
    }


def _reference(n):
    return {
        "gather_up": lambda x: ref.async_gather(x[0], "x"),
        "gather_down": lambda x: ref.async_gather(x[0], "x", shift_up=False),
        "bidir_up": lambda x: ref.async_gather_bidirectional(x[0], "x"),
        "bidir_down": lambda x: ref.async_gather_bidirectional(x[0], "x", False),
        "split": lambda x: ref.async_gather_split(x[0], "x"),
        "scatter_up": lambda x: ref.async_scatter(list(x), "x"),
        "scatter_down": lambda x: ref.async_scatter(list(x), "x", False),
        "scatter_split": lambda x: ref.async_scatter_split(list(x), "x"),
        # tensor_parallel.py `async_scatter_split`'s `_split`: x[..., :d // 2], x[..., d // 2:]
        "scatter_split_odd": lambda x: ref.async_scatter_split(list(x[..., :3]), "x"),
    }


def _inputs(n):
    # Per device a distinct f32[n, 3, 4] (the scatters read it as n partials f32[3, 4]).
    x = jax.random.normal(jax.random.key(n), (n * n, 3, 4))
    cts = jax.random.normal(jax.random.key(100 + n), (n, 2 * n, 3, 4))  # per device, per list element
    return x, cts


@functools.cache
def program(n):
    """Outputs and input gradients of every function, ours and the oracle's, compiled once."""

    def local(x, cts):
        # x: f32[n, 3, 4] on each device; cts: f32[1, 2n, 3, 4]
        cts = cts[0]
        result = {}
        for who, fns in (("ours", _ours(n)), ("ref", _reference(n))):
            for name, fn in fns.items():
                out, vjp = jax.vjp(fn, x)
                # The gathers return lists of blocks; the scatters one block.
                out_list = out if isinstance(out, list) else [out]
                ct = [cts[k, ..., : o.shape[-1]] for k, o in enumerate(out_list)]
                (g,) = vjp(ct if isinstance(out, list) else ct[0])
                padded = [jnp.pad(o, ((0, 0),) * (o.ndim - 1) + ((0, 4 - o.shape[-1]),)) for o in out_list]
                result[who, name] = (jnp.stack(padded)[None], len(out_list), g)
        return {k: (v[0], v[2]) for k, v in result.items()}

    mesh = line_mesh(n)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    return jax.jit(fn)


@pytest.mark.parametrize("n", SIZES)
def test_async_collectives_match_reference(n):
    x, cts = _inputs(n)
    out = program(n)(x, cts)
    for name in _ours(n):
        ours_v, ours_g = out["ours", name]
        ref_v, ref_g = out["ref", name]
        assert ours_v.shape == ref_v.shape, name  # same list length (2n half blocks for split)
        np.testing.assert_array_equal(ours_v, ref_v, err_msg=name)
        np.testing.assert_allclose(ours_g, ref_g, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("n", SIZES)
def test_async_gather_lists_by_ring_offset(n):
    # Element k on device i is device (i - k)'s block (up) or (i + k)'s (down).
    x, cts = _inputs(n)
    out = program(n)(x, cts)
    blocks = np.asarray(x).reshape(n, n, 3, 4)[:, 0]  # the gathers send x[0]
    up = np.asarray(out["ours", "gather_up"][0])  # f32[n devices, n, n, 3, 4]
    down = np.asarray(out["ours", "gather_down"][0])
    for i in range(n):
        for k in range(n):
            np.testing.assert_array_equal(up[i, k], blocks[(i - k) % n])
            np.testing.assert_array_equal(down[i, k], blocks[(i + k) % n])
    split = np.asarray(out["ours", "split"][0])
    assert split.shape[1] == 2 * n


def test_async_scatter_refuses_wrong_number_of_partials():
    mesh = line_mesh(2)
    fn = jax.shard_map(lambda x: async_scatter([x, x, x], "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(es.SpecError, match="one partial per device"):
        fn(jnp.ones((2, 4)))


def test_device_ordered_rings_keep_their_order():
    # equishard's own ring_all_gather / ring_reduce_scatter stay in device order.
    n = 3
    mesh = line_mesh(n)
    x = jnp.arange(n * 2 * 4.0).reshape(n * 2, 4)

    def local(b):
        return jnp.concatenate(ring_all_gather(b, "x"))[None], ring_reduce_scatter(list(b.reshape(n, 2, 4)), "x")

    fn = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")))
    gathered, scattered = fn(jnp.tile(x, (n, 1)))
    np.testing.assert_array_equal(gathered, np.broadcast_to(np.tile(x, (n, 1)), (n, n * n * 2, 4)))
    assert scattered.shape == (n * 2, 4)
