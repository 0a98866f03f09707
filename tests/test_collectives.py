"""Ring shift, ring gathers/scatters, conjugate operators and gather-with-mean-grads.

Each is compared, value and gradient, with the `jax.lax` collective or the unsharded
computation on meshes (2,), (4,), (8,), (4,2) and (2,2,2), over one axis and over tuples of
axes in and out of mesh order. One jitted program per (mesh, axes) case holds all the
functions of a family, to keep compilation cheap.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    gather_array_with_mean_grads,
    mp_copy,
    mp_gather,
    mp_reduce,
    mp_scatter,
    ring_all_gather,
    ring_all_gather_bidirectional,
    ring_all_gather_split,
    ring_reduce_scatter,
    ring_reduce_scatter_split,
    ring_shift,
)
from equishard.report import collective_bytes, count_collectives, read_collectives

from .helpers import assert_tree_allclose

LAYOUTS = {
    "2": "x=2",
    "4": "x=4",
    "8": "x=8",
    "4x2": "dp=4,tp=2",
    "2x2x2": "a=2,b=2,c=2",
}

# (layout, axis_name): single axes, tuples in mesh order and tuples against it.
CASES = [
    ("2", "x"),
    ("4", "x"),
    ("8", "x"),
    ("4x2", "tp"),
    ("4x2", ("dp", "tp")),
    ("4x2", ("tp", "dp")),
    ("2x2x2", "b"),
    ("2x2x2", ("c", "b", "a")),
]


def case_id(layout, axes) -> str:
    return f"{layout}-{axes if isinstance(axes, str) else '+'.join(axes)}"


IDS = [case_id(*case) for case in CASES]
# The fallback without the varying-axes check, on fewer cases.
UNCHECKED_CASES = [("8", "x"), ("4x2", ("tp", "dp")), ("2x2x2", ("c", "a"))]


@functools.cache
def mesh_of(layout: str):
    return es.make_mesh(LAYOUTS[layout])


def size_of(mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def rand(seed: int, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def smap(fn, mesh, in_specs, out_specs, check_vma=True):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


# ---------------------------------------------------------------------------- ring_shift


def test_ring_shift_follows_logical_order_of_tuple():
    # On a (dp=4, tp=2) mesh, arange(8) laid out as P(("tp", "dp")) shifts in that order.
    mesh = mesh_of("4x2")
    x = jnp.arange(8.0)
    shift = lambda offset: jax.jit(
        smap(lambda v: ring_shift(v, ("tp", "dp"), offset), mesh, P(("tp", "dp")), P(("tp", "dp")))
    )(x)
    np.testing.assert_array_equal(shift(1), [7, 0, 1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(shift(-1), [1, 2, 3, 4, 5, 6, 7, 0])
    np.testing.assert_array_equal(shift(8), np.arange(8))


def test_naive_ppermute_over_tuple_is_refused_or_wrong():
    # The second fact ring_shift works around: jax.lax.ppermute linearises an axis tuple in
    # mesh order, so the naive permutation is wrong on JAX 0.10 and refused on JAX >= 0.12.
    mesh = mesh_of("4x2")
    naive = lambda v: jax.lax.ppermute(v, ("tp", "dp"), [(i, (i + 1) % 8) for i in range(8)])
    fn = jax.jit(smap(naive, mesh, P(("tp", "dp")), P(("tp", "dp"))))
    try:
        out = fn(jnp.arange(8.0))
    except Exception as err:  # JAX >= 0.12
        assert "same order as the axis_names declared on the mesh" in str(err)
    else:  # JAX 0.10: runs, in mesh order
        np.testing.assert_array_equal(out, [7, 4, 5, 6, 0, 1, 2, 3])
        assert not np.array_equal(out, [7, 0, 1, 2, 3, 4, 5, 6])


# ---------------------------------------------------------------------------- ring gathers

GATHERS = {
    "ring_up": lambda x, ax: ring_all_gather(x, ax, shift_up=True),
    "ring_down": lambda x, ax: ring_all_gather(x, ax, shift_up=False),
    "bidir_up": lambda x, ax: ring_all_gather_bidirectional(x, ax, shift_up=True),
    "bidir_down": lambda x, ax: ring_all_gather_bidirectional(x, ax, shift_up=False),
    "split": ring_all_gather_split,
}


SHIFTS = {"shift+1": 1, "shift-1": -1, "shift+3": 3}
# Ring passes each function makes (a split function makes two of half blocks).
PASSES = {"ring_up": 1, "ring_down": 1, "bidir_up": 1, "bidir_down": 1, "split": 2, **{k: 0 for k in SHIFTS}}


def compiled_values_and_grads(fn, inputs, cts):
    """Compile `fn` (a dict of inputs to a dict of outputs, output k depending on input k
    only) with its gradients: the outputs and, per key, the gradient of `sum(out[k] * cts[k])`,
    from one backward pass. Returns the compiled program, to run and to read."""

    def run(inputs, cts):
        out, vjp = jax.vjp(fn, inputs)
        return out, vjp(cts)[0]

    return jax.jit(run).lower(inputs, cts).compile()


def gathers_case(layout, axes):
    n = size_of(mesh_of(layout), axes)
    x = rand(0, (2 * n, 4))  # global f32[M, F]; local f32[2, 4]
    cts = {k: rand(1 + i, (n, 2 * n, 4)) for i, k in enumerate(GATHERS)}
    cts.update({k: rand(10 + i, (2 * n, 4)) for i, k in enumerate(SHIFTS)})
    return n, {k: x for k in cts}, cts


@functools.cache
def gathers_program(layout, axes):
    """Values and gradients of every ring gather and ring shift, compiled."""
    spec = P(axes)

    def local(xs):
        # f32[M/n, F] -> f32[1, M, F]: this device's copy of the gathered array
        outs = {k: jnp.concatenate(g(xs[k], axes), axis=0)[None] for k, g in GATHERS.items()}
        # f32[M/n, F] -> f32[M/n, F]
        outs.update({k: ring_shift(xs[k], axes, offset) for k, offset in SHIFTS.items()})
        return outs

    _, inputs, cts = gathers_case(layout, axes)
    return compiled_values_and_grads(smap(local, mesh_of(layout), spec, spec), inputs, cts)


@pytest.mark.parametrize("layout,axes", CASES, ids=IDS)
def test_ring_gathers_and_shift(layout, axes):
    n, inputs, cts = gathers_case(layout, axes)
    x = inputs["ring_up"]
    out, grads = gathers_program(layout, axes)(inputs, cts)

    # As jax.lax.all_gather: every device holds the whole array; the gradient sums the copies.
    for k in GATHERS:
        np.testing.assert_array_equal(out[k], np.broadcast_to(x, (n, 2 * n, 4)), err_msg=k)
        assert_tree_allclose(grads[k], cts[k].sum(0))

    # Shifting by o: device i holds the block of device i - o.
    blocks = lambda a: np.asarray(a).reshape(n, 2, 4)
    for name, offset in SHIFTS.items():
        np.testing.assert_array_equal(blocks(out[name]), np.roll(blocks(x), offset, axis=0), err_msg=name)
        assert_tree_allclose(blocks(grads[name]), np.roll(blocks(cts[name]), -offset, axis=0))


def test_gathers_in_bf16_equal_fp32_gather_then_cast():
    mesh, axes = mesh_of("4x2"), ("tp", "dp")
    x = rand(0, (16, 6))

    def local(v):
        ring = {k: jnp.concatenate(g(v.astype(jnp.bfloat16), axes), axis=0)[None] for k, g in GATHERS.items()}
        ring["mp_gather"] = mp_gather(v.astype(jnp.bfloat16), 0, axis_name=axes)[None]
        fp32_then_cast = jax.lax.all_gather(v, axes, axis=0, tiled=True).astype(jnp.bfloat16)[None]
        return ring, fp32_then_cast

    ring, expected = jax.jit(smap(local, mesh, P(axes), P(axes)))(x)
    for k, v in ring.items():
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(expected, np.float32), err_msg=k)


def test_ring_gather_of_pytree():
    mesh, axes = mesh_of("8"), "x"
    tree = {"a": rand(0, (8, 2)), "b": rand(1, (16,))}

    def local(t):
        got = ring_all_gather_bidirectional(t, axes)
        return jax.tree.map(lambda *blocks: jnp.concatenate(blocks)[None], *got)

    out = jax.jit(smap(local, mesh, P(axes), P(axes)))(tree)
    for k in tree:
        np.testing.assert_array_equal(out[k], np.broadcast_to(tree[k], (8, *tree[k].shape)))


# ---------------------------------------------------------------------------- ring scatters

SCATTERS = {
    "ring_up": lambda xs, ax: ring_reduce_scatter(xs, ax, shift_up=True),
    "ring_down": lambda xs, ax: ring_reduce_scatter(xs, ax, shift_up=False),
    "split": ring_reduce_scatter_split,
}


def scatters_case(layout, axes):
    n = size_of(mesh_of(layout), axes)
    xs = rand(0, (n * n, 2, 4))  # global: device d's partial for device j at row d*n + j
    cts = {k: rand(1 + i, (2 * n, 4)) for i, k in enumerate(SCATTERS)}
    return n, {k: xs for k in cts}, cts


@functools.cache
def scatters_program(layout, axes):
    spec = P(axes)

    def local(xs):
        # f32[n, M/n, F]: this device's partials, one per device -> f32[M/n, F]
        return {k: s([p for p in xs[k]], axes) for k, s in SCATTERS.items()}

    _, inputs, cts = scatters_case(layout, axes)
    return compiled_values_and_grads(smap(local, mesh_of(layout), spec, spec), inputs, cts)


@pytest.mark.parametrize("layout,axes", CASES, ids=IDS)
def test_ring_scatters(layout, axes):
    n, inputs, cts = scatters_case(layout, axes)
    out, grads = scatters_program(layout, axes)(inputs, cts)
    # As jax.lax.psum_scatter: device j's block sums every device's partial for j.
    expected = np.asarray(inputs["ring_up"]).reshape(n, n, 2, 4).sum(0).reshape(2 * n, 4)
    for k in SCATTERS:
        assert_tree_allclose(out[k], expected)
        # d(out_j)/d(partial_{d,j}) = 1: every device's partial for j gets cotangent block j.
        expected_grad = np.broadcast_to(np.asarray(cts[k]).reshape(1, n, 2, 4), (n, n, 2, 4))
        assert_tree_allclose(grads[k], expected_grad.reshape(n * n, 2, 4))


# ---------------------------------------------------------------------------- structure

RING_FUNCTIONS = {
    "ring_all_gather": (lambda x, ax: jnp.concatenate(ring_all_gather(x, ax))[None], 1),
    "ring_all_gather_bidirectional": (lambda x, ax: jnp.concatenate(ring_all_gather_bidirectional(x, ax))[None], 1),
    "ring_all_gather_split": (lambda x, ax: jnp.concatenate(ring_all_gather_split(x, ax))[None], 2),
    "ring_reduce_scatter": (lambda x, ax: ring_reduce_scatter(list(x), ax), 1),
    "ring_reduce_scatter_split": (lambda x, ax: ring_reduce_scatter_split(list(x), ax), 2),
}


@pytest.mark.parametrize("layout,axes", [("8", "x"), ("2x2x2", ("c", "a"))], ids=["8-x", "2x2x2-c+a"])
def test_ring_versions_compile_to_collective_permutes_only(layout, axes):
    mesh = mesh_of(layout)
    n = size_of(mesh, axes)
    for name, (fn, passes) in RING_FUNCTIONS.items():
        x = rand(0, (2 * n, 4)) if "gather" in name else rand(0, (n * n, 2, 4))
        program = jax.jit(smap(lambda v: fn(v, axes), mesh, P(axes), P(axes))).lower(x).compile()
        ops = read_collectives(program)
        assert count_collectives(ops) == {"collective-permute": passes * (n - 1)}, name
        assert all(op.group_size == n for op in ops), name
        # Each pass moves n - 1 local blocks of f32[2, 4] (a split pass moves halves).
        assert collective_bytes(ops) == (n - 1) * 2 * 4 * 4, name


def test_ring_gradients_compile_to_collective_permutes_only():
    # The transpose of a ring pass is a ring pass the other way: the programs of
    # `test_ring_gathers_and_shift` / `test_ring_scatters` (values and gradients) hold
    # collective-permutes only, twice as many as the forward passes.
    n = 8
    gathers = read_collectives(gathers_program("8", "x"))
    forward = sum(PASSES[k] * (n - 1) for k in GATHERS) + len(SHIFTS)
    assert count_collectives(gathers) == {"collective-permute": 2 * forward}
    scatters = read_collectives(scatters_program("8", "x"))
    forward = sum({"split": 2}.get(k, 1) * (n - 1) for k in SCATTERS)
    assert count_collectives(scatters) == {"collective-permute": 2 * forward}


# ---------------------------------------------------------------------------- conjugate ops


@functools.cache
def conjugate_program(layout, axes, check_vma):
    """A Megatron MLP (copy, column, row, reduce) and a sequence-parallel block (scatter, gather)."""
    mesh = mesh_of(layout)

    def mlp(x, w1, w2):
        # f32[B, D] @ f32[D, H/n] -> f32[B, H/n] @ f32[H/n, D] -> partial f32[B, D] -> sum
        return mp_reduce(jnp.tanh(mp_copy(x, axis_name=axes) @ w1) @ w2, axis_name=axes)

    def seq(x, scale):
        # f32[S, D] -> f32[S/n, D] -> f32[S, D]
        return mp_gather(jnp.tanh(mp_scatter(x, 0, axis_name=axes)) * scale, 0, axis_name=axes)

    def local(x, w1, w2, c, s, scale, cs):
        # Each device differentiates the loss computed from replicated outputs.
        loss_mlp = lambda x, w1, w2: (mlp(x, w1, w2) * c).sum()
        loss_seq = lambda s, scale: (seq(s, scale) * cs).sum()
        g_s, g_scale = jax.grad(loss_seq, argnums=(0, 1))(s, scale)
        if not check_vma:
            # Untyped, a replicated parameter used inside the sequence-parallel region
            # gets only this device's part of its gradient (Megatron sums it by hand).
            g_scale = jax.lax.psum(g_scale, axes)
        return (
            mlp(x, w1, w2),
            jax.grad(loss_mlp, argnums=(0, 1, 2))(x, w1, w2),
            seq(s, scale),
            (g_s, g_scale),
        )

    in_specs = (P(), P(None, axes), P(axes, None), P(), P(), P(), P())
    out_specs = (P(), (P(), P(None, axes), P(axes, None)), P(), (P(), P()))
    return jax.jit(smap(local, mesh, in_specs, out_specs, check_vma=check_vma))


def _reference_conjugates(x, w1, w2, c, s, scale, cs):
    mlp = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2
    seq = lambda s, scale: jnp.tanh(s) * scale
    return (
        mlp(x, w1, w2),
        jax.grad(lambda *a: (mlp(*a) * c).sum(), argnums=(0, 1, 2))(x, w1, w2),
        seq(s, scale),
        jax.grad(lambda *a: (seq(*a) * cs).sum(), argnums=(0, 1))(s, scale),
    )


@pytest.mark.parametrize(
    "layout,axes,check_vma",
    [(*case, True) for case in CASES] + [(*case, False) for case in UNCHECKED_CASES],
    ids=[f"{case_id(*case)}-check_vma" for case in CASES] + [f"{case_id(*case)}-unchecked" for case in UNCHECKED_CASES],
)
def test_conjugate_operators(layout, axes, check_vma):
    n = size_of(mesh_of(layout), axes)
    args = (
        rand(0, (3, 5)),  # x
        rand(1, (5, 2 * n)),  # w1, columns split
        rand(2, (2 * n, 5)),  # w2, rows split
        rand(3, (3, 5)),  # cotangent of the MLP output
        rand(4, (2 * n, 3)),  # sequence
        rand(5, ()),  # a replicated scale
        rand(6, (2 * n, 3)),  # cotangent of the sequence block
    )
    got = conjugate_program(layout, axes, check_vma)(*args)
    assert_tree_allclose(got, _reference_conjugates(*args))


def test_conjugate_backwards_are_the_conjugate_collectives():
    # mp_gather's backward is a slice (no communication), mp_scatter's an all-gather
    # (not an all-reduce of a zero-padded array); mp_copy's a psum, mp_reduce's nothing.
    mesh, axes = mesh_of("8"), "x"
    s = rand(0, (16, 3))
    seq = lambda v: (mp_gather(jnp.tanh(mp_scatter(v, 0, axis_name=axes)), 0, axis_name=axes) ** 2).sum()
    for check_vma in (True, False):
        fn = jax.jit(smap(jax.grad(seq), mesh, P(), P(), check_vma=check_vma))
        assert count_collectives(read_collectives(fn.lower(s).compile())) == {"all-gather": 2}
        copy = lambda v: (mp_reduce(mp_copy(v, axis_name=axes) * jax.lax.axis_index(axes), axis_name=axes) ** 2).sum()
        fn = jax.jit(smap(jax.grad(copy), mesh, P(), P(), check_vma=check_vma))
        assert count_collectives(read_collectives(fn.lower(s).compile())) == {"all-reduce": 2}


def test_conjugate_errors():
    mesh = mesh_of("4x2")
    bad = lambda v: mp_scatter(v, 0, axis_name=("tp", "dp"))
    with pytest.raises(es.SpecError, match=r"mp_scatter: dimension 0 .* shape \(6, 3\).* 8 devices"):
        jax.jit(smap(bad, mesh, P(), P(("tp", "dp"))))(jnp.zeros((6, 3)))
    with pytest.raises(es.SpecError, match="out of range"):
        jax.jit(smap(lambda v: mp_gather(v, 2, axis_name="tp"), mesh, P(), P()))(jnp.zeros((6, 3)))


# ---------------------------------------------------------------------------- gather with mean grads


@functools.cache
def mean_grads_program(layout, axes, gather_dtype, grad_scatter_dtype):
    mesh = mesh_of(layout)

    def local_loss(w, x):
        # f32[K/n, F] -> f32[K, F]; f32[b, K] @ f32[K, F] -> f32[b, F]
        full = gather_array_with_mean_grads(w, 0, axes, gather_dtype, grad_scatter_dtype)
        return jnp.mean(jnp.tanh(x @ full) ** 2)

    def local(w, x):
        # The local-loss convention: each device differentiates its own loss.
        full = gather_array_with_mean_grads(w, 0, axes, gather_dtype, grad_scatter_dtype)
        return full[None], jax.grad(local_loss)(w, x)

    # The local-loss convention runs without the varying-axes check (it raises with it).
    return jax.jit(smap(local, mesh, (P(axes), P(axes)), (P(axes), P(axes)), check_vma=False))


@pytest.mark.parametrize("layout,axes", CASES, ids=IDS)
def test_gather_array_with_mean_grads(layout, axes):
    n = size_of(mesh_of(layout), axes)
    w = rand(0, (2 * n, 3))  # global parameter, rows sharded
    x = rand(1, (2 * n, 2 * n))  # global batch, rows sharded: 2 examples per device
    gathered, grad = mean_grads_program(layout, axes, None, None)(w, x)
    np.testing.assert_array_equal(gathered, np.broadcast_to(w, (n, 2 * n, 3)))
    # The mean of the devices' mean losses is the mean loss of the whole batch.
    expected = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    assert_tree_allclose(grad, expected)


def test_gather_array_with_mean_grads_in_bf16():
    layout, axes = "4x2", ("tp", "dp")
    w, x = rand(0, (16, 3)), rand(1, (16, 16))
    gathered, grad = mean_grads_program(layout, axes, jnp.bfloat16, jnp.bfloat16)(w, x)
    assert gathered.dtype == jnp.bfloat16 and grad.dtype == jnp.float32
    expected_gathered = np.broadcast_to(np.asarray(w.astype(jnp.bfloat16), np.float32), (8, 16, 3))
    np.testing.assert_array_equal(np.asarray(gathered, np.float32), expected_gathered)
    # The single-device computation with the same cast: fp32 parameter, bf16 in the matmul.
    expected = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w.astype(jnp.bfloat16)) ** 2))(w)
    assert_tree_allclose(grad, expected, rtol=1e-2)


@pytest.mark.parametrize("axes", ["tp", ("dp", "tp"), ("tp", "dp")])
def test_gather_and_scatter_tokens(axes):
    """The token dimension (-2) gathered whole and reduce-scattered back, in `axes`' order."""
    from equishard.core import gather_tokens, scatter_tokens

    mesh = es.make_mesh("dp=4,tp=2")
    names = (axes,) if isinstance(axes, str) else axes
    n = math.prod(mesh.shape[a] for a in names)
    x = jax.random.normal(jax.random.key(0), (2, 16, 3))
    spec = P(None, axes, None)

    def body(x):
        full = gather_tokens(x, axes)  # f32[2, 16/n, 3] -> f32[2, 16, 3]
        rank = jax.lax.axis_index(names).astype(full.dtype)
        back = scatter_tokens(full * (rank + 1), axes)  # Σ_d (d + 1) x, this device's tokens
        return full[None], back  # every device's gathered copy: f32[1, 2, 16, 3]

    fn = jax.jit(es.filter_shard_map(body, mesh=mesh, in_specs=spec, out_specs=(P(axes), spec)))
    full, back = fn(x)
    assert_tree_allclose(full, jnp.broadcast_to(x, (n, *x.shape)))
    assert_tree_allclose(back, x * (n * (n + 1) / 2))
