"""FSDP (ZeRO-3) and its composition with data and tensor parallelism.

Every layout is checked against single-device training: loss, gradients and the
parameters after three adamw steps, under both gradient conventions; memory is read
from the devices' shards and the compiler's memory analysis; communication from the
compiled program with the core's HLO reader.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import mp_copy, mp_reduce
from equishard.nn import FSDP, fsdp_gather_params, gather_params
from equishard.report import collective_bytes, count_collectives, read_collectives

from .helpers import assert_tree_allclose, primitive_counts

D, F, B, DEPTH = 16, 64, 32, 3


class Block(eqx.Module):
    """A user's residual MLP block, tensor parallel over "tp" (size 1 = plain)."""

    w1: es.Sharded
    b1: es.Sharded
    w2: es.Sharded
    b2: jax.Array
    scale: jax.Array

    def __init__(self, f: int = F, *, key):
        k1, k2 = jax.random.split(key)
        self.w1 = es.Sharded(jax.random.normal(k1, (D, f)) / D**0.5, P(None, "tp"))
        self.b1 = es.Sharded(jnp.zeros(f), P("tp"))
        self.w2 = es.Sharded(jax.random.normal(k2, (f, D)) / f**0.5, P("tp", None))
        self.b2 = jnp.full((D,), 0.1)
        self.scale = jnp.ones(D)

    def __call__(self, x):
        # Megatron's conjugate operators, so that the block is also right without the
        # varying-axes check (the seeds' local-loss convention runs that way).
        x_tp = mp_copy(x, axis_name="tp")
        h = jax.nn.relu(x_tp @ self.w1.value + jnp.asarray(self.b1.value)[None])  # f32[B/d, D] @ f32[D, F/tp]
        y = mp_reduce(h @ self.w2.value, axis_name="tp") + self.b2[None]  # f32[B/d, F/tp] @ f32[F/tp, D]
        return x + y * self.scale[None]


class Model(eqx.Module):
    blocks: list

    def __init__(self, *, key, min_weight_size=0, depth=DEPTH, f=F, **fsdp):
        self.blocks = [
            FSDP(Block(f, key=k), "fsdp", min_weight_size=min_weight_size, **fsdp)
            for k in jax.random.split(key, depth)
        ]

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def reference_loss(model: Model, x, t):
    """Single-device loss on global arrays, written without any equishard layer."""
    for fsdp in model.blocks:
        blk = es.unbox(fsdp.module)
        h = jax.nn.relu(x @ blk.w1 + blk.b1[None])
        x = x + (h @ blk.w2 + blk.b2[None]) * blk.scale[None]
    return jnp.mean((x - t) ** 2)


def global_loss(model: Model, x, t, data_axes):
    return jax.lax.pmean(jnp.mean((model(x) - t) ** 2), data_axes)


def local_loss(model: Model, x, t):
    return jnp.mean((model(x) - t) ** 2)


LAYOUTS = {
    # layout: the data axes (batch split over them)
    "fsdp=2,tp=1": ("fsdp",),
    "fsdp=4,tp=1": ("fsdp",),
    "fsdp=8,tp=1": ("fsdp",),
    "fsdp=4,tp=2": ("fsdp",),
    "dp=2,fsdp=2,tp=2": ("dp", "fsdp"),
}


def _data():
    x = jax.random.normal(jax.random.key(1), (B, D))
    t = jax.random.normal(jax.random.key(2), (B, D))
    return x, t


def _params(model):
    return eqx.filter(model, eqx.is_array)


@functools.cache
def _train_step(layout: str, convention: str):
    mesh = es.make_mesh(layout)
    data = LAYOUTS[layout]
    all_axes = tuple(mesh.axis_names)
    optimizer = optax.adamw(1e-2)

    @eqx.filter_jit
    def step(model, opt_state, x, t):
        # The seeds' local-loss convention predates the varying-axes types: with the
        # check on, autodiff already sums replicated parameters' gradients (DESIGN).
        @es.filter_shard_map(
            mesh=mesh,
            in_specs=(None, None, P(data), P(data)),
            out_specs=(None, None, P(), None),
            check_vma=convention == "global",
        )
        def inner(model, opt_state, x, t):
            if convention == "global":
                loss, grads = eqx.filter_value_and_grad(global_loss)(model, x, t, data)
            else:  # the seeds' local-loss convention
                loss, grads = eqx.filter_value_and_grad(local_loss)(model, x, t)
                grads = es.sync_gradients(grads, all_axes)
                loss = jax.lax.pmean(loss, data)
            updates, opt_state = optimizer.update(grads, opt_state, _params(model))
            return eqx.apply_updates(model, updates), opt_state, loss, grads

        return inner(model, opt_state, x, t)

    def init(key):
        mean_grads = convention == "local"
        model = es.sharded_init(lambda k: Model(key=k, mean_grads=mean_grads), key, mesh=mesh)
        return model, es.shard(optimizer.init(_params(model)), mesh)

    return mesh, init, step, optimizer


@contextlib.contextmanager
def _replicated_on_purpose():
    """Silence FSDP's warning for units built to split nothing (the baselines)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP over 'fsdp' splits 0 of", category=UserWarning)
        yield


def _reference_training(steps: int):
    one = es.make_mesh("fsdp=1,tp=1")
    make = lambda k: Model(key=k, min_weight_size=2**30)  # noqa: E731  (nothing split)
    with _replicated_on_purpose():
        model = es.gather(es.sharded_init(make, jax.random.key(0), mesh=one))
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(_params(model))
    x, t = _data()
    history = []
    for _ in range(steps):
        loss, grads = eqx.filter_value_and_grad(reference_loss)(model, x, t)
        updates, opt_state = optimizer.update(grads, opt_state, _params(model))
        model = eqx.apply_updates(model, updates)
        history.append((loss, grads, model))
    return history


CASES = [(layout, "global") for layout in LAYOUTS] + [
    # The seeds' local-loss convention (mean_grads + sync_gradients), on a 1-D and a
    # 3-D mesh.
    ("fsdp=8,tp=1", "local"),
    ("dp=2,fsdp=2,tp=2", "local"),
]


@pytest.mark.parametrize("layout,convention", CASES)
def test_fsdp_training_equals_single_device(layout, convention):
    mesh, init, step, _ = _train_step(layout, convention)
    model, opt_state = init(jax.random.key(0))
    # Every array of the blocks is split over fsdp (min_weight_size=0, all divisible).
    specs = es.specs_of(model.blocks[0].module)
    assert specs.w1 == P("fsdp", "tp") and specs.w2 == P("tp", "fsdp")
    assert specs.b1 == P("tp")  # its one dimension is already split (tensor parallel)
    assert specs.b2 == P("fsdp") and specs.scale == P("fsdp")
    x, t = _data()
    reference = _reference_training(3)
    for i in range(3):
        model, opt_state, loss, grads = step(model, opt_state, x, t)
        ref_loss, ref_grads, ref_model = reference[i]
        assert_tree_allclose(loss, ref_loss)
        got = [es.unbox(es.gather(b.module)) for b in grads.blocks]
        want = [es.unbox(b.module) for b in ref_grads.blocks]
        assert_tree_allclose(got, want)
    got = [es.unbox(es.gather(b.module)) for b in model.blocks]
    assert_tree_allclose(got, [es.unbox(b.module) for b in reference[-1][2].blocks])


def _assert_unit_equals_plain(wrapped, plain, x, mesh):
    """`wrapped` (an FSDP unit over "fsdp") gives `plain`'s mean-square loss and
    gradients on the examples `x`, split over "fsdp"."""

    def loss(m, x):
        return jax.lax.pmean(jnp.mean(jax.vmap(m)(x) ** 2), "fsdp")

    sharded = es.filter_shard_map(loss, mesh=mesh, in_specs=(None, P("fsdp")), out_specs=P())
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(sharded))(wrapped, x)
    ref_value, ref_grads = eqx.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(plain, x)
    assert_tree_allclose(value, ref_value)
    assert_tree_allclose(es.unbox(es.gather(grads.module)), ref_grads)


def test_fsdp_wraps_an_unmodified_equinox_module():
    """An eqx.nn.MLP, which knows nothing of equishard, fully sharded by one call."""
    mesh = es.make_mesh("fsdp=8")
    key = jax.random.key(3)
    mlp = eqx.nn.MLP(16, 8, 64, depth=2, key=key)
    wrapped = es.sharded_init(
        lambda k: FSDP(eqx.nn.MLP(16, 8, 64, depth=2, key=k), "fsdp", min_weight_size=0), key, mesh=mesh
    )
    assert isinstance(wrapped.module.layers[0].weight, es.sharding.AutoSharded)
    assert wrapped.module.layers[0].weight.spec == P("fsdp", None)  # [64, 16]: 64 is larger
    x = jax.random.normal(jax.random.key(4), (32, 16))

    _assert_unit_equals_plain(wrapped, mlp, x, mesh)


class _ScannedLayers(eqx.Module):
    """A user's module that scans its own layers (`jax.nn.silu` is a nested `jit`)."""

    weights: jax.Array  # [L, D, D]

    def __call__(self, x):
        def layer(h, w):
            return jax.nn.silu(h @ w), None

        return jax.lax.scan(layer, x, self.weights)[0]


@pytest.mark.parametrize("layout", ["fsdp=2", "fsdp=8"])
def test_fsdp_unit_with_a_scan_inside_equals_single_device(layout):
    """The unit's backward pass differentiates what it recomputes; a scan over the
    parameters inside it (its JVP a scan of primals and tangents together) gives the
    one-device gradients as a plain block does."""
    mesh = es.make_mesh(layout)
    plain = _ScannedLayers(jax.random.normal(jax.random.key(5), (3, 16, 16)) / 4)
    wrapped = es.sharded_init(lambda k: FSDP(plain, "fsdp", min_weight_size=0), jax.random.key(0), mesh=mesh)
    x = jax.random.normal(jax.random.key(6), (32, 16))

    _assert_unit_equals_plain(wrapped, plain, x, mesh)


@pytest.mark.parametrize("layout", ["fsdp=8", "fsdp=4,tp=2"])
def test_scan_units_equals_the_plain_scan(layout):
    """The reference GPT's stacked regathering units scanned as one (`scan_units`, a
    custom VJP over the scan) give the plain `lax.scan`'s values and gradients, of the
    parameters and of the input; on `tp` the kept all-reduces are replayed."""
    from equishard.models import GPT, GPTConfig
    from equishard.nn._internal import scan_units, scannable

    mesh = es.make_mesh(layout)
    config = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=3, d_ff=64)
    par = es.Layout(layout).resolve(8)
    units = es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(0), mesh=mesh).units
    x = jax.random.normal(jax.random.key(1), (16, 8, 32))

    def loss(operands, as_one):
        units, x = operands
        params, static = eqx.partition(units, eqx.is_array)
        if as_one:
            assert scannable(params, static, x)
            h, aux = scan_units(params, static, x, None)
        else:
            call = lambda h, layer: es.drop_leading_axis(eqx.combine(layer, static))(h, None)  # noqa: E731
            h, aux = jax.lax.scan(call, x, params)
        return jax.lax.pmean(jnp.mean(h**2) + jnp.sum(aux.load_balancing_loss), "fsdp")

    def value_and_grad(as_one):
        sharded = es.filter_shard_map(
            functools.partial(loss, as_one=as_one), mesh=mesh, in_specs=((None, P("fsdp")),), out_specs=P()
        )
        return eqx.filter_value_and_grad(sharded)

    value, (g_units, g_x) = eqx.filter_jit(value_and_grad(True))((units, x))
    ref_value, (ref_units, ref_x) = eqx.filter_jit(value_and_grad(False))((units, x))
    assert_tree_allclose(value, ref_value)
    assert_tree_allclose(g_x, ref_x)
    assert_tree_allclose(g_units, ref_units)
    # The layers' checkpoint names, identities that no remat policy sees inside the
    # custom VJP, are dropped from the scanned trace; the plain scan keeps them.
    names = {
        as_one: primitive_counts(eqx.filter_make_jaxpr(value_and_grad(as_one))((units, x))[0].jaxpr)["name"]
        for as_one in (True, False)
    }
    assert names[True] == 0 < names[False], names


# ------------------------------------------------------------------------ shard_params


def test_shard_params_rules(caplog):
    mesh = es.make_mesh("fsdp=4,tp=2")
    tree = {
        "tp_matrix": es.Sharded(jnp.zeros((64, 32)), P(None, "tp")),
        "matrix": jnp.zeros((12, 40)),  # 40 > 12 and divisible by 4
        "odd": jnp.zeros((9, 7)),  # divisible nowhere
        "small": jnp.zeros((4,)),
        "tie": jnp.zeros((8, 8)),
    }
    with caplog.at_level(logging.INFO, logger="equishard"):
        out = es.fsdp_split_params(tree, "fsdp", min_weight_size=16, mesh=mesh)
    specs = es.specs_of(out)
    assert specs["tp_matrix"] == P("fsdp", "tp")  # the tp dimension stays as it is
    assert specs["matrix"] == P(None, "fsdp")
    assert specs["tie"] == P("fsdp", None)  # ties go to the earlier dimension
    assert specs["odd"] == P() and specs["small"] == P()
    assert not es.is_sharded(out["odd"]) and not es.is_sharded(out["small"])
    messages = caplog.text
    assert "`['odd']` (9, 7)" in messages and "no free dimension is divisible by 4" in messages
    assert "`['small']` (4,)" in messages and "below min_weight_size=16" in messages
    # xLSTM-JAX's rule (shard_params): ties to the later dimension, size <= minimum stays.
    ref = es.specs_of(es.shard_params({**tree, "sixteen": jnp.zeros((16,))}, "fsdp", 16, mesh=mesh))
    assert ref["tie"] == P(None, "fsdp") and ref["sixteen"] == P()
    assert es.specs_of(es.fsdp_split_params({"sixteen": jnp.zeros((16,))}, "fsdp", 16, mesh=mesh)) == {
        "sixteen": P("fsdp")
    }


def test_shard_params_inside_shard_map_keeps_the_local_slice():
    """The seeds' way: initialise inside the mapped function; each device keeps its slice."""
    mesh = es.make_mesh("fsdp=4")
    full = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)

    @es.filter_shard_map(mesh=mesh, in_specs=(P(),))
    def init(w):
        return es.shard_params({"w": w}, "fsdp", min_weight_size=0)

    out = init(full)
    assert es.specs_of(out)["w"] == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(es.gather(out)["w"].value), np.asarray(full))


def test_gather_params_mixed_precision():
    """bf16 gathers with fp32 or bf16 gradient reduce-scatters, fp32 master weights."""
    mesh = es.make_mesh("fsdp=8")
    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    params = es.shard_params({"w": w}, "fsdp", 0, mesh=mesh)

    def reference(w, x):
        return jnp.mean((x @ w.astype(jnp.bfloat16).astype(jnp.float32)) ** 2)

    ref = jax.grad(reference)(w, x)
    for scatter in (jnp.float32, jnp.bfloat16):

        def loss(params, x, scatter=scatter):
            full = fsdp_gather_params(params, "fsdp", jnp.bfloat16, scatter)
            assert full["w"].dtype == jnp.bfloat16
            return jax.lax.pmean(jnp.mean((x @ full["w"].astype(jnp.float32)) ** 2), "fsdp")

        fn = es.filter_shard_map(loss, mesh=mesh, in_specs=(None, P("fsdp")), out_specs=P())
        grads = jax.jit(jax.grad(fn))(params, x)
        assert grads["w"].value.dtype == jnp.float32
        assert_tree_allclose(grads["w"].value, ref, rtol=1e-2)


def test_optimizer_states_are_sharded_like_their_parameters():
    mesh = es.make_mesh("fsdp=8,tp=1")
    model = es.sharded_init(lambda k: Model(key=k), jax.random.key(0), mesh=mesh)
    params = _params(model)
    for opt in (optax.adamw(1e-3), optax.sgd(1e-3, momentum=0.9), optax.adafactor(1e-3)):
        state = es.shard(opt.init(params), mesh)
        for path, value, spec in es.sharding._specs.leaves_with_specs(state):
            if "w1" in path and value.ndim == 2:
                assert spec == P("fsdp", "tp"), (opt, path)
                assert value.addressable_shards[0].data.shape == (D // 8, F)


def test_per_device_memory_of_params_and_adamw_state():
    n = 8
    mesh, init, _, _ = _train_step("fsdp=8,tp=1", "global")
    model, opt_state = init(jax.random.key(0))
    tree = (_params(model), opt_state)
    per_device = 0
    total = 0
    replicated = 0
    for leaf in jax.tree.leaves(tree):
        per_device += leaf.addressable_shards[0].data.nbytes
        total += leaf.nbytes
        if leaf.sharding.is_fully_replicated:
            replicated += leaf.nbytes
    assert per_device <= 1.02 * (total - replicated) / n + replicated
    # Replicated: b1 (its one dimension is the tensor-parallel one) and adamw's counts.
    assert replicated < 0.05 * total


# ------------------------------------------------------------- memory and communication


def _grad_step(mesh, model):
    """One step's gradient computation (inside the shard_map, as a train step does)."""
    x = jax.random.normal(jax.random.key(1), (B, D))

    @es.filter_shard_map(mesh=mesh, in_specs=(None, P("fsdp")), out_specs=(None, P()))
    def step(model, x):
        def loss(model):
            return jax.lax.pmean(jnp.mean(model(x) ** 2), "fsdp")

        value, grads = eqx.filter_value_and_grad(loss)(model)
        return grads, value

    return eqx.filter_jit(step).lower(model, x).compile()


def _gathered_bytes(block) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(block.module))


def test_fsdp_peak_temporary_memory_holds_one_layer_at_a_time():
    """FSDP-8 vs DP-8, from the compiler's memory analysis of the same step."""
    mesh = es.make_mesh("fsdp=8,tp=1")
    depth, f = 6, 512  # parameters dominate the step's memory

    def build(min_weight_size):
        make = lambda k: Model(key=k, min_weight_size=min_weight_size, depth=depth, f=f)  # noqa: E731
        return es.sharded_init(make, jax.random.key(0), mesh=mesh)

    with _replicated_on_purpose():
        dp = build(2**40)
    fsdp = build(0)
    temp_dp = _grad_step(mesh, dp).compiled.memory_analysis().temp_size_in_bytes
    temp_fsdp = _grad_step(mesh, fsdp).compiled.memory_analysis().temp_size_in_bytes
    layers = [_gathered_bytes(b) for b in dp.blocks]
    ideal_saving = sum(layers) - max(layers)  # all gathered at once vs one at a time
    assert temp_dp - temp_fsdp >= 0.8 * ideal_saving, (temp_dp, temp_fsdp, ideal_saving)


def test_fsdp_communication_at_the_minimum():
    n = 8
    mesh = es.make_mesh("fsdp=8,tp=1")
    model = es.sharded_init(lambda k: Model(key=k, min_weight_size=1024), jax.random.key(0), mesh=mesh)
    ops = read_collectives(_grad_step(mesh, model))
    sharded = sum(
        leaf.nbytes
        for b in model.blocks
        for leaf in jax.tree.leaves(b.module, is_leaf=es.is_sharded)
        if es.is_sharded(leaf) and "fsdp" in str(leaf.spec)
        for leaf in [leaf.value]
    )
    replicated = sum(leaf.nbytes for leaf in jax.tree.leaves(_params(model))) - sharded
    minimum = 3 * (n - 1) / n * sharded + 2 * (n - 1) / n * replicated
    measured = collective_bytes(ops)
    kinds = count_collectives(ops)
    # Two all-gathers per matrix (forward, and again in backward), one reduce-scatter.
    assert kinds.get("all-gather", 0) == 2 * 2 * DEPTH, kinds
    assert measured <= 1.05 * minimum, (measured, minimum, kinds)


def test_bad_fsdp_input():
    mesh = es.make_mesh("fsdp=8")
    tree = {"w": jnp.zeros((16, 8))}
    with pytest.raises(es.LayerConfigError, match="min_weight_size must be a non-negative int, got -1"):
        es.shard_params(tree, "fsdp", -1, mesh=mesh)
    with pytest.raises(es.SpecError, match=r"axis_name 'zz' is not an axis of Mesh\('fsdp': 8\)"):
        es.shard_params(tree, "zz", 0, mesh=mesh)
    with pytest.raises(es.LayerConfigError, match="gather_dtype must be a floating dtype"):
        FSDP(eqx.nn.Linear(8, 8, key=jax.random.key(0)), "fsdp", gather_dtype=jnp.int32, mesh=mesh)
    with pytest.raises(es.LayerConfigError, match="grad_scatter_dtype must be a floating dtype"):
        gather_params(tree, "fsdp", grad_scatter_dtype=jnp.int8)
