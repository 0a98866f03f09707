"""The worked example: the four classic layouts of one small MLP on a (dp=4, tp=2) mesh.

Layer sizes 32, 128, 256, 128, 4; ReLU after every layer; squared error summed over the
outputs and averaged over a batch of 16. Each layout's loss and gradients equal the
single-device ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import equishard as es
from equishard.nn import fsdp_gather_params

from .helpers import assert_tree_allclose

SIZES = (32, 128, 256, 128, 4)
BATCH = 16


def init(key):
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(SIZES) - 1), zip(SIZES, SIZES[1:])):
        kw, kb = jax.random.split(k)
        params.append(
            {
                "w": jax.random.normal(kw, (n_in, n_out)) / n_in**0.5,
                "b": 0.1 * jax.random.normal(kb, (n_out,)),
            }
        )
    return params


def reference_loss(params, x, t):
    for layer in params:
        x = jax.nn.relu(x @ layer["w"] + layer["b"][None])
    return jnp.mean(jnp.sum((x - t) ** 2, axis=-1))


def with_specs(params, w_spec, b_spec):
    return [{"w": es.Sharded(p["w"], w_spec), "b": es.Sharded(p["b"], b_spec)} for p in params]


# Each layout: (weight spec, bias spec, data spec, local loss).


def dp_loss(params, x, t):
    # f32[B/8, 32] through replicated weights; data over (dp, tp).
    return jax.lax.pmean(reference_loss(es.unbox(params), x, t), ("dp", "tp"))


def fsdp_loss(params, x, t):
    # Weights split over (dp, tp) on their input dimension, gathered before use.
    full = es.unbox(fsdp_gather_params(params, ("dp", "tp")))
    return jax.lax.pmean(reference_loss(full, x, t), ("dp", "tp"))


def _tp_forward(layers, x):
    for layer in layers:
        # f32[B/dp, in/tp] @ f32[in/tp, out] -> partial sums f32[B/dp, out]
        partial = x @ layer["w"]
        # reduce-scatter over tp along the features -> f32[B/dp, out/tp]
        x = jax.lax.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)
        x = jax.nn.relu(x + layer["b"][None])
    return x


def _tp_loss(out, t):
    # f32[B/dp, 4/tp]: sum over the outputs across tp, mean over the batch across dp.
    per_example = jax.lax.psum(jnp.sum((out - t) ** 2, axis=-1), "tp")
    return jax.lax.pmean(jnp.mean(per_example), "dp")


def tp_loss(params, x, t):
    return _tp_loss(_tp_forward(es.unbox(params), x), t)


def fsdp_tp_loss(params, x, t):
    # Weights over ("tp", "dp") on their input dimension: gathering over dp leaves each
    # tp device its row block, as plain TP has it.
    return _tp_loss(_tp_forward(es.unbox(fsdp_gather_params(params, "dp")), x), t)


LAYOUTS = {
    "DP": (P(), P(), P(("dp", "tp")), dp_loss),
    "FSDP": (P(("dp", "tp"), None), P(), P(("dp", "tp")), fsdp_loss),
    "TP": (P("tp", None), P("tp"), P("dp", "tp"), tp_loss),
    "FSDP+TP": (P(("tp", "dp"), None), P("tp"), P("dp", "tp"), fsdp_tp_loss),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_classic_layouts_equal_single_device(layout):
    w_spec, b_spec, data_spec, loss = LAYOUTS[layout]
    mesh = es.make_mesh("dp=4,tp=2")
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SIZES[0]))
    t = jax.random.normal(jax.random.key(2), (BATCH, SIZES[-1]))
    ref_loss, ref_grads = jax.value_and_grad(reference_loss)(params, x, t)

    sharded = es.filter_shard_map(
        loss, mesh=mesh, in_specs=(None, data_spec, data_spec), out_specs=P()
    )
    value, grads = jax.jit(jax.value_and_grad(sharded))(with_specs(params, w_spec, b_spec), x, t)
    assert_tree_allclose(value, ref_loss)
    assert_tree_allclose(es.unbox(grads), ref_grads)
    # Gradients come out split like the weights.
    assert grads[0]["w"].value.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)
