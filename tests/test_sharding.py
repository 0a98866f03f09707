"""The sharding floor: specs on modules, path rules, shard/gather, filter_shard_map,
make_mesh, mesh-invariant initialisation, and the validation errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import equishard as es

from .helpers import assert_tree_allclose

D, F, B = 8, 16, 16


class Block(eqx.Module):
    """A user's own module: two boxed weights, an activation function and an int."""

    w1: es.Sharded
    w2: es.Sharded
    bias: jax.Array
    act: Callable
    power: int

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.w1 = es.Sharded(jax.random.normal(k1, (D, F)) / D**0.5, P(None, "tp"))
        self.w2 = es.Sharded(jax.random.normal(k2, (F, D)) / F**0.5, P("tp", None))
        self.bias = jnp.linspace(-1.0, 1.0, D)
        self.act = jax.nn.gelu
        self.power = 2


class Net(eqx.Module):
    blocks: list[Block]

    def __init__(self, depth: int, *, key):
        self.blocks = [Block(key=k) for k in jax.random.split(key, depth)]


def reference_loss(net: Net, x):
    """Single-device loss on global arrays."""
    for blk in net.blocks:
        x = x + blk.act(x @ blk.w1.value) @ blk.w2.value + blk.bias[None, :]
    return jnp.mean(x**blk.power)


def local_loss(net: Net, x, data_axes):
    """The same loss in the local view: tensor parallel over "tp", data over data_axes."""
    for blk in net.blocks:
        h = blk.act(x @ blk.w1.value)  # f32[B/dp, D] @ f32[D, F/tp] -> f32[B/dp, F/tp]
        y = jax.lax.psum(h @ blk.w2.value, "tp")  # f32[B/dp, F/tp] @ f32[F/tp, D] -> f32[B/dp, D]
        x = x + y + blk.bias[None, :]
    return jax.lax.pmean(jnp.mean(x**blk.power), data_axes)


LAYOUTS = [
    ("dp=8,tp=1", "dp"),
    ("dp=1,tp=8", "dp"),
    ("dp=4,tp=2", "dp"),
    ("dp=2,sp=2,tp=2", ("dp", "sp")),
]


def _inputs():
    key = jax.random.key(0)
    net = Net(3, key=key)
    x = jax.random.normal(jax.random.key(1), (B, D))
    return net, x


# ----------------------------------------------------------------------------- specs_of


def test_specs_of_nested_modules_and_lists():
    net, _ = _inputs()
    specs = es.specs_of(net)
    assert specs.blocks[1].w1 == P(None, "tp")
    assert specs.blocks[2].w2 == P("tp", None)
    assert specs.blocks[0].bias == P()  # a plain array is replicated
    assert specs.blocks[0].act is None and specs.blocks[0].power is None  # non-arrays left out


def test_sharded_global_shape():
    box = es.Sharded(jnp.zeros((16, 2)), P("tp"), (16, 2))
    assert box.global_shape == (16, 2)
    # Boxes round-trip a leading axis with their global shape; plain arrays come back plain.
    # Three layers stacked by vmap: the values gained a leading [3], the boxes did not.
    w = eqx.filter_vmap(lambda _: es.Sharded(jnp.zeros((4, 2)), P(None, "tp")))(jnp.arange(3))
    tree = {"w": w, "b": jnp.zeros((3, 2))}
    marker = es.plain_arrays(tree)
    stacked = es.add_leading_axis(tree, "pp", box_arrays=True)
    assert stacked["w"].spec == P("pp", None, "tp") and stacked["w"].global_shape == (3, 4, 2)
    assert stacked["b"].spec == P("pp", None) and stacked["b"].global_shape == (3, 2)
    back = es.drop_leading_axis(jax.tree.map(lambda a: a[0], stacked), unbox=marker)  # one layer
    assert back["w"].spec == P(None, "tp") and back["w"].global_shape == (4, 2)
    assert not es.is_sharded(back["b"])


def test_sharded_pads_spec_to_rank_and_rejects_longer_spec():
    assert es.Sharded(jnp.zeros((4, 3, 2)), P("tp")).spec == P("tp", None, None)
    with pytest.raises(es.SpecError, match=r"shape \(4,\)"):
        es.Sharded(jnp.zeros((4,)), P("tp", None))


def test_path_rules_on_unmodified_mlp():
    mlp = eqx.nn.MLP(8, 4, 32, depth=2, key=jax.random.key(0))
    rules = [
        (r"layers\[0\]\.weight", P("tp", None)),
        (r"layers\[\d+\]\.weight", P(None, "tp")),
        (r"layers\[0\]\.bias", P("tp")),
    ]
    ruled = es.apply_rules(mlp, rules)
    specs = es.specs_of(ruled)
    assert specs.layers[0].weight == P("tp", None)  # first match wins
    assert specs.layers[1].weight == P(None, "tp")
    assert specs.layers[0].bias == P("tp")
    assert specs.layers[2].bias == P(None)  # no match: replicated
    x = jnp.ones(8)
    np.testing.assert_array_equal(es.unbox(ruled)(x), mlp(x))  # still the same model


def test_optax_states_inherit_specs_by_structure():
    net, _ = _inputs()
    params = eqx.filter(net, eqx.is_array)
    adamw = optax.adamw(1e-3).init(params)
    specs = es.specs_of(adamw)
    mu = specs[0].mu
    assert mu.blocks[1].w1 == P(None, "tp") and mu.blocks[1].w2 == P("tp", None)
    assert specs[0].count == P()
    # adafactor's factored moments do not mirror the parameters: they are replicated.
    factored = es.specs_of(optax.adafactor(1e-3, min_dim_size_to_factor=4).init(params))[0]
    for moment in (factored.v_row, factored.v_col, factored.v):
        assert moment.blocks[0].w1 == P() and moment.blocks[0].w2 == P()


# ---------------------------------------------------------------------- shard / gather


@pytest.mark.parametrize("layout", ["tp=8", "dp=4,tp=2", "dp=2,sp=2,tp=2"])
def test_shard_gather_round_trip_bit_exact(layout):
    net, _ = _inputs()
    mesh = es.make_mesh(layout)
    placed = es.shard(net, mesh)
    w1 = placed.blocks[0].w1.value
    assert w1.sharding.spec == P(None, "tp")
    assert w1.addressable_shards[0].data.shape == (D, F // mesh.shape["tp"])
    back = es.gather(placed)
    for a, b in zip(jax.tree.leaves(net), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(back.blocks[0].w1.value.devices()) == 1


def test_shard_on_an_explicit_mesh():
    net, _ = _inputs()
    mesh = es.make_mesh("dp=4,tp=2", axis_types=AxisType.Explicit)
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    placed = es.shard(net, mesh)
    assert placed.blocks[0].w2.value.sharding.spec == P("tp", None)


# --------------------------------------------------------------------- filter_shard_map


def _grad_pair(layout, data_axes):
    mesh = es.make_mesh(layout)
    fn = es.filter_shard_map(
        lambda net, x: local_loss(net, x, data_axes),
        mesh=mesh,
        in_specs=(None, P(data_axes)),
        out_specs=P(),
    )
    return mesh, eqx.filter_jit(eqx.filter_value_and_grad(fn))


@pytest.mark.parametrize("layout,data_axes", LAYOUTS)
def test_filter_shard_map_equals_unsharded_value_and_grad(layout, data_axes):
    net, x = _inputs()
    ref_loss, ref_grad = eqx.filter_value_and_grad(reference_loss)(net, x)
    mesh, value_and_grad = _grad_pair(layout, data_axes)
    # Not yet placed: filter_shard_map places the arrays by their specs.
    loss, grad = value_and_grad(net, x)
    assert_tree_allclose(loss, ref_loss)
    assert_tree_allclose(grad, ref_grad)
    assert es.specs_of(grad) == es.specs_of(net)  # gradients carry the specs too
    # Already placed.
    loss2, grad2 = value_and_grad(es.shard(net, mesh), es.shard(x, mesh, P(data_axes)))
    assert_tree_allclose(loss2, ref_loss)
    assert_tree_allclose(grad2, ref_grad)


def test_filter_shard_map_on_explicit_mesh_with_unplaced_inputs():
    net, x = _inputs()
    mesh = es.make_mesh("dp=4,tp=2", axis_types=AxisType.Explicit)
    fn = es.filter_shard_map(
        lambda net, x: local_loss(net, x, "dp"), mesh=mesh, in_specs=(None, P("dp")), out_specs=P()
    )
    assert_tree_allclose(fn(net, x), reference_loss(net, x))
    assert_tree_allclose(eqx.filter_jit(fn)(net, x), reference_loss(net, x))


def test_filter_shard_map_carried_out_specs_and_static_outputs():
    net, _ = _inputs()
    mesh = es.make_mesh("dp=4,tp=2")

    @es.filter_shard_map(mesh=mesh)
    def double(net):
        # Local view: each device doubles its own block; the module (with its
        # activation function and int) comes back with its specs.
        return jax.tree.map(lambda a: 2 * a if eqx.is_array(a) else a, net)

    out = double(es.shard(net, mesh))
    assert out.blocks[0].act is jax.nn.gelu and out.blocks[0].power == 2
    assert out.blocks[0].w1.value.sharding.spec == P(None, "tp")
    assert_tree_allclose(out, jax.tree.map(lambda a: 2 * a if eqx.is_array(a) else a, net))


def test_global_view_from_plain_filter_jit():
    """A sharded computation called on global arrays from a plain eqx.filter_jit program."""
    net, x = _inputs()
    mesh = es.make_mesh("dp=2,tp=4")
    sharded_loss = es.filter_shard_map(
        lambda net, x: local_loss(net, x, "dp"), mesh=mesh, in_specs=(None, P("dp")), out_specs=P()
    )

    @eqx.filter_jit
    def program(net, x):
        x = jnp.tanh(x)  # ordinary global-view code around the sharded call
        return 3.0 * sharded_loss(net, x)

    assert_tree_allclose(program(net, x), 3.0 * reference_loss(net, jnp.tanh(x)))


def test_filter_shard_map_composes_with_filter_vmap():
    net, x = _inputs()
    mesh = es.make_mesh("dp=4,tp=2")
    fn = es.filter_shard_map(
        lambda net, x: local_loss(net, x, "dp"), mesh=mesh, in_specs=(None, P("dp")), out_specs=P()
    )
    xs = jnp.stack([x, 2 * x])
    got = eqx.filter_vmap(fn, in_axes=(None, 0))(net, xs)
    want = jnp.stack([reference_loss(net, x), reference_loss(net, 2 * x)])
    assert_tree_allclose(got, want)


# ------------------------------------------------------------------- mesh-invariant init


def test_mesh_invariant_init_bit_identical():
    key = jax.random.key(42)
    results = []
    for layout in ["dp=1,tp=1", "dp=1,tp=8", "dp=4,tp=2", "dp=2,sp=2,tp=2"]:
        mesh = es.make_mesh(layout)
        net = es.sharded_init(lambda k: Net(2, key=k), key, mesh=mesh)
        assert net.blocks[0].w1.value.sharding.spec == P(None, "tp")
        assert net.blocks[0].act is jax.nn.gelu
        results.append([np.asarray(a) for a in jax.tree.leaves(net)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    # ... and identical to building it under jit on one device, without equishard.
    plain = eqx.filter_jit(lambda k: Net(2, key=k))(key)
    for a, b in zip(results[0], [np.asarray(a) for a in jax.tree.leaves(plain)]):
        np.testing.assert_array_equal(a, b)


def test_threefry_partitionable_off_is_reported():
    previous = bool(getattr(jax.config, "jax_threefry_partitionable"))
    jax.config.update("jax_threefry_partitionable", False)
    try:
        with pytest.warns(UserWarning, match="jax_threefry_partitionable is off"):
            assert not es.check_threefry_partitionable()
    finally:
        jax.config.update("jax_threefry_partitionable", previous)


# ---------------------------------------------------------------------------- make_mesh


def test_make_mesh_layouts():
    assert dict(es.make_mesh("dp=2,fsdp=2,tp=2").shape) == {"dp": 2, "fsdp": 2, "tp": 2}
    assert dict(es.make_mesh({"dp": -1, "tp": 2}).shape) == {"dp": 4, "tp": 2}
    assert dict(es.make_mesh(" dp = 2 , tp = 2 ").shape) == {"dp": 2, "tp": 2}
    assert es.make_mesh("dp=8").axis_types == (AxisType.Auto,)


@pytest.mark.parametrize(
    "layout,message",
    [
        ("dp2,tp=2", "malformed layout 'dp2,tp=2'"),
        ("dp=two", "'two', not an integer"),
        ("dp=2,dp=2", "names axis 'dp' twice"),
        ("dp=0", "axis 'dp' has size 0"),
        ("dp=-1,tp=-1", "more than one axis is -1"),
        ("dp=4,tp=4", "needs 16 devices but only 8 exist"),
        ("dp=3,tp=-1", "cannot fill them"),
        ("", "empty layout"),
    ],
)
def test_bad_layouts(layout, message):
    with pytest.raises(es.MeshError, match=message.replace("(", r"\(")):
        es.make_mesh(layout)


# --------------------------------------------------------------------------- validation


class Bad(eqx.Module):
    blocks: list


class W(eqx.Module):
    w1: es.Sharded


def _bad_net(spec, shape=(8, 16)):
    return Bad([W(es.Sharded(jnp.zeros((8, 16)), P())) for _ in range(3)] + [W(es.Sharded(jnp.zeros(shape), spec))])


@pytest.mark.parametrize(
    "spec,message",
    [
        (P("xx", None), "axis 'xx' is not an axis of the mesh"),
        (P("tp", None), "dimension 0 has size 6, which is not divisible by 4"),
        (P(("dp", "tp"), "dp"), "mesh axis 'dp' is used more than once"),
    ],
)
def test_bad_specs_name_path_shape_spec_and_mesh(spec, message):
    shape = (6, 16) if "divisible" in message else (8, 16)
    net = _bad_net(spec, shape)
    mesh = es.make_mesh("dp=2,tp=4")
    for call in (lambda: es.shard(net, mesh), lambda: es.filter_shard_map(lambda n: n, mesh=mesh)(net)):
        with pytest.raises(es.SpecError) as info:
            call()
        text = str(info.value)
        assert "blocks[3].w1" in text and str(shape) in text and str(spec) in text
        assert "Mesh('dp': 2, 'tp': 4)" in text and message in text


def test_spec_longer_than_rank():
    mesh = es.make_mesh("dp=2,tp=4")
    x = jnp.zeros((8,))
    with pytest.raises(es.SpecError, match=r"argument `x` \(shape \(8,\)\).*2 entries"):
        es.filter_shard_map(lambda x: x, mesh=mesh, in_specs=(P("dp", "tp"),))(x)


def test_specs_not_matching_argument_structure():
    net, x = _inputs()
    mesh = es.make_mesh("dp=2,tp=4")
    with pytest.raises(es.SpecError, match="do not match its structure"):
        es.filter_shard_map(lambda net, x: x, mesh=mesh, in_specs=({"a": P()}, P()))(net, x)
    with pytest.raises(es.SpecError, match="one entry per positional argument"):
        es.filter_shard_map(lambda net, x: x, mesh=mesh, in_specs=(P(),))(net, x)


def test_bad_rules():
    mlp = eqx.nn.MLP(8, 4, 32, depth=1, key=jax.random.key(0))
    with pytest.raises(es.SpecError, match=r"`layers\[0\]\.bias` \(shape \(32,\)\)"):
        es.apply_rules(mlp, [(r"bias", P("tp", None))])
    with pytest.raises(es.SpecError, match="not a valid regular expression"):
        es.apply_rules(mlp, [(r"layers[", P())])


def test_gather_inside_jit():
    net, _ = _inputs()
    mesh = es.make_mesh("dp=4,tp=2")
    out = eqx.filter_jit(lambda n: es.gather(n, mesh=mesh))(es.shard(net, mesh))
    assert out.blocks[0].w1.value.sharding.is_fully_replicated
    assert_tree_allclose(out, net)
    out = eqx.filter_jit(es.gather)(es.shard(net, mesh))  # the mesh read off the types
    assert out.blocks[0].w1.value.sharding.is_fully_replicated


# Each layout with what it must resolve to, written out by hand: (axes, data axes, tensor,
# fsdp, context, pipeline, batch spec, ways the batch splits, ZeRO axis, micro-batches).
RESOLVED = [
    (
        es.Layout("dp=2,fsdp=2,tp=2", sequence_parallel=True),
        {"dp": 2, "fsdp": 2, "tp": 2}, ("dp", "fsdp"), "tp", "fsdp", None, None,
        P(("dp", "fsdp")), 4, None, 1,
    ),
    (
        es.Layout("pp=2,dp=2,tp=2", num_microbatches=4, pipeline_schedule="1f1b"),
        {"pp": 2, "dp": 2, "tp": 2}, ("dp",), "tp", None, None, "pp", P("dp"), 2, None, 4,
    ),
    (
        es.Layout("dp=2,cp=4", cp_impl="alltoall"),
        {"dp": 2, "cp": 4}, ("dp",), None, None, "cp", None, P("dp", "cp"), 2, None, 1,
    ),
    (
        es.Layout("dp=4,tp=2", zero=True),
        {"dp": 4, "tp": 2}, ("dp",), "tp", None, None, None, P("dp"), 4, "dp", 1,
    ),
    (
        es.Layout("fsdp=-1,tp=2"),
        {"fsdp": 4, "tp": 2}, ("fsdp",), "tp", "fsdp", None, None, P("fsdp"), 4, None, 1,
    ),
    (  # the user's own axis names, given roles
        es.Layout("replica=2,shard=2,model=2", zero=True, roles={"replica": "data", "shard": "fsdp", "model": "tensor"}),
        {"replica": 2, "shard": 2, "model": 2}, ("replica", "shard"), "model", "shard", None,
        None, P(("replica", "shard")), 4, "replica", 1,
    ),
]


@pytest.mark.parametrize("case", RESOLVED, ids=lambda c: c[0].spec)
def test_a_layout_resolves_to_its_axes_roles_and_batch_spec(case):
    layout, axes, data, tensor, fsdp, context, pipeline, batch_spec, ways, zero, micro = case
    par = layout.resolve(8)
    assert isinstance(par, es.Parallelism)
    assert par.shape == axes and par.axes == tuple(axes) and par.sizes == tuple(axes.values())
    assert par.spec == ",".join(f"{a}={n}" for a, n in axes.items()) and par.num_devices == 8
    assert (par.data_axes, par.tensor, par.fsdp, par.context, par.pipeline) == (data, tensor, fsdp, context, pipeline)
    assert par.batch_spec == batch_spec and par.data_parallel_size == ways
    assert par.zero == zero and par.num_microbatches == micro
    assert par.num_stages == (axes[pipeline] if pipeline else 1)
    assert dict(par.mesh(jax.devices()).shape) == axes
    # A Parallelism written by hand with the same fields is the same value.
    by_hand = es.Parallelism(
        axes=tuple(axes), sizes=tuple(axes.values()), data_axes=data, tensor=tensor, fsdp=fsdp,
        context=context, pipeline=pipeline, num_microbatches=micro, zero=zero,
        sequence_parallel=layout.sequence_parallel, pipeline_schedule=layout.pipeline_schedule,
        context_impl=layout.cp_impl,
    )  # fmt: skip
    assert by_hand == par and hash(by_hand) == hash(par) and by_hand.zero == par.zero
    # ZeRO does not change the model: a model built with and without it has one structure.
    assert dataclasses.replace(par, zero=None) == par


def test_a_parallelism_in_the_users_names_reads_in_the_conventional_ones():
    roles = {"replica": "data", "shard": "fsdp", "model": "tensor"}
    layout = es.Layout("replica=2,shard=2,model=2", zero=True, sequence_parallel=True, roles=roles)
    par = layout.resolve(8)
    expected = es.Parallelism(
        axes=("dp", "fsdp", "tp"), sizes=(2, 2, 2), data_axes=("dp", "fsdp"), tensor="tp",
        fsdp="fsdp", sequence_parallel=True, zero="dp",
    )  # fmt: skip
    assert par.data == "replica" and par.conventional() == expected and par.conventional().zero == "dp"
    assert expected.conventional() is expected
    assert dict(layout.mesh().shape) == {"replica": 2, "shard": 2, "model": 2}


def test_a_parallelism_made_by_hand_is_checked_as_a_resolved_one():
    with pytest.raises(es.MeshError, match="the tensor axis 'tp' is not an axis of the mesh"):
        es.Parallelism(axes=("dp",), sizes=(8,), data_axes=("dp",), tensor="tp")
    with pytest.raises(es.MeshError, match="plays the roles 'tensor' and 'fsdp'"):
        es.Parallelism(axes=("x",), sizes=(8,), data_axes=("x",), tensor="x", fsdp="x")
    with pytest.raises(es.MeshError, match="the tensor axis 'tp' must not be a data axis"):
        es.Parallelism(axes=("tp",), sizes=(8,), data_axes=("tp",), tensor="tp")
    with pytest.raises(es.MeshError, match="'dp' and 'replica' both play the role 'data'"):
        es.Parallelism(axes=("dp", "replica"), sizes=(4, 2), data_axes=("dp", "replica"))
    with pytest.raises(es.MeshError, match="sequence parallelism needs a tensor axis"):
        es.Parallelism(axes=("dp",), sizes=(8,), data_axes=("dp",), sequence_parallel=True)
    with pytest.raises(es.MeshError, match="zero .* lacks"):
        es.Parallelism(axes=("dp", "fsdp"), sizes=(1, 8), data_axes=("dp", "fsdp"), fsdp="fsdp", zero="dp")
    with pytest.raises(es.MeshError, match="one size each"):
        es.Parallelism(axes=("dp", "tp"), sizes=(8,))
    with pytest.raises(es.MeshError, match="num_microbatches .* at least 1"):
        es.Parallelism(num_microbatches=0)
    assert es.Parallelism().num_devices == 1 and es.Parallelism().batch_spec == P()


def test_an_axis_without_a_role_is_named():
    with pytest.raises(es.MeshError, match="the axis 'model' has no role"):
        es.Layout("dp=4,model=2").resolve(8)
    with pytest.raises(es.MeshError, match="'dp' and 'replica' both play the role 'data'"):
        es.Layout("dp=4,replica=2", roles={"replica": "data"}).resolve(8)
    with pytest.raises(es.MeshError, match="the role 'weights'"):
        es.Layout("dp=4,model=2", roles={"model": "weights"}).resolve(8)


def test_a_layout_is_checked_where_it_is_resolved():
    with pytest.raises(es.MeshError, match=r"cp_impl \(--cp-impl\) 'ulysses' is not one of ring, alltoall"):
        es.Layout("dp=2,cp=4", cp_impl="ulysses").resolve(8)
    with pytest.raises(es.MeshError, match="zero .* lacks"):
        es.Layout("fsdp=8", zero=True).resolve(8)
    with pytest.raises(es.MeshError, match="zero .* lacks"):
        es.Layout("dp=1,fsdp=8", zero=True).resolve(8)
    with pytest.raises(es.MeshError, match="num_microbatches .* at least 1, got 0"):
        es.Layout("dp=8", num_microbatches=0).resolve(8)
