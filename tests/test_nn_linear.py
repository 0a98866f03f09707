"""Column- and row-parallel linear layers: forward and every gradient against the plain
single-device computation on tp = 1, 2, 4, 8 and dp=2 x tp=4 (an Explicit mesh), strides,
LoRA, mesh-invariant initialisation of every init type, and the configuration errors."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import equishard as es
from equishard.nn import (
    INIT_TYPES,
    ColumnParallelLinear,
    RowParallelLinear,
    init_weight,
    scale_init,
)

from .helpers import OPTIMISED, assert_tree_allclose, check_against_single_device, jit_once, perturb

B, T, IN, OUT, HID, R = 4, 8, 16, 24, 32, 4
LAYOUTS = ["dp=1,tp=1", "dp=1,tp=2", "dp=1,tp=4", "dp=1,tp=8", "dp=2,tp=4"]


def build(key):
    k = [*jax.random.split(key, 7), jax.random.fold_in(key, 7)]
    return {
        "col": ColumnParallelLinear(IN, OUT, key=k[0]),
        "col_qkv": ColumnParallelLinear(IN, OUT, stride=3, init_type="orthogonal", key=k[1]),
        "pair": (
            ColumnParallelLinear(IN, HID, gather_output=False, stride=2, key=k[2]),
            RowParallelLinear(HID, IN, input_is_parallel=True, stride=2, key=k[3]),
        ),
        "row": RowParallelLinear(OUT, IN, stride=3, key=k[4]),
        "lora_col": ColumnParallelLinear(IN, OUT, lora_rank=R, lora_alpha=2.0, key=k[5]),
        "lora_row": RowParallelLinear(IN, OUT, lora_rank=R, bias=False, key=k[6]),
        # Its output in its three stride pieces (`split`), with LoRA and a bias.
        "split_col": ColumnParallelLinear(IN, OUT, stride=3, lora_rank=R, key=k[7]),
    }


INPUT_OF = {"col": "x16", "col_qkv": "x16", "pair": "x16", "row": "x24", "lora_col": "x16", "lora_row": "x16"}
INPUT_OF["split_col"] = "x16"
OUT_DIM = {"col": OUT, "col_qkv": OUT, "pair": IN, "row": IN, "lora_col": OUT, "lora_row": OUT, "split_col": OUT}


def apply(layers, xs):
    out = {}
    for name, layer in layers.items():
        x = xs[INPUT_OF[name]]
        if name == "split_col":  # the pieces side by side are the layer's output
            out[name] = jnp.concatenate(layer.split(x), axis=-1)
        else:
            out[name] = layer[1](layer[0](x)) if isinstance(layer, tuple) else layer(x)
    return out


def masters(layer):
    """The global parameters of a layer (or of its gradient) in the plain layout."""
    m = {"w": layer.master_weight}
    if layer.bias is not None:
        m["b"] = layer.master_bias
    if layer.lora_a is not None:
        m["a"] = jnp.reshape(layer.lora_a.value, (layer.lora_rank, layer.in_features))
        m["bb"] = jnp.reshape(layer.lora_b.value, (layer.out_features, layer.lora_rank))
    return m


def plain_linear(m, x, scale):
    y = x @ m["w"].T
    if "a" in m:
        y = y + scale * ((x @ m["a"].T) @ m["bb"].T)
    if "b" in m:
        y = y + jnp.broadcast_to(m["b"], y.shape)
    return y


def reference(layers, xs):
    """The single-device computation on the layers' master weights."""
    outs = {}
    for name, layer in layers.items():
        x = xs[INPUT_OF[name]]
        for part in layer if isinstance(layer, tuple) else (layer,):
            x = plain_linear(masters(part), x, part.lora_scale)
        outs[name] = x
    return outs


def make_mesh(layout):
    if layout == "dp=2,tp=4":  # the 2-D case runs on a user's Explicit mesh
        return es.make_mesh(layout, axis_types=AxisType.Explicit)
    return es.make_mesh(layout)


@functools.cache
def problem():
    key = jax.random.key(42)
    kl, kp, kx = jax.random.split(key, 3)
    layers = perturb(build(kl), kp)
    xs = {
        "x16": jax.random.normal(kx, (B, T, IN)),
        "x24": jax.random.normal(jax.random.fold_in(kx, 1), (B, T, OUT)),
    }
    return layers, xs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_layers_equal_unsharded_forward_and_grads(layout):
    layers, xs = problem()
    check_against_single_device(
        layers, apply, {k: es.Sharded(v, P("dp")) for k, v in xs.items()}, [make_mesh(layout)],
        out_specs={n: P("dp") for n in OUT_DIM}, reference=reference,
    )


def test_layers_outside_shard_map_are_the_plain_linear_map():
    layers, xs = problem()
    assert_tree_allclose(apply(layers, xs), reference(layers, xs))


def test_strided_storage_gives_each_device_its_interleaved_parts(getkey):
    # Column, stride 3 on tp=4: device r holds rows [r c, (r+1) c) of each of Q, K, V.
    mesh = es.make_mesh("tp=4")
    key = getkey()
    make = lambda k: ColumnParallelLinear(IN, OUT, stride=3, key=k)  # noqa: E731
    # The single-device weight, built under jit as sharded_init builds (both compiled as
    # users compile: the comparison is bit for bit).
    layer = jit_once(make, OPTIMISED)(key)
    sharded = es.sharded_init(make, key, mesh=mesh, compiler_options=OPTIMISED)
    master = np.asarray(layer.master_weight)
    c = OUT // 3 // 4
    for shard in sharded.weight.value.addressable_shards:
        r = shard.index[1].start // c
        want = np.stack([master[j * (OUT // 3) + r * c : j * (OUT // 3) + (r + 1) * c] for j in range(3)])
        np.testing.assert_array_equal(np.asarray(shard.data), want)


def test_init_types_are_mesh_invariant_and_mean_what_they_say():
    key = jax.random.key(3)

    def make(k):
        keys = jax.random.split(k, len(INIT_TYPES) + 2)
        layers: list[ColumnParallelLinear | RowParallelLinear] = [
            ColumnParallelLinear(IN, OUT, init_type=t, key=kk) for t, kk in zip(INIT_TYPES, keys)
        ]
        layers.append(RowParallelLinear(OUT, IN, stride=3, init_type="biased_normal", key=keys[-2]))
        layers.append(ColumnParallelLinear(IN, OUT, stride=3, lora_rank=R, key=keys[-1]))
        return layers

    single = jit_once(make, OPTIMISED)(key)  # single device, under jit as sharded_init builds
    sharded = es.sharded_init(make, key, mesh=es.make_mesh("dp=2,tp=4"), compiler_options=OPTIMISED)
    for a, b in zip(jax.tree.leaves(es.gather(sharded)), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-identical

    w = {t: np.asarray(layer.master_weight) for t, layer in zip(INIT_TYPES, single)}
    np.testing.assert_allclose(w["orthogonal"].T @ w["orthogonal"], np.eye(IN), atol=1e-5)
    np.testing.assert_array_equal(w["dirac"], np.eye(OUT, IN))
    np.testing.assert_array_equal(w["zeros"], 0)
    np.testing.assert_array_equal(w["ones"], 1)
    np.testing.assert_allclose(w["constant"], 0.02)
    assert np.abs(w["trunc_normal"]).max() <= 2.0  # torch's trunc_normal_(std=0.01): bounds +-2
    assert np.abs(w["kaiming_uniform"]).max() <= np.sqrt(6 / IN)
    assert np.abs(w["xavier_uniform"]).max() <= np.sqrt(6 / (IN + OUT))
    # biased_normal leaves a parallel layer's bias at zero, as the reference's layers do.
    assert np.abs(np.asarray(single[-2].master_bias)).sum() == 0
    assert np.abs(np.asarray(single[0].master_bias)).sum() == 0
    # scale_init multiplies any initialiser's output.
    ones = scale_init(jax.nn.initializers.ones, 3.0)(key, (2, 3))
    np.testing.assert_array_equal(np.asarray(ones), 3.0)
    scaled = scale_init(lambda k, s, d: init_weight(k, s, "normal", dtype=d), 0.5)(key, (4, 4), jnp.float32)
    np.testing.assert_allclose(np.asarray(scaled), 0.5 * np.asarray(init_weight(key, (4, 4), "normal")))


def test_lora_starts_at_its_base_and_trains_alone_with_a_filter(getkey):
    key = getkey()
    base = ColumnParallelLinear(IN, OUT, key=key)
    lora = ColumnParallelLinear(IN, OUT, lora_rank=R, key=key)
    x = jax.random.normal(getkey(), (T, IN))
    assert_tree_allclose(lora(x), base(x))  # B starts at zero
    row = RowParallelLinear(IN, OUT, lora_rank=R, key=key)
    assert row.lora_b is not None
    np.testing.assert_array_equal(np.asarray(row.lora_b.value), 0)

    # Freeze everything but the factors with an Equinox filter; one optax step.
    trainable = jax.tree.map(lambda _: False, lora)
    trainable = eqx.tree_at(lambda m: (m.lora_a, m.lora_b), trainable, replace=(True, True))
    params, frozen = eqx.partition(lora, trainable)
    opt = optax.sgd(0.1)
    state = opt.init(params)

    def loss(params, frozen):
        return jnp.sum(eqx.combine(params, frozen)(x) ** 2)

    grads = eqx.filter_grad(loss)(params, frozen)
    assert grads.weight.value is None and grads.bias.value is None
    updates, state = opt.update(grads, state)
    new = eqx.combine(eqx.apply_updates(params, updates), frozen)
    np.testing.assert_array_equal(np.asarray(new.weight.value), np.asarray(lora.weight.value))
    assert np.abs(np.asarray(new.lora_b.value)).sum() > 0


def test_configuration_errors_name_the_layer_and_value():
    key = jax.random.key(0)
    with pytest.raises(es.LayerConfigError, match=r"ColumnParallelLinear: stride=5 does not divide out_features=24"):
        ColumnParallelLinear(IN, OUT, stride=5, key=key)
    with pytest.raises(es.LayerConfigError, match=r"RowParallelLinear: stride=5 does not divide in_features=16"):
        RowParallelLinear(IN, OUT, stride=5, key=key)
    for rank in (0, -2):
        with pytest.raises(es.LayerConfigError, match=rf"ColumnParallelLinear: lora_rank .* got {rank}"):
            ColumnParallelLinear(IN, OUT, lora_rank=rank, key=key)
        with pytest.raises(es.LayerConfigError, match=rf"RowParallelLinear: lora_rank .* got {rank}"):
            RowParallelLinear(IN, OUT, lora_rank=rank, key=key)
    with pytest.raises(es.LayerConfigError, match=r"ColumnParallelLinear: unknown init_type 'xavier'"):
        ColumnParallelLinear(IN, OUT, init_type="xavier", key=key)  # pyright: ignore[reportArgumentType]
    with pytest.raises(es.LayerConfigError, match=r"RowParallelLinear: unknown init_type 'he'"):
        RowParallelLinear(IN, OUT, init_type="he", key=key)  # pyright: ignore[reportArgumentType]
    with pytest.raises(es.LayerConfigError, match=r"requires gather_output=False"):
        ColumnParallelLinear(IN, OUT, sequence_parallel=True, key=key)


def test_features_not_divisible_by_the_axis():
    mesh = es.make_mesh("tp=4")
    key = jax.random.key(0)
    x = jnp.ones((2, IN))
    column = ColumnParallelLinear(IN, 6, key=key)
    # Through filter_shard_map the sharding floor rejects the weight's spec first,
    # naming the parameter, its shape, the spec and the mesh.
    with pytest.raises(es.EquishardError, match=r"layer\.weight` \(shape \(6, 16\)\).*not divisible by 4"):
        es.filter_shard_map(lambda layer, x: layer(x), mesh=mesh)(column, x)
    # Where the specs pass (weights handed in replicated), the layer itself refuses at
    # trace time, where the axis size is known: nothing reaches XLA.
    replicated = jax.shard_map(lambda layer, x: layer(x), mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(es.LayerConfigError, match=r"ColumnParallelLinear: out_features=6 is not divisible by 4, the size of mesh axis 'tp'"):
        jax.eval_shape(replicated, column, x)
    row = RowParallelLinear(6, IN, key=key)
    with pytest.raises(es.LayerConfigError, match=r"RowParallelLinear: in_features=6 is not divisible by 4"):
        jax.eval_shape(replicated, row, jnp.ones((2, 6)))
    strided = ColumnParallelLinear(IN, OUT, stride=4, key=key)  # 24 / 4 devices = 6 rows, not 4 parts
    with pytest.raises(es.EquishardError, match=r"weight.*not divisible by 4"):
        es.filter_shard_map(lambda layer, x: layer(x), mesh=mesh)(strided, x)
    with pytest.raises(es.LayerConfigError, match=r"stride=4 does not divide the partition of out_features=24 over the 4 devices"):
        jax.eval_shape(replicated, strided, x)


def test_layers_compose_with_eqx_sequential(getkey):
    """`__call__(x, *, key=None)` like Equinox's layers: `eqx.nn.Sequential` chains them."""
    from equishard.nn import ParallelMLP, RMSNorm, TransformerBlock

    seq = eqx.nn.Sequential([
        ColumnParallelLinear(IN, HID, gather_output=False, key=getkey()),
        RowParallelLinear(HID, IN, input_is_parallel=True, key=getkey()),
        RMSNorm(IN),
        ParallelMLP(IN, HID, key=getkey()),
        TransformerBlock(IN, 4, HID, key=getkey()),
    ])
    x = jax.random.normal(getkey(), (B, T, IN))
    by_hand = x
    for layer in seq.layers:
        by_hand = layer(by_hand)
    assert_tree_allclose(seq(x), by_hand)
    assert_tree_allclose(seq(x, key=getkey()), by_hand)
    check_against_single_device(
        seq, lambda m, xs: {"y": m(xs["x"])}, {"x": es.Sharded(x, P("dp"))}, ["dp=2,tp=4"],
        out_specs={"y": P("dp")},
    )
