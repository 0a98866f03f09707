"""xLSTM-JAX's data- and pipeline-parallel functions against oracles of the reference.

`shard_params`, `gather_array_with_mean_grads`, `gather_params`, `shard_module_params`,
`sync_gradients`, `execute_pipeline_step`, `execute_pipeline`: values and gradients on
distinct per-device inputs, on axes of size 2, 3 (a 3-device sub-mesh) and 4, in the
reference's convention (a local loss per device), with `check_vma=False` and — where
the reference's result holds there — with JAX's default varying-axes check on. The
reference's own test of `gather_array_with_mean_grads` is ported and run both ways.
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
from equishard._axes import cast_varying
from equishard.core import (
    execute_pipeline,
    execute_pipeline_step,
    gather_array_with_mean_grads,
)
from equishard.nn import gather_params, shard_module_params

from . import seed_oracles as ref
from .helpers import assert_tree_allclose

SIZES = (2, 3, 4)


@functools.cache
def line_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def smap(fn, n, in_specs, out_specs, check_vma=False):
    return jax.jit(jax.shard_map(fn, mesh=line_mesh(n), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


# ------------------------------------------------------------------------ shard_params


def _shapes(n):
    """Shapes that probe the reference's rules on an axis of size n."""
    return {
        "tie": (2 * n, 2 * n),  # equal dimensions: the later one
        "tall": (4 * n, n),
        "wide": (n, 4 * n),
        "at_minimum": (6, 4),  # size 24 == min_weight_size: stays (size <= minimum)
        "above": (5, 5 * n),  # only the second dimension divides
        "odd": (5, 7),  # divisible nowhere
        "cube": (n, 2 * n, 2 * n),
    }


@pytest.mark.parametrize("n", SIZES)
def test_shard_params_follows_reference_rules(n):
    shapes = _shapes(n)
    tree = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(shapes.items())}
    specs_box = {}

    def local(tree):
        out = es.shard_params(tree, "x", 24)
        specs_box.update(es.specs_of(out))
        return jax.tree.map(lambda v: v[None], es.unbox(out))

    got = smap(local, n, (P(),), P("x"))(tree)
    for name, shape in shapes.items():
        dim = ref.shard_dimension(shape, (None,) * len(shape), n, 24)
        expected_spec = P() if dim is None else P(*("x" if d == dim else None for d in range(len(shape))))
        assert specs_box[name] == expected_spec, (name, specs_box[name], expected_spec)
        full = np.asarray(tree[name])
        for i in range(n):
            want = full if dim is None else np.split(full, n, axis=dim)[i]
            np.testing.assert_array_equal(np.asarray(got[name])[i], want, err_msg=name)


def test_shard_params_reads_the_local_block_inside_shard_map():
    # Inside shard_map the reference compares the size of the block in hand: a (16, 8)
    # array split over "y" (size 4) is a (4, 8) block of 32 elements there.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    box = es.Sharded(jnp.zeros((16, 8)), P("y", None))

    def local(b, min_weight_size):
        return es.specs_of(es.shard_params({"w": b}, "x", min_weight_size))["w"]

    seen = {}
    for minimum in (31, 32):
        fn = jax.shard_map(
            lambda b, m=minimum: (seen.__setitem__(m, local(b, m)), b.value)[1],
            mesh=mesh, in_specs=(P("y", None),), out_specs=P("y", None), check_vma=False,
        )
        fn(box)
    assert seen[31] == P("y", "x")  # 32 elements > 31: split, on the free dimension
    assert seen[32] == P("y", None)  # 32 <= 32: stays


# ------------------------------------------------------------------------ gather with mean grads


@functools.cache
def mean_grads_program(n, check_vma=False, gather_dtype=None, grad_scatter_dtype=None):
    def local(w, x):
        def loss(gather):
            def f(w):
                full = gather(w, 0, "x", gather_dtype, grad_scatter_dtype)
                return jnp.mean(jnp.tanh(x @ full.astype(jnp.float32)) ** 2), full

            (_, full), g = jax.value_and_grad(f, has_aux=True)(w)
            return full[None], g

        return loss(gather_array_with_mean_grads), loss(ref.gather_array_with_mean_grads)

    return smap(local, n, (P("x"), P("x")), P("x"), check_vma)


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_gather_array_with_mean_grads_matches_reference(n, check_vma):
    """xlstm_jax/distributed/data_parallel.py `gather_array_with_mean_grads`, a local loss
    per device; with the varying-axes check on too (the shard varies along the axis)."""
    w = jax.random.normal(jax.random.key(0), (2 * n, 3))
    x = jax.random.normal(jax.random.key(1), (4 * n, 2 * n))  # 4 distinct examples per device
    (ours, ours_g), (theirs, theirs_g) = mean_grads_program(n, check_vma)(w, x)
    np.testing.assert_array_equal(ours, theirs)
    assert_tree_allclose(ours_g, theirs_g)
    # And the local-loss convention's meaning: the gradient of the mean loss.
    assert_tree_allclose(ours_g, jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))


@functools.cache
def reference_test_grads(check_vma):
    """The gradients of xlstm-jax tests/distributed/test_data_parallel.py
    `test_gather_array_with_mean_grads_scatter_dtype` (smaller shapes; the six dtype
    combinations in one compiled program), its `shard_map` with or without the check."""
    n, hidden_per_device, batch, output = 4, 16, 32, 8
    combos = [(g, sc) for g in ("float32", "bfloat16") for sc in ("float32", "bfloat16", "float16")]

    def local(key):
        key = jax.random.fold_in(key, jax.lax.axis_index("x"))  # fold_rng_over_axis
        k_inp, k_tgt, k_w = jax.random.split(key, 3)
        inp = jax.random.normal(k_inp, (batch, hidden_per_device * n))
        targets = jax.random.normal(k_tgt, (batch, output))
        weight = jax.random.normal(k_w, (hidden_per_device, output))

        def grads(gather_dtype, grad_scatter_dtype):
            def loss_fn(params):
                params = gather_array_with_mean_grads(
                    params, axis=0, axis_name="x", gather_dtype=gather_dtype, grad_scatter_dtype=grad_scatter_dtype
                )
                out = inp @ params.astype(jnp.bfloat16)
                return ((out - targets) ** 2).mean()

            return jax.grad(loss_fn)(weight)

        return {f"{g}/{sc}": grads(g, sc) for g, sc in combos}

    out = smap(local, n, P(), P("x"), check_vma)(jax.random.key(0))
    return {tuple(k.split("/")): np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("check_vma", [False, True])
def test_reference_gather_dtype_and_grad_scatter_dtype(check_vma):
    """Port of xlstm-jax tests/distributed/test_data_parallel.py
    `test_gather_array_with_mean_grads_scatter_dtype`: its assertions, with `shard_map`'s
    check off and on (the reference's own test runs JAX's default, the check on), and the
    gradients with the check on identical to those with it off."""
    grads = reference_test_grads(check_vma)
    if check_vma:
        for combo, g in reference_test_grads(False).items():
            np.testing.assert_array_equal(grads[combo], g, err_msg=str(combo))
    np.testing.assert_allclose(grads["float32", "float32"], grads["bfloat16", "float32"])
    np.testing.assert_allclose(grads["float32", "bfloat16"], grads["bfloat16", "bfloat16"])
    assert not np.all(grads["float32", "float32"] == grads["float32", "bfloat16"])
    assert not np.all(grads["float32", "float32"] == grads["float32", "float16"])


# ------------------------------------------------------------------------ gather_params, the FSDP recipe


@pytest.mark.parametrize("n", SIZES)
def test_gather_params_averages_gradients_like_reference(n):
    w = jax.random.normal(jax.random.key(0), (4 * n, 2 * n))
    b = jax.random.normal(jax.random.key(1), (2 * n,))
    x = jax.random.normal(jax.random.key(2), (3 * n, 4 * n))

    def local(w, b, x):
        def ours(w, b):
            params = es.shard_params({"w": w, "b": b}, "x", 0)
            full = gather_params(params, "x")
            return jnp.mean(jnp.tanh(x @ full["w"] + full["b"][None]) ** 2)

        def theirs(w, b):
            (dw,) = [ref.shard_dimension(w.shape, (None, None), n, 0)]
            assert dw is not None
            i = jax.lax.axis_index("x")
            blk = w.shape[dw] // n
            w_local = jax.lax.dynamic_slice_in_dim(w, i * blk, blk, dw)
            b_local = jax.lax.dynamic_slice_in_dim(b, i * (b.shape[0] // n), b.shape[0] // n, 0)
            full_w = ref.gather_array_with_mean_grads(w_local, dw, "x")
            full_b = ref.gather_array_with_mean_grads(b_local, 0, "x")
            return jnp.mean(jnp.tanh(x @ full_w + full_b[None]) ** 2)

        return jax.value_and_grad(ours, (0, 1))(w, b), jax.value_and_grad(theirs, (0, 1))(w, b)

    (lo, go), (lt, gt) = smap(local, n, (P(), P(), P("x")), P())(w, b, x)
    assert_tree_allclose(lo, lt)
    assert_tree_allclose(go, gt)


class _MLP(eqx.Module):
    layers: list

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(12, 24, key=k1), eqx.nn.Linear(24, 12, key=k2)]

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x)))


@functools.cache
def recipe_program(n, check_vma=False):
    """xLSTM-JAX's FSDP recipe: shard_module_params, a local loss, sync_gradients; under
    the varying-axes check with the parameters first cast to vary along the axis (each
    device's gradient its own, as the reference's under check_vma=False)."""
    mesh = line_mesh(n)

    def local(model, x, t):
        def local_loss(model):
            return jnp.mean((jax.vmap(model)(x) - t) ** 2)

        if check_vma:
            model = cast_varying(model, ("x",))
        loss, grads = eqx.filter_value_and_grad(local_loss)(model)
        grads = es.sync_gradients(grads, ("x",))
        return jax.lax.pmean(loss, "x"), grads

    fn = es.filter_shard_map(local, mesh=mesh, in_specs=(None, P("x"), P("x")), out_specs=(P(), None), check_vma=check_vma)
    return eqx.filter_jit(fn)


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_shard_module_params_recipe_gives_single_device_gradients(n, check_vma):
    """xlstm_jax/distributed/data_parallel.py `shard_module_params` + `sync_gradients`,
    each device's local loss, with the check off (the reference's trainer) and on."""
    key = jax.random.key(7)
    plain = _MLP(key=key)
    sharded = es.sharded_init(lambda k: shard_module_params(_MLP(key=k), "x", 0), key, mesh=line_mesh(n))
    assert es.specs_of(sharded.module.layers[0].weight) == P("x", None)  # [24, 12]
    x = jax.random.normal(jax.random.key(8), (4 * n, 12))
    t = jax.random.normal(jax.random.key(9), (4 * n, 12))
    loss, grads = recipe_program(n, check_vma)(sharded, x, t)
    ref_loss, ref_grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - t) ** 2))(plain)
    assert_tree_allclose(loss, ref_loss)
    assert_tree_allclose(es.unbox(es.gather(grads.module)), ref_grads)


@pytest.mark.parametrize("n", SIZES)
def test_sync_gradients_matches_reference(n):
    dp = 2 if 2 * n <= len(jax.devices()) else 1
    mesh = Mesh(np.array(jax.devices()[: dp * n]).reshape(dp, n), ("dp", "x"))
    g = jax.random.normal(jax.random.key(n), (dp * n, 6, 4))  # a distinct gradient per device

    def local(g):
        g = g[0]
        tree = {"replicated": g, "split_x": es.Sharded(g, P("x", None)), "split_both": es.Sharded(g, P(("dp", "x")))}
        ours = es.unbox(es.sync_gradients(tree, ("dp", "x")))
        theirs = ref.sync_gradients(
            {"replicated": (g, ()), "split_x": (g, ("x",)), "split_both": (g, ("dp", "x"))}, ("dp", "x")
        )
        return jax.tree.map(lambda a: a[None], (ours, theirs))

    fn = jax.shard_map(local, mesh=mesh, in_specs=P(("dp", "x")), out_specs=P(("dp", "x")), check_vma=False)
    ours, theirs = jax.jit(fn)(g)
    assert_tree_allclose(ours, theirs)
    assert_tree_allclose(ours["replicated"][0], g.mean(0))


def test_local_loss_functions_refuse_only_what_the_check_makes_wrong():
    """Under the varying-axes check the local-loss functions refuse what cannot be the
    reference's result (data_parallel.py's `gather_array_with_mean_grads` on a replicated
    array, `sync_gradients` of a gradient JAX already summed), and the train step refuses
    shard_module_params (mean gradients under its global loss)."""
    mesh = line_mesh(2)
    replicated = jax.shard_map(
        lambda w: gather_array_with_mean_grads(w, 0, "x"), mesh=mesh, in_specs=P(), out_specs=P()
    )
    with pytest.raises(es.ConventionError, match=r"gather_array_with_mean_grads: .*shape \(4, 2\) is invariant along 'x'"):
        replicated(jnp.ones((4, 2)))
    # gather_params of shard_params's shards: varying, the reference's gradient.
    sharded = jax.shard_map(
        lambda w: gather_params(es.shard_params({"w": w}, "x", 0), "x")["w"], mesh=mesh, in_specs=P(), out_specs=P("x")
    )
    assert sharded(jnp.ones((4, 2))).shape == (8, 2)  # each device's gathered copy

    def synced(w, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))({"w": w})
        return es.sync_gradients(grads, ("x",))["w"]

    fn = jax.shard_map(synced, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    with pytest.raises(es.ConventionError, match=r"sync_gradients: the gradient `\['w'\]` \(shape \(2, 2\)\) is invariant along 'x'.*pcast"):
        fn(jnp.ones((2, 2)), jnp.ones((4, 2)))

    import optax

    from equishard.train import init_train_state, make_train_step

    model_fn = lambda k: shard_module_params(eqx.nn.Linear(4, 4, key=k), "x", 0)
    state = init_train_state(model_fn, optax.sgd(0.1), jax.random.key(0), mesh=mesh)
    loss_fn = lambda m, b, k: (jax.lax.pmean(jnp.mean(jax.vmap(m)(b) ** 2), "x"), {})
    step = make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, batch_spec=P("x"))
    with pytest.raises(es.ConventionError, match=r"make_train_step: the model holds an FSDP unit with mean_grads=True"):
        step(state, jnp.ones((4, 4)))


# ------------------------------------------------------------------------ pipeline


@functools.cache
def pipeline_program(n, m):
    def local(w, x, ct):
        # w: this device's stage weights f32[1, D, D]
        def one_step(impl, w, x):
            stage = lambda h: jnp.tanh(h @ w[0])
            state = jnp.full_like(x, 0.5)
            return impl(stage, state, x, model_axis_name="x")

        def pipe(impl, w, x):
            stage = lambda h: jnp.tanh(h @ w[0])
            return impl(stage, x, num_microbatches=m, model_axis_name="x")

        results = {}
        for who, step_impl, pipe_impl in (
            ("ours", execute_pipeline_step, execute_pipeline),
            ("ref", ref.execute_pipeline_step, ref.execute_pipeline),
        ):
            (new_state, out), vjp = jax.vjp(functools.partial(one_step, step_impl), w, x)
            step_grads = vjp((ct[0, : x.shape[0]], ct[0, : x.shape[0]]))
            y, vjp = jax.vjp(functools.partial(pipe, pipe_impl), w, x)
            pipe_grads = vjp(ct[0])
            results[who] = (new_state[None], out[None], step_grads, y[None], pipe_grads)
        return results

    return smap(local, n, (P("x"), P(), P("x")), P("x"))


@pytest.mark.parametrize("n", SIZES)
def test_pipeline_functions_match_reference(n):
    m, b, d = 2 * n, 2, 4
    w = jax.random.normal(jax.random.key(0), (n, d, d))  # one stage per device
    x = jax.random.normal(jax.random.key(1), (m * b, d))
    ct = jax.random.normal(jax.random.key(2), (n, m * b, d))
    out = pipeline_program(n, m)(w, x, ct)
    ours, theirs = out["ours"], out["ref"]
    for a, r, what in zip(ours, theirs, ("state", "step output", "step grads", "pipeline", "pipeline grads")):
        try:
            assert_tree_allclose(a, r)
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}") from None
    step_output = np.asarray(ours[1])  # zero on every stage but the last
    assert not step_output[:-1].any() and step_output[-1].any()
