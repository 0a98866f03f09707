"""TPDense / TPAsyncDense: feature-split tensor parallelism as in the xLSTM library.

Against the single-device dense layers (values, every gradient) and against an oracle
written from xlstm-jax's `TPDense` / `TPAsyncDense` (xlstm_jax/distributed/
tensor_parallel.py: values and input gradients, and `TPAsyncDense`'s "scatter"
parameters, one `[in/n, out/n]` kernel per ring step), on axes of size 2, 3 (a
sub-mesh) and 4 and on dp=2 x tp=4; one compiled program per mesh holds every layer.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import equishard as es
from equishard.nn import Dense, TPAsyncDense, TPDense
from equishard.report import count_collectives, read_collectives

from . import seed_oracles as ref
from .helpers import OPTIMISED, assert_tree_allclose

B, T, D, F = 2, 5, 24, 48  # T odd: no constraint on the tokens
SIZES = (2, 3, 4)
VARIANTS = {  # name: (class, kwargs)
    "sync": (TPDense, {}),
    "async_uni": (TPAsyncDense, {"use_bidirectional_gather": False, "use_bidirectional_scatter": False}),
    "async_bi": (TPAsyncDense, {"use_bidirectional_gather": True, "use_bidirectional_scatter": True}),
}


@functools.cache
def mesh_of(n: int, dp: int = 1) -> Mesh:
    return Mesh(np.array(jax.devices()[: n * dp]).reshape(dp, n), ("dp", "tp"))


def build(n, dp=1):
    """For each variant, a gather layer D -> F and a scatter layer F -> D (same keys).

    "scatter" takes `TPDense`'s `Dense(F // n, D)` and, as xlstm-jax's `TPAsyncDense`
    (`dense_fn(name=f"shard_{i}")` per ring step), `TPAsyncDense`'s `Dense(F // n, D // n)`.
    """
    kg, ks = jax.random.split(jax.random.key(3))

    def make():
        layers = {}
        for name, (cls, kw) in VARIANTS.items():
            up = cls(functools.partial(Dense, D, F // n), "tp", "gather", kernel_init_adjustment=0.5, key=kg, **_gather_kw(kw))
            out = D if cls is TPDense or n == 1 else D // n
            down = cls(functools.partial(Dense, F // n, out), "tp", "scatter", key=ks, **_scatter_kw(kw))
            layers[name] = (up, down)
        return layers

    # Bit-equal kernels (test_tp_dense_matches_reference_oracle): compiled as users do.
    layers = es.sharded_init(lambda: make(), mesh=mesh_of(n, dp), compiler_options=OPTIMISED)
    # Non-zero biases, the same for every variant.
    kb = jax.random.key(4)
    bias_up = jax.random.normal(kb, (F,))
    bias_down = jax.random.normal(jax.random.fold_in(kb, 1), (D,))
    out = {}
    for k, (up, down) in layers.items():
        up = eqx.tree_at(lambda m: m.dense["module"].bias.value, up, es.shard(bias_up, mesh_of(n, dp), P("tp")))
        if "shard_0" in down.dense:  # the reference's layout: device j holds its ring step 0's
            stored = ref_scatter_bias(bias_down, n, down.use_bidirectional_scatter)
            down = eqx.tree_at(lambda m: m.dense["shard_0"].bias.value, down, es.shard(stored, mesh_of(n, dp), P("tp")))
        else:
            down = eqx.tree_at(lambda m: m.dense["module"].bias.value, down, es.shard(bias_down, mesh_of(n, dp), P("tp")))
        out[k] = (up, down)
    return out


def _scatter_destinations(n, k, j, bidirectional):
    """Where device j's ring step k output goes, from tensor_parallel.py's `async_scatter`
    (`xs[k]` is shifted up k + 1 times) and `async_scatter_split` (first part up, rest down)."""
    return (j - k - 1) % n, ((j + k + 1) % n if bidirectional else (j - k - 1) % n)


def ref_scatter_bias(bias, n, bidirectional):
    """shard_0's bias on each device (the reference adds it before the scatter), as [out]."""
    blocks = np.split(np.asarray(bias), n)
    half = len(blocks[0]) // 2 if bidirectional else len(blocks[0])
    rows = []
    for j in range(n):
        lo, hi = _scatter_destinations(n, 0, j, bidirectional)
        rows.append(np.concatenate([blocks[lo][:half], blocks[hi][half:]]))
    return jnp.asarray(np.concatenate(rows))


def ref_scatter_kernels(kernel, n, bidirectional):
    """Each device's per-ring-step kernels `[n devices, n steps, in/n, out/n]` of the global
    `[in, out]`: device j's step k computes the output block(s) it sends on."""
    rows = np.split(np.asarray(kernel), n, axis=0)
    c = kernel.shape[1] // n
    half = c // 2 if bidirectional else c
    out = np.zeros((n, n, kernel.shape[0] // n, c), np.float32)
    for j in range(n):
        cols = np.split(rows[j], n, axis=1)
        for k in range(n):
            lo, hi = _scatter_destinations(n, k, j, bidirectional)
            out[j, k] = np.concatenate([cols[lo][:, :half], cols[hi][:, half:]], axis=1)
    return out


def scatter_global(layer):
    """The global kernel and bias a "scatter" layer computes with, from its stored arrays."""
    if "shard_0" not in layer.dense:
        m = layer.dense["module"]
        return m.kernel.value, m.bias.value
    n, bi = len(layer.dense), layer.use_bidirectional_scatter
    stored = np.stack([np.split(np.asarray(layer.dense[f"shard_{k}"].kernel.value), n) for k in range(n)], 1)
    b_stored = np.split(np.asarray(layer.dense["shard_0"].bias.value), n)
    r, c = stored.shape[2:]
    half = c // 2 if bi else c
    kernel, bias = np.zeros((n * r, n * c), np.float32), np.zeros((n * c,), np.float32)
    for j in range(n):
        for k in range(n):
            lo, hi = _scatter_destinations(n, k, j, bi)
            kernel[j * r : (j + 1) * r, lo * c : lo * c + half] = stored[j, k][:, :half]
            kernel[j * r : (j + 1) * r, hi * c + half : (hi + 1) * c] = stored[j, k][:, half:]
            if k == 0:
                bias[lo * c : lo * c + half] = b_stored[j][:half]
                bias[hi * c + half : (hi + 1) * c] = b_stored[j][half:]
    return jnp.asarray(kernel), jnp.asarray(bias)


def _gather_kw(kw):
    return {k: v for k, v in kw.items() if k == "use_bidirectional_gather"}


def _scatter_kw(kw):
    return {k: v for k, v in kw.items() if k == "use_bidirectional_scatter"}


def global_params(layer):
    if layer.tp_mode == "scatter":
        return scatter_global(layer)
    m = layer.dense["module"]
    return m.kernel.value, m.bias.value


def single_device(params, x):
    (k1, b1), (k2, b2) = params
    h = jax.nn.gelu(x @ k1 + b1[None, None])
    return h @ k2 + b2[None, None]


@functools.cache
def program(n, dp):
    mesh = mesh_of(n, dp)

    def body(layers, x, probe):
        def loss(layers, x):
            outs = {}
            for name, (up, down) in layers.items():
                # f32[B/dp, T, D/tp] -> f32[B/dp, T, F/tp] -> f32[B/dp, T, D/tp]
                outs[name] = down(jax.nn.gelu(up(x)))
            total = sum(jnp.sum(o * probe) for o in outs.values())
            return jax.lax.psum(total, ("dp", "tp")), outs

        (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layers, x)
        return outs, grads

    spec = P("dp", None, "tp")
    fn = es.filter_shard_map(body, mesh=mesh, in_specs=(None, spec, spec), out_specs=({k: spec for k in VARIANTS}, (None, spec)))
    return eqx.filter_jit(fn)


@pytest.mark.parametrize("n,dp", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_tp_mlp_gather_then_scatter_equals_single_device(n, dp):
    layers = build(n, dp)
    x = jax.random.normal(jax.random.key(5), (B * dp, T, D))
    probe = jax.random.normal(jax.random.key(6), (B * dp, T, D))
    outs, (grads, x_grad) = program(n, dp)(layers, x, probe)
    params = tuple(global_params(l) for l in layers["sync"])
    want, vjp = jax.vjp(single_device, params, x)
    want_params, want_x = vjp(probe)
    for name in VARIANTS:
        assert_tree_allclose(outs[name], want)
        got = tuple(global_params(l) for l in es.gather(grads[name]))
        assert_tree_allclose(got, want_params)
    # The input's gradient sums the variants' (each contributes the same).
    assert_tree_allclose(x_grad, len(VARIANTS) * want_x)


def test_tp_dense_kernel_is_mesh_invariant_and_adjusted():
    a, b = build(2)["sync"][0], build(4)["sync"][0]
    assert_tree_allclose(global_params(a)[0], global_params(b)[0])
    lecun = jax.nn.initializers.lecun_normal()(jax.random.split(jax.random.key(3))[0], (D, F))
    assert_tree_allclose(global_params(a)[0], 0.5 * lecun)  # kernel_init scaled by the adjustment
    # "none" mode (and an axis of size 1) uses kernel_init without the adjustment.
    none = TPDense(functools.partial(Dense, D, F), "tp", "none", kernel_init_adjustment=0.5, key=jax.random.key(0))
    one = es.sharded_init(
        lambda: TPDense(functools.partial(Dense, D, F), "tp", "gather", kernel_init_adjustment=0.5, key=jax.random.key(0)),
        mesh=mesh_of(1),
    )
    plain = jax.nn.initializers.lecun_normal()(jax.random.key(0), (D, F))
    assert_tree_allclose(global_params(none)[0], plain)
    assert_tree_allclose(global_params(one)[0], plain)
    assert one.tp_mode == "none" and all(e is None for e in es.specs_of(one.dense["module"].kernel))


# --------------------------------------------------------------------------- the reference's oracle


def _blocks(a, n, dim):
    return np.split(np.asarray(a), n, axis=dim)


@functools.cache
def oracle_program(n):
    mesh = mesh_of(n)

    def body(layers, x, up_k, dn_k, dn_k_split, dn_b, dn_b_split):
        # ours
        def ours(x, name):
            up, down = layers[name]
            return down(jax.nn.gelu(up(x)))

        # the reference's computation with each device's kernels given explicitly
        (kg, bg), (ks, bs) = [(l.dense["module"].kernel.value, l.dense["module"].bias.value) for l in layers["sync"]]
        first = (jax.lax.axis_index("tp") == 0).astype(x.dtype)

        def ref_sync(x):
            h = jax.nn.gelu(jax.lax.all_gather(x, "tp", axis=x.ndim - 1, tiled=True) @ kg + bg[None, None])
            y = h @ ks + first * jax.lax.all_gather(bs, "tp", tiled=True)[None, None]  # the bias once
            return jax.lax.psum_scatter(y, "tp", scatter_dimension=y.ndim - 1, tiled=True)

        def ref_async(x, bidirectional):
            gather = ref.async_gather_bidirectional if bidirectional else ref.async_gather
            xs = gather(x, "tp")
            h = jax.nn.gelu(sum(xk @ up_k[0, k] for k, xk in enumerate(xs)) + bg[None, None])
            # TPAsyncDense "scatter": shard_i's dense per ring step, use_bias=(i == 0)
            kernels, bias = (dn_k_split, dn_b_split) if bidirectional else (dn_k, dn_b)
            ys = [h @ kernels[0, k] + (bias[0][None, None] if k == 0 else 0.0) for k in range(n)]
            return (ref.async_scatter_split if bidirectional else ref.async_scatter)(ys, "tp")

        res = {}
        for name, fn in (
            ("sync", ref_sync),
            ("async_uni", lambda x: ref_async(x, False)),
            ("async_bi", lambda x: ref_async(x, True)),
        ):
            o, vjp_o = jax.vjp(functools.partial(ours, name=name), x)
            r, vjp_r = jax.vjp(fn, x)
            res[name] = (o, r, vjp_o(jnp.ones_like(o))[0], vjp_r(jnp.ones_like(r))[0])
        return res

    spec = P(None, None, "tp")
    in_specs = (None, spec, P("tp"), P("tp"), P("tp"), P("tp"), P("tp"))
    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("n", SIZES)
def test_tp_dense_matches_reference_oracle(n):
    """xlstm_jax/distributed/tensor_parallel.py `TPDense.__call__` / `TPAsyncDense.__call__`:
    values, input gradients and (`TPAsyncDense` "scatter") each device's `shard_i` kernels."""
    layers = build(n)
    (kg, _), (ks, bs) = [global_params(l) for l in layers["sync"]]
    rows = _blocks(kg, n, 0)  # kg: [D, F]; rows of device d: [D/n, F]
    up_k = np.stack([[_blocks(rows[(i - k) % n], n, 1)[i] for k in range(n)] for i in range(n)])
    dn_k, dn_k_split = ref_scatter_kernels(ks, n, False), ref_scatter_kernels(ks, n, True)
    dn_b = np.asarray(ref_scatter_bias(bs, n, False)).reshape(n, -1)
    dn_b_split = np.asarray(ref_scatter_bias(bs, n, True)).reshape(n, -1)
    # The reference's parameter layout: shard_k's kernel on device j is [in/n, out/n].
    for name, kernels in (("async_uni", dn_k), ("async_bi", dn_k_split)):
        down = layers[name][1]
        assert sorted(down.dense) == [f"shard_{k}" for k in range(n)]
        assert all(down.dense[f"shard_{k}"].bias is None for k in range(1, n))
        for k in range(n):
            stored = np.split(np.asarray(down.dense[f"shard_{k}"].kernel.value), n)
            np.testing.assert_array_equal(np.stack(stored), kernels[:, k])
    x = jax.random.normal(jax.random.key(8), (B, T, D))
    res = oracle_program(n)(layers, x, up_k, dn_k, dn_k_split, dn_b, dn_b_split)
    for o, r, go, gr in res.values():
        assert_tree_allclose(o, r)
        assert_tree_allclose(go, gr)


@functools.cache
def odd_program(n):
    def body(layer, x, ct):
        y, vjp = jax.vjp(lambda layer, x: layer(x), layer, x)
        return y, vjp(ct)

    spec = P(None, "tp")
    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh_of(n), in_specs=(None, spec, spec), out_specs=(spec, (None, spec))))


@pytest.mark.parametrize("n", SIZES)
def test_tp_async_dense_bidirectional_scatter_with_odd_local_features(n):
    """xlstm_jax/distributed/tensor_parallel.py `TPAsyncDense.__call__` with
    `use_bidirectional_scatter=True` and `async_scatter_split`'s `_split`
    (`x[..., :d // 2]` up, `x[..., d // 2:]` down): 3 output features per device."""
    out = 3 * n
    layer = es.sharded_init(
        lambda: TPAsyncDense(functools.partial(Dense, F // n, 3), "tp", "scatter", use_bidirectional_scatter=True, key=jax.random.key(11)),
        mesh=mesh_of(n),
    )
    bias = jax.random.normal(jax.random.key(12), (out,))
    layer = eqx.tree_at(lambda m: m.dense["shard_0"].bias.value, layer, es.shard(ref_scatter_bias(bias, n, True), mesh_of(n), P("tp")))
    x = jax.random.normal(jax.random.key(13), (T, F))
    ct = jax.random.normal(jax.random.key(14), (T, out))
    y, (g_layer, g_x) = odd_program(n)(layer, x, ct)
    kernel, b = global_params(es.gather(layer))
    assert_tree_allclose(b, bias)
    want, vjp = jax.vjp(lambda k, b, x: x @ k + b[None], kernel, b, x)
    want_k, want_b, want_x = vjp(ct)
    assert_tree_allclose(y, want)
    assert_tree_allclose(g_x, want_x)
    assert_tree_allclose(global_params(es.gather(g_layer)), (want_k, want_b))
    # Outside shard_map the layer is the dense layer on the same global kernel.
    assert_tree_allclose(eqx.filter_jit(lambda m, x: m(x))(es.gather(layer), x), want)


def test_tp_async_dense_compiles_to_collective_permutes_only():
    layers = {k: v for k, v in build(4).items() if k != "sync"}
    x = jax.random.normal(jax.random.key(5), (B, T, D))
    fn = program_async_only()
    counts = count_collectives(read_collectives(fn.lower(layers, x).compile()))
    assert counts.get("collective-permute", 0) > 0, counts
    assert "all-gather" not in counts and "reduce-scatter" not in counts, counts


@functools.cache
def program_async_only():
    spec = P(None, None, "tp")

    def body(layers, x):
        def loss(layers, x):
            return jax.lax.psum(sum(jnp.sum(down(jax.nn.gelu(up(x))) ** 2) for up, down in layers.values()), "tp")

        return jax.grad(loss, argnums=(0, 1))(layers, x)

    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh_of(4), in_specs=(None, spec), out_specs=(None, spec)))


def test_configuration_errors_name_the_layer_and_value():
    key = jax.random.key(0)
    dense = functools.partial(Dense, D, F)
    with pytest.raises(es.LayerConfigError, match=r"TPDense: unknown tp_mode 'scater'"):
        TPDense(dense, "tp", "scater", key=key)
    with pytest.raises(es.LayerConfigError, match=r"TPAsyncDense: unknown tp_mode 'Gather'"):
        TPAsyncDense(dense, "tp", "Gather", key=key)
    with pytest.raises(es.LayerConfigError, match=r"TPDense: dense_fn is configured with the local sizes"):
        TPDense(dense, "tp", "gather", key=key)  # no mesh to read the axis size from
    with pytest.raises(es.LayerConfigError, match=r"dense_fn must build a module with a `kernel`"):
        TPDense(lambda kernel_init, key: eqx.nn.Linear(D, F, key=key), "tp", "none", key=key)
    # An input that is not split over features as the layer expects: refused at trace time.
    layer = es.sharded_init(lambda: TPDense(functools.partial(Dense, D, F // 4), "tp", "gather", key=key), mesh=mesh_of(4))
    fn = es.filter_shard_map(lambda layer, x: layer(x), mesh=mesh_of(4), in_specs=(None, P()), out_specs=P(None, "tp"))
    with pytest.raises(es.LayerConfigError, match=r"TPDense: tp_mode='gather' takes an input split over features"):
        jax.eval_shape(fn, layer, jnp.ones((3, D)))
