"""`ml.models.parallel` names against oracles written from the reference (ml-starter).

Values and gradients on distinct per-device inputs, axes of size 2, 3 (a sub-mesh) and 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import equishard as es
from equishard.core import ReduceOp, mp_copy, mp_gather, mp_reduce, mp_scatter

from . import seed_oracles as ref
from .helpers import assert_tree_allclose

SIZES = (2, 3, 4)
OPS = ("sum", "mean", "max", "min")


@functools.cache
def line_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _cases():
    ours = {}
    theirs = {}
    for op in OPS:
        # f32[12, 12] per device: a distinct value on each
        ours[f"copy_{op}"] = lambda v, op=op: jnp.tanh(mp_copy(v, ReduceOp(op), axis_name="x")) * v
        theirs[f"copy_{op}"] = lambda v, op=op: jnp.tanh(ref.mp_copy(v, op, "x")) * v
        ours[f"reduce_{op}"] = lambda v, op=op: jnp.tanh(mp_reduce(v * v, op, axis_name="x"))
        theirs[f"reduce_{op}"] = lambda v, op=op: jnp.tanh(ref.mp_reduce(v * v, op, "x"))
    for dim in (0, -1):
        ours[f"scatter_gather_{dim}"] = lambda v, d=dim: mp_gather(jnp.sin(mp_scatter(v, d, axis_name="x")), d, axis_name="x")
        theirs[f"scatter_gather_{dim}"] = lambda v, d=dim: ref.mp_gather(jnp.sin(ref.mp_scatter(v, d, "x")), d, "x")
    ours["default_dim"] = lambda v: mp_gather(mp_scatter(v, axis_name="x") ** 2, axis_name="x")
    theirs["default_dim"] = lambda v: ref.mp_gather(ref.mp_scatter(v, -1, "x") ** 2, -1, "x")
    return ours, theirs


@functools.cache
def program(n, check_vma):
    ours, theirs = _cases()

    def local(v, ct):
        v, ct = v[0], ct[0]
        out = {}
        for name in ours:
            for who, fn in (("ours", ours[name]), ("ref", theirs[name])):
                y, vjp = jax.vjp(fn, v)
                out[who, name] = (y[None], vjp(ct)[0][None])
        return out

    mesh = line_mesh(n)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=check_vma))


@pytest.mark.parametrize("n", SIZES)
def test_mp_operators_match_reference_without_the_check(n):
    v = jax.random.normal(jax.random.key(n), (n, 12, 12))  # a distinct f32[12, 12] per device
    ct = jax.random.normal(jax.random.key(50 + n), (n, 12, 12))
    out = program(n, False)(v, ct)
    for name in _cases()[0]:
        (yo, go), (yr, gr) = out["ours", name], out["ref", name]
        assert_tree_allclose(yo, yr)
        assert_tree_allclose(go, gr)


@pytest.mark.parametrize("n", SIZES)
def test_mp_operators_with_the_check_on_invariant_inputs(n):
    # With the varying-axes check (equishard's default) the backward equals the
    # reference's for replicated inputs, where the two conventions agree.
    v = jax.random.normal(jax.random.key(n), (6, 12))

    def make(copy, reduce):
        def local(v):
            loss = lambda w: jnp.sum(reduce(jnp.tanh(copy(w) * (1.0 + jax.lax.axis_index("x")))) ** 2)
            return jax.value_and_grad(loss)(v)

        return local

    ours = make(lambda a: mp_copy(a, axis_name="x"), lambda a: mp_reduce(a, axis_name="x"))
    theirs = make(lambda a: ref.mp_copy(a, "sum", "x"), lambda a: ref.mp_reduce(a, "sum", "x"))
    run = lambda fn, check: jax.jit(
        jax.shard_map(fn, mesh=line_mesh(n), in_specs=P(), out_specs=P(), check_vma=check)
    )(v)
    # The reference (check off) gives each device the full gradient; so does ours with the check.
    assert_tree_allclose(run(ours, True), run(theirs, False))


def test_a_reduction_jax_lacks_raises():
    mesh = line_mesh(2)
    with pytest.raises(es.SpecError, match="not a reduction"):
        jax.shard_map(lambda v: mp_copy(v, "product", axis_name="x"), mesh=mesh, in_specs=P(), out_specs=P())(jnp.ones(2))
