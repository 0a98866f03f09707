"""fp8 arithmetic (`equishard.core._fp8`) against NumPy references written from the
definitions, on ml_dtypes' float8 types (the ones JAX uses): the scale, the saturating
cast, the delayed-scaling state, and `fp8_matmul`'s value and gradients, bit for bit
where the arithmetic is elementwise and within float32 accumulation rounding for the
products; against the float32 product within the bound derived from the formats."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    E4M3,
    E5M2,
    dequantize,
    fp8_matmul,
    fp8_matmul_meta,
    fp8_meta,
    fp8_meta_update,
    fp8_scale,
    quantize,
)

from .helpers import FP32_RTOL, assert_tree_allclose

F32 = np.float32
MAX = {E4M3: 448.0, E5M2: 57344.0}
NP_TYPE = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # unit roundoff: half an ulp of [1, 2)
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}  # half the smallest subnormal
FORMATS = pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])


# ---------------------------------------------------------------------------
# NumPy references, from the definitions


def np_scale(amax: float, dtype, margin: int = 0) -> F32:
    return F32(MAX[dtype]) / (F32(amax) * F32(2.0**margin))


def np_quantize(x: np.ndarray, scale, dtype) -> np.ndarray:
    top = F32(MAX[dtype])
    return np.clip(x.astype(F32) * F32(scale), -top, top).astype(NP_TYPE[dtype])


def np_product(qa: np.ndarray, qb: np.ndarray, contract: str, sa, sb) -> np.ndarray:
    """The fp8 product as `fp8_matmul` defines it: exact products of the fp8 values
    (float64 here), times both scales' reciprocals in float32."""
    acc = np.einsum(contract, qa.astype(np.float64), qb.astype(np.float64)).astype(F32)
    return acc * (F32(1) / F32(sa)) * (F32(1) / F32(sb))


def accumulation_slack(qa: np.ndarray, qb: np.ndarray, contract: str, sa, sb) -> np.ndarray:
    """Elementwise bound on float32 accumulation rounding: K·2^-23·Σ|qa||qb| / (sa·sb)."""
    k = max(qa.shape[-1], int(np.prod(qa.shape[:-1])))  # at least the terms summed
    mags = np.einsum(contract, np.abs(qa.astype(np.float64)), np.abs(qb.astype(np.float64)))
    return (k + 2) * 2.0**-23 * mags / (float(sa) * float(sb))


def bits_equal(a, b) -> bool:
    """The same fp8 values: equal bits where not NaN, NaN at the same places."""
    a, b = np.asarray(a), np.asarray(b)
    nan_a, nan_b = np.isnan(a.astype(F32)), np.isnan(b.astype(F32))
    return bool((nan_a == nan_b).all() and (a.view(np.uint8) == b.view(np.uint8))[~nan_a].all())


def probe_values(rng: np.random.Generator) -> np.ndarray:
    """Normals over many binades, subnormal-sized ones, exact ties, ±max, beyond, ±inf, NaN."""
    wide = rng.standard_normal(4000).astype(F32) * np.exp2(rng.integers(-24, 20, 4000)).astype(F32)
    ties = np.array([1.0625, 1.1875, 0.0009765625, 3.5e-3, -448.0, 464.0, 57344.0, 61440.0], F32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30], F32)
    return np.concatenate([wide, ties, -ties, special])


# ---------------------------------------------------------------------------
# The scale, the cast and its inverse


@FORMATS
def test_scale_maps_amax_to_the_largest_finite_value(dtype):
    for amax, margin in [(2.0, 0), (0.3, 0), (1234.5, 2), (7e-3, 1)]:
        got = fp8_scale(jnp.float32(amax), dtype, margin)
        assert got.dtype == jnp.float32 and got == np_scale(amax, dtype, margin)
    for amax in [0.0, np.inf, np.nan]:
        assert fp8_scale(jnp.float32(amax), dtype) == 1.0
    assert fp8_scale(jnp.float32(1e-37), dtype) == np.finfo(F32).max  # capped, not inf


def test_bad_format_or_margin_raises():
    with pytest.raises(es.LayerConfigError, match="float8_e4m3fn"):
        fp8_scale(1.0, jnp.bfloat16)
    with pytest.raises(es.LayerConfigError, match="margin"):
        fp8_scale(1.0, E4M3, margin=-1)
    with pytest.raises(es.LayerConfigError, match="history"):
        fp8_meta(E5M2, history=0)


@FORMATS
def test_quantize_and_dequantize_match_numpy_bit_for_bit(dtype):
    x = probe_values(np.random.default_rng(0))
    for scale in [F32(1.0), F32(0.37), np_scale(3.0, dtype)]:
        q = jax.jit(quantize, static_argnums=2)(jnp.asarray(x), jnp.float32(scale), dtype)
        assert q.dtype == dtype and bits_equal(q, np_quantize(x, scale, dtype))
        back = jax.jit(dequantize, static_argnums=2)(q, jnp.float32(scale), jnp.float32)
        ref = np.asarray(q).astype(F32) * (F32(1) / F32(scale))
        np.testing.assert_array_equal(np.asarray(back), ref)
    assert dequantize(q, 2.0, jnp.bfloat16).dtype == jnp.bfloat16


@FORMATS
def test_quantize_saturates_at_the_largest_finite_value(dtype):
    top = MAX[dtype]
    x = jnp.array([top, top * 1.04, top * 1.1, 1e30, np.inf, -top * 1.04, -np.inf], jnp.float32)
    got = np.asarray(quantize(x, 1.0, dtype)).astype(F32)
    np.testing.assert_array_equal(got, [top, top, top, top, top, -top, -top])
    # without the clip the cast overflows: e4m3fn to NaN, e5m2 to inf
    assert not np.isfinite(np.float32(top * 1.1).astype(NP_TYPE[dtype]).astype(F32))


# ---------------------------------------------------------------------------
# Delayed scaling


def test_delayed_scaling_history_and_scale_by_hand():
    meta = fp8_meta(E4M3, history=3, margin=1)
    assert meta.scale == 1.0 and (meta.amax_history == 0).all()
    update = jax.jit(fp8_meta_update)
    # (amax observed, history after it newest first, scale = 448 / (max · 2))
    steps = [
        (2.0, [2.0, 0.0, 0.0], 112.0),
        (8.0, [8.0, 2.0, 0.0], 28.0),
        (1.0, [1.0, 8.0, 2.0], 28.0),
        (0.5, [0.5, 1.0, 8.0], 28.0),
        (0.25, [0.25, 0.5, 1.0], 224.0),
    ]
    for amax, history, scale in steps:
        meta = update(meta, jnp.float32(amax))
        np.testing.assert_array_equal(np.asarray(meta.amax_history), history)
        assert meta.scale == scale and meta.dtype == E4M3 and meta.margin == 1
    # a non-finite amax keeps the scale while it is in the history
    for amax, history in [(np.inf, [np.inf, 0.25, 0.5]), (0.125, [0.125, np.inf, 0.25])]:
        meta = update(meta, jnp.float32(amax))
        np.testing.assert_array_equal(np.asarray(meta.amax_history), history)
        assert meta.scale == 224.0
    assert update(fp8_meta(E5M2, history=2), 0.0).scale == 1.0  # zero: the scale kept


# ---------------------------------------------------------------------------
# fp8_matmul


@pytest.fixture(scope="module")
def operands():
    """x: f32[2, 3, 32] (one column large, one tiny), w: f32[8, 32], cotangent c: f32[2, 3, 8]."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 32)).astype(F32)
    x[..., 0] *= 30.0
    x[..., 1] *= 1e-4
    w = (rng.standard_normal((8, 32)) * 0.02).astype(F32)
    c = (rng.standard_normal((2, 3, 8)) * 1e-3).astype(F32)
    return x, w, c


@pytest.fixture(scope="module")
def fp8_vjp():
    """`(y, dx, dw, dmeta)` of `fp8_matmul` for cotangent `c`, compiled once per scaling."""

    def run(x, w, c, meta):
        y, pull = jax.vjp(fp8_matmul, x, w, meta)
        return (y, *pull(c))

    return jax.jit(run)


def reference(x, w, c, sx, sw, sg):
    """`(y, dx, dw)` by the same arithmetic in NumPy, with the slack of each."""
    qx, qw, qg = np_quantize(x, sx, E4M3), np_quantize(w, sw, E4M3), np_quantize(c, sg, E5M2)
    terms = [(qx, qw, "...k,ok->...o", sx, sw), (qg, qw, "...o,ok->...k", sg, sw)]
    terms.append((qg, qx, "abo,abk->ok", sg, sx))
    return [(np_product(*t), accumulation_slack(*t)) for t in terms]


def assert_within(got, ref, slack):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    excess = np.abs(got - ref) - slack
    assert (excess <= 0).all(), f"worst excess {excess.max():.3g}"


def test_current_scaling_matches_numpy(operands, fp8_vjp):
    x, w, c = operands
    y, dx, dw, dmeta = fp8_vjp(x, w, c, None)
    assert dmeta is None and y.dtype == dx.dtype == dw.dtype == jnp.float32
    amax = lambda a: float(np.abs(a).max())  # noqa: E731
    sx, sw, sg = np_scale(amax(x), E4M3), np_scale(amax(w), E4M3), np_scale(amax(c), E5M2)
    for got, (ref, slack) in zip((y, dx, dw), reference(x, w, c, sx, sw, sg)):
        assert_within(got, ref, slack)


def test_delayed_scaling_matches_numpy_and_returns_the_updated_state(operands, fp8_vjp):
    x, w, c = operands
    fresh = fp8_matmul_meta(history=4)
    # earlier steps' amaxes: x's smaller than now (its large column saturates), w's and
    # the cotangent's larger (coarser steps than current scaling would take)
    meta = es.core.Fp8MatmulMeta(
        fp8_meta_update(fresh.x, 4.0),
        fp8_meta_update(fresh.w, 3.0),
        fp8_meta_update(fresh.grad, 1.0),
    )
    y, dx, dw, new = fp8_vjp(x, w, c, meta)
    sx, sw, sg = (float(m.scale) for m in (meta.x, meta.w, meta.grad))
    assert np_quantize(x, sx, E4M3).astype(F32).max() == 448.0  # saturation exercised
    for got, (ref, slack) in zip((y, dx, dw), reference(x, w, c, sx, sw, sg)):
        assert_within(got, ref, slack)
    for old, got, a in [(meta.x, new.x, x), (meta.w, new.w, w), (meta.grad, new.grad, c)]:
        want = fp8_meta_update(old, jnp.float32(np.abs(a).max()))
        np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(want.amax_history))
        assert got.scale == want.scale and got.dtype == old.dtype


def quantization_bound(a, b, contract, ua, ea, ub, eb):
    """Elementwise bound on |Σ âb̂ − Σ ab| for |â − a| ≤ ua|a| + ea, |b̂ − b| ≤ ub|b| + eb:
    Σ (|â−a|(|b| + |b̂−b|) + |a||b̂−b|), plus float32 accumulation."""
    a, b = np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))
    da, db = ua * a + ea, ub * b + eb
    bound = np.einsum(contract, da, b + db) + np.einsum(contract, a, db)
    k = max(a.shape[-1], int(np.prod(a.shape[:-1])))  # at least the terms summed
    return bound + (k + 2) * 2.0**-23 * np.einsum(contract, a + da, b + db)


def test_against_the_float32_product_within_the_fp8_bound(operands, fp8_vjp):
    """Round to nearest in the scaled domain: |x̂ − x| ≤ u|x| + η/s, with u = 2^-4 (e4m3)
    or 2^-3 (e5m2), η half the smallest subnormal; saturation cannot happen under
    current scaling (|x·s| ≤ max)."""
    x, w, c = operands
    y, dx, dw, _ = fp8_vjp(x, w, c, None)
    sx, sw, sg = (float(np_scale(np.abs(a).max(), t)) for a, t in ((x, E4M3), (w, E4M3), (c, E5M2)))
    ex, ew, eg = HALF_SUBNORMAL[E4M3] / sx, HALF_SUBNORMAL[E4M3] / sw, HALF_SUBNORMAL[E5M2] / sg
    u4, u5 = UNIT[E4M3], UNIT[E5M2]
    cases = [
        (y, x, w, "...k,ok->...o", u4, ex, u4, ew),
        (dx, c, w, "...o,ok->...k", u5, eg, u4, ew),
        (dw, c, x, "abo,abk->ok", u5, eg, u4, ex),
    ]
    for got, a, b, contract, ua, ea, ub, eb in cases:
        exact = np.einsum(contract, a.astype(np.float64), b.astype(np.float64))
        assert_within(got, exact, quantization_bound(a, b, contract, ua, ea, ub, eb))
        error = np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact)
        assert 1e-4 < error < 0.1  # quantized (not the float32 product), and close


def test_bf16_operands_and_dtypes_of_the_gradients():
    x = jnp.ones((4, 16), jnp.bfloat16)
    w = jnp.full((8, 16), 0.5, jnp.float32)
    y, pull = jax.vjp(fp8_matmul, x, w)
    dx, dw = pull(jnp.ones_like(y))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    # ones and halves are exact in fp8; the scales (448 / amax) are not powers of two
    for got, want in [(y, 8.0), (dx, 4.0), (dw, 4.0)]:
        np.testing.assert_allclose(
            np.asarray(got, F32), want, rtol=2.0**-8 if got.dtype == x.dtype else 2.0**-22
        )


def test_misconfigured_matmul_raises():
    with pytest.raises(es.LayerConfigError, match=r"x\(4, 16\) @ w\(8, 12\)"):
        fp8_matmul(jnp.ones((4, 16)), jnp.ones((8, 12)))
    with pytest.raises(es.LayerConfigError, match="float8_e4m3fn"):
        fp8_matmul(jnp.ones((4, 16), E4M3), jnp.ones((8, 16)))
    meta, w = fp8_matmul_meta(), jnp.ones((8, 16))
    with pytest.raises(es.LayerConfigError, match=r"vmap.*x\(16,\)"):
        jax.vmap(lambda x: fp8_matmul(x, w, meta))(jnp.ones((4, 16)))


_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)")


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_lowered_dots_take_fp8_operands(operands, delayed):
    """The lowered StableHLO's three dots: e4m3 × e4m3 forward, e5m2 × e4m3 for both
    gradients (on XLA:CPU the compiled program upcasts them; the GPU's fp8 GEMM path
    is checked on the GPU)."""
    x, w, c = operands
    meta = fp8_matmul_meta(2) if delayed else None
    loss = lambda x, w: jnp.sum(fp8_matmul(x, w, meta) * c)  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = sorted(m.groups() for m in _DOT.finditer(text))
    assert dots == [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN")]


# ---------------------------------------------------------------------------
# Inside shard_map: the one-device result on every layout

# name -> (layout, x spec, w spec, y spec, contraction split over "tp")
LAYOUTS = {
    "data8": ("dp=8", P("dp"), P(), P("dp"), False),
    "column4x2": ("dp=4,tp=2", P("dp"), P("tp"), P("dp", None, "tp"), False),
    "row2x4": ("dp=2,tp=4", P("dp", None, "tp"), P(None, "tp"), P("dp"), True),
}


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_equals_one_device(name, delayed):
    """Global amaxes (`pmax` over the axes an operand varies along) make the scales the
    one-device ones: value, gradients and new delayed state within fp32 tolerance."""
    layout, x_spec, w_spec, y_spec, row = LAYOUTS[name]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 2, 16)).astype(F32)  # global; local [8/dp, 2, 16 or 16/tp]
    w = (rng.standard_normal((8, 16)) * 0.1).astype(F32)  # global [out, in]
    c = rng.standard_normal((8, 2, 8)).astype(F32)
    meta = fp8_matmul_meta(history=2)
    meta = es.core.Fp8MatmulMeta(
        fp8_meta_update(meta.x, 2.0), meta.w, fp8_meta_update(meta.grad, 5.0)
    )
    meta = meta if delayed else None

    def local(x, w, meta):
        y = fp8_matmul(x, w, meta)  # [B/dp, S, out or out/tp]
        return jax.lax.psum(y, "tp") if row else y

    mesh = es.make_mesh(layout)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec, P()), out_specs=y_spec)

    def vjp(fn):
        def run(x, w, meta):
            y, pull = jax.vjp(fn, x, w, meta)
            return y, *pull(c)

        return jax.jit(run)

    assert_tree_allclose(vjp(sharded)(x, w, meta), vjp(fp8_matmul)(x, w, meta), rtol=FP32_RTOL)
