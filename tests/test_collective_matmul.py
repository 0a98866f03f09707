"""Collective matmuls equal the plain collective + matmul, in value and gradient.

`all_gather_matmul` (gathering x or w) and `matmul_reduce_scatter`, one-directional and
bidirectional, on meshes (2,), (4,), (8,), (4,2) and (2,2,2) over one axis and tuples of
axes; their compiled programs hold collective-permutes only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import all_gather_matmul, matmul_reduce_scatter
from equishard.report import collective_bytes, count_collectives, read_collectives

from .helpers import assert_tree_allclose
from .test_collectives import case_id, compiled_values_and_grads, mesh_of, rand, size_of, smap

CASES = [("2", "x"), ("4", "x"), ("8", "x"), ("4x2", "tp"), ("4x2", ("tp", "dp")), ("2x2x2", ("c", "a"))]

# name -> (function of (x, w, axis names), ring passes)
RINGS = {
    "gather_x": (lambda x, w, ax: all_gather_matmul(x, w, ax, gathered="x")[None], 1),
    "gather_x_bidirectional": (lambda x, w, ax: all_gather_matmul(x, w, ax, gathered="x", bidirectional=True)[None], 2),
    "gather_w": (lambda x, w, ax: all_gather_matmul(x, w, ax, gathered="w"), 1),
    "gather_w_bidirectional": (lambda x, w, ax: all_gather_matmul(x, w, ax, gathered="w", bidirectional=True), 2),
    "reduce_scatter": (lambda x, w, ax: matmul_reduce_scatter(x, w, ax), 1),
    "reduce_scatter_bidirectional": (lambda x, w, ax: matmul_reduce_scatter(x, w, ax, bidirectional=True), 2),
}


def family(name: str) -> str:
    return name.removesuffix("_bidirectional")


def specs(name: str, axes):
    """(x spec, w spec, out spec) of each family on the global arrays."""
    return {
        "gather_x": (P(axes), P(), P(axes)),  # out: each device's copy, stacked
        "gather_w": (P(axes), P(axes), P(axes)),
        "reduce_scatter": (P(None, axes), P(axes), P(axes)),
    }[family(name)]


def global_operands(name: str, n: int, seed: int = 0):
    """Global x, w: 2 rows of x per device (4 for reduce-scatter), even local blocks."""
    kx, kw = seed, seed + 100
    return {
        "gather_x": (rand(kx, (2 * n, 6)), rand(kw, (6, 5))),
        "gather_w": (rand(kx, (2 * n, 4 * n)), rand(kw, (4 * n, 5))),
        "reduce_scatter": (rand(kx, (4 * n, 2 * n)), rand(kw, (2 * n, 5))),
    }[family(name)]


def unsharded(name, x, w, n):
    """The single-device computation, which the plain collective + matmul equals.

    `all_gather(x) @ w` on each device (stacked), `x @ all_gather(w)` and
    `psum_scatter(x @ w)` laid out by their out specs are all the global `x @ w`.
    """
    out = x @ w
    return jnp.broadcast_to(out[None], (n, *out.shape)) if family(name) == "gather_x" else out


def matmuls_case(layout, axes):
    n = size_of(mesh_of(layout), axes)
    ins = {k: global_operands(k, n, seed=i) for i, k in enumerate(RINGS)}
    cts = {k: rand(50 + i, unsharded(k, *ins[k], n).shape) for i, k in enumerate(RINGS)}
    return n, ins, cts


@functools.cache
def matmuls_program(layout, axes):
    """Values and gradients of every collective matmul, compiled."""

    def local(ins):
        return {k: fn(ins[k][0], ins[k][1], axes) for k, (fn, _) in RINGS.items()}

    in_specs = ({k: specs(k, axes)[:2] for k in RINGS},)
    out_specs = {k: specs(k, axes)[2] for k in RINGS}
    _, ins, cts = matmuls_case(layout, axes)
    return compiled_values_and_grads(smap(local, mesh_of(layout), in_specs, out_specs), ins, cts)


@pytest.mark.parametrize("layout,axes", CASES, ids=[case_id(*case) for case in CASES])
def test_collective_matmuls(layout, axes):
    n, ins, cts = matmuls_case(layout, axes)
    out, grads = matmuls_program(layout, axes)(ins, cts)
    for k in RINGS:
        x, w = (np.asarray(a, np.float64) for a in ins[k])
        ct = np.asarray(cts[k], np.float64)
        if family(k) == "gather_x":
            ct = ct.sum(0)  # every device's copy of x @ w contributes
        assert_tree_allclose(out[k], unsharded(k, *ins[k], n))
        # d/dx sum((x @ w) * ct) = ct @ w.T;  d/dw = x.T @ ct
        assert_tree_allclose(grads[k], (ct @ w.T, x.T @ ct))


def test_collective_matmuls_with_leading_batch_dimensions():
    # Sequence-parallel shapes: x f32[B, S/n, D], gathered or scattered along S.
    mesh, axes, n = mesh_of("2x2x2"), ("c", "a"), 4
    x_seq, w_col = rand(0, (3, 2 * n, 6)), rand(1, (6, 5))
    x_row, w_row = rand(2, (3, 2 * n, 2 * n)), rand(3, (2 * n, 5))

    def local(x_seq, w_col, x_row, w_row):
        return (
            all_gather_matmul(x_seq, w_col, axes, bidirectional=True)[None],
            matmul_reduce_scatter(x_row, w_row, axes, bidirectional=True),
        )

    fn = jax.jit(
        smap(local, mesh, (P(None, axes), P(), P(None, None, axes), P(axes)), (P(axes), P(None, axes)))
    )
    gathered, scattered = fn(x_seq, w_col, x_row, w_row)
    assert_tree_allclose(gathered, np.broadcast_to(np.asarray(x_seq @ w_col)[None], (n, 3, 2 * n, 5)))
    assert_tree_allclose(scattered, x_row @ w_row)


def test_collective_matmuls_compile_to_collective_permutes_only():
    layout, axes = "4x2", ("tp", "dp")
    mesh = mesh_of(layout)
    n = size_of(mesh, axes)
    for name, (fn, passes) in RINGS.items():
        x_spec, w_spec, out_spec = specs(name, axes)
        x, w = global_operands(name, n)
        sharded = smap(lambda x, w: fn(x, w, axes), mesh, (x_spec, w_spec), out_spec)
        ops = read_collectives(jax.jit(sharded).lower(x, w).compile())
        assert count_collectives(ops) == {"collective-permute": passes * (n - 1)}, name
        assert all(op.group_size == n for op in ops), name
        # n - 1 steps each move one local block of the travelling operand (halves both ways).
        travelling = {"gather_x": 2 * 6, "gather_w": 4 * 5, "reduce_scatter": 4 * 5}[family(name)]
        assert collective_bytes(ops) == (n - 1) * travelling * 4, name


def test_collective_matmul_gradients_compile_to_rings():
    # The backward passes (the program of `test_collective_matmuls`) are rings too: twice
    # the forward's collective-permutes. A replicated w (gathered="x") adds the all-reduce
    # of its gradient, f32[6, 5]; nothing is all-gathered or reduce-scattered.
    n = 8
    ops = read_collectives(matmuls_program("4x2", ("tp", "dp")))
    counts = count_collectives(ops)
    assert counts.pop("collective-permute") == 2 * sum(passes * (n - 1) for _, passes in RINGS.values())
    assert set(counts) <= {"all-reduce"}
    assert all(shape == (6, 5) for op in ops if op.kind == "all-reduce" for _, shape in op.operand_shapes)


def test_collective_matmul_errors():
    mesh = mesh_of("4x2")
    axes = ("tp", "dp")

    def run(fn, x, w, x_spec, w_spec):
        return jax.jit(smap(fn, mesh, (x_spec, w_spec), P())).lower(x, w)

    gx_bi = lambda x, w: all_gather_matmul(x, w, axes, gathered="x", bidirectional=True).sum()
    with pytest.raises(es.SpecError, match=r"x \(3, 4\).*\('tp', 'dp'\) of 8 devices.*\(24\) must be divisible by 2n = 16"):
        run(gx_bi, jnp.zeros((24, 4)), jnp.zeros((4, 5)), P(axes), P())
    gw = lambda x, w: all_gather_matmul(x, w, axes, gathered="w").sum()
    with pytest.raises(es.SpecError, match=r"last dimension \(12\) to be n = 8 times w's local rows \(2\)"):
        run(gw, jnp.zeros((8, 12)), jnp.zeros((16, 5)), P(axes), P(axes))
    gw_bi = lambda x, w: all_gather_matmul(x, w, axes, gathered="w", bidirectional=True).sum()
    with pytest.raises(es.SpecError, match=r"contracting dimension \(8\) must be divisible by 2n = 16"):
        run(gw_bi, jnp.zeros((8, 8)), jnp.zeros((8, 5)), P(axes), P(axes))
    rs = lambda x, w: matmul_reduce_scatter(x, w, axes).sum()
    with pytest.raises(es.SpecError, match=r"rows, 12\) must be divisible by n = 8"):
        run(rs, jnp.zeros((12, 16)), jnp.zeros((16, 5)), P(None, axes), P(axes))
    rs_bi = lambda x, w: matmul_reduce_scatter(x, w, axes, bidirectional=True).sum()
    with pytest.raises(es.SpecError, match=r"rows, 8\) must be divisible by 2n = 16"):
        run(rs_bi, jnp.zeros((8, 16)), jnp.zeros((16, 5)), P(None, axes), P(axes))
    with pytest.raises(es.SpecError, match=r"x's last dimension \(3\) and w's first \(2\) must be equal"):
        run(rs, jnp.zeros((8, 24)), jnp.zeros((16, 5)), P(None, axes), P(axes))
    bad = lambda x, w: all_gather_matmul(x, w, axes, gathered="both").sum()
    with pytest.raises(es.LayerConfigError, match="gathered must be 'x' or 'w'"):
        run(bad, jnp.zeros((8, 4)), jnp.zeros((4, 5)), P(axes), P())
