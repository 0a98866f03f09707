"""`ml.models.parallel`'s layers and init: the reference's test ported, init types against
JAX oracles of the reference's distributions, `initialize_model_parallel_affine_weight_`.

Axes of size 2, 3 (a 3-device sub-mesh) and 4, each beside a data axis of size 2 where
the devices allow, as the reference's test (2 model-parallel x 2 data-parallel).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import equishard as es
from equishard.nn import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    init_weight,
    initialize_model_parallel_affine_weight_,
)

from .helpers import assert_tree_allclose

SIZES = (2, 3, 4)


@functools.cache
def mesh_of(n: int) -> Mesh:
    dp = 2 if 2 * n <= len(jax.devices()) else 1
    return Mesh(np.array(jax.devices()[: dp * n]).reshape(dp, n), ("dp", "tp"))


class DummyModel(eqx.Module):
    """The reference test's model: an embedding plus a two-layer MLP (widths divisible by 2, 3, 4)."""

    emb: ParallelEmbedding
    l1: ColumnParallelLinear
    l2: RowParallelLinear

    def __init__(self, lora_rank, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = ParallelEmbedding(10, 12, lora_rank=lora_rank, key=k1)
        self.l1 = ColumnParallelLinear(12, 24, bias=False, gather_output=False, lora_rank=lora_rank, key=k2)
        self.l2 = RowParallelLinear(24, 8, bias=False, input_is_parallel=True, lora_rank=lora_rank, key=k3)

    def __call__(self, x):
        y1 = self.l2(self.l1(self.emb(x)))
        # The full model from the master weights, gathered inside the parallel region.
        y2 = jnp.take(self.emb.master_weight, x, axis=0) @ self.l1.master_weight.T @ self.l2.master_weight.T
        return y1, y2


@functools.cache
def program(n, lora):
    mesh = mesh_of(n)

    def body(model, x):
        def loss(model, which):
            return jax.lax.psum(jnp.sum(model(x)[which]), "dp")

        y1, y2 = model(x)
        g1 = eqx.filter_grad(lambda m: loss(m, 0))(model)
        g2 = eqx.filter_grad(lambda m: loss(m, 1))(model)
        return y1, y2, g1, g2

    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh, in_specs=(None, P("dp")), out_specs=(P("dp"), P("dp"), None, None)))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lora", [None, 2])
def test_parallel_model(n, lora):
    """Port of ml-starter tests/utils/test_parallel.py: the parallel layers against the
    model built from their master weights, outputs and (without LoRA) gradients."""
    model = es.sharded_init(lambda k: DummyModel(lora, key=k), jax.random.key(1337), mesh=mesh_of(n))
    x = jax.random.randint(jax.random.key(0), (4, 12), 0, 10 - 1)
    y1, y2, g1, g2 = program(n, lora)(model, x)
    np.testing.assert_allclose(y1, y2, atol=1e-3)  # the reference's assertion
    assert_tree_allclose(y1, y2)
    if lora is None:
        for name in ("emb", "l1", "l2"):
            np.testing.assert_allclose(
                getattr(g1, name).weight.value, getattr(g2, name).weight.value, atol=1e-3
            )
        assert_tree_allclose(g1, g2)


def test_lora_embedding_changes_the_output_as_the_reference():
    emb = ParallelEmbedding(10, 12, lora_rank=2, lora_alpha=4.0, key=jax.random.key(0))
    emb = eqx.tree_at(lambda e: e.lora_a.value, emb, jax.random.normal(jax.random.key(1), (2, 10)))
    ids = jnp.array([[1, 2, 9]])
    a, b, w = emb.lora_a.value, emb.lora_b.value, emb.weight.value
    want = w[ids] + (4.0 / 2) * (a.T[ids] @ b.T)  # LoRAEmbedding.forward
    mesh = mesh_of(3)
    sharded = es.shard(emb, mesh)
    got = es.filter_shard_map(lambda e, i: e(i), mesh=mesh, in_specs=(None, P()), out_specs=P())(sharded, ids)
    assert_tree_allclose(got, want)
    assert_tree_allclose(emb(ids), want)


# ----------------------------------------------------------------------------- init types

# JAX oracles of ml-starter's init_ (ml/models/init.py), torch's defaults written out.
ORACLES = {
    "normal": lambda k, s: 0.01 * jax.random.normal(k, s),
    "biased_normal": lambda k, s: 0.01 * jax.random.normal(k, s),
    "uniform": lambda k, s: jax.random.uniform(k, s, minval=0.0, maxval=0.02),
    "trunc_normal": lambda k, s: 0.01 * jax.random.truncated_normal(k, -2 / 0.01, 2 / 0.01, s),
    "kaiming_uniform": lambda k, s: jax.random.uniform(k, s, minval=-1.0, maxval=1.0) * math.sqrt(2) * math.sqrt(3 / s[-1]),
    "kaiming_normal": lambda k, s: jax.random.normal(k, s) * math.sqrt(2) / math.sqrt(s[-1]),
    "xavier_uniform": lambda k, s: jax.random.uniform(k, s, minval=-1.0, maxval=1.0) * math.sqrt(6 / (s[0] + s[1])),
    "xavier_normal": lambda k, s: jax.random.normal(k, s) * math.sqrt(2 / (s[0] + s[1])),
    "ones": lambda k, s: jnp.ones(s),
}
# (mean, std, lower bound, upper bound) of each distribution on a [out=256, in=512] weight
MOMENTS = {
    "normal": (0.0, 0.01, -np.inf, np.inf),
    "biased_normal": (0.0, 0.01, -np.inf, np.inf),
    "uniform": (0.01, 0.02 / math.sqrt(12), 0.0, 0.02),
    "trunc_normal": (0.0, 0.01, -2.0, 2.0),
    "kaiming_uniform": (0.0, math.sqrt(2 / 512), -math.sqrt(6 / 512), math.sqrt(6 / 512)),
    "kaiming_normal": (0.0, math.sqrt(2 / 512), -np.inf, np.inf),
    "xavier_uniform": (0.0, math.sqrt(2 / 768), -math.sqrt(6 / 768), math.sqrt(6 / 768)),
    "xavier_normal": (0.0, math.sqrt(2 / 768), -np.inf, np.inf),
}


@pytest.mark.parametrize("init_type", list(ORACLES))
def test_init_types_draw_the_reference_distributions(init_type):
    key, shape = jax.random.key(3), (256, 512)
    got = np.asarray(init_weight(key, shape, init_type))
    assert_tree_allclose(got, np.asarray(ORACLES[init_type](key, shape)))
    if init_type in MOMENTS:
        mean, std, lo, hi = MOMENTS[init_type]
        assert abs(got.mean() - mean) < 4 * std / math.sqrt(got.size)
        assert abs(got.std() - std) < 0.02 * std
        assert got.min() >= lo and got.max() <= hi


def test_biased_normal_leaves_the_parallel_layers_bias_at_zero():
    key = jax.random.key(0)
    col = ColumnParallelLinear(8, 16, init_type="biased_normal", key=key)
    row = RowParallelLinear(16, 8, init_type="biased_normal", key=key)
    assert col.bias is not None and row.bias is not None
    assert not np.asarray(col.bias.value).any() and not np.asarray(row.bias.value).any()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stride", [1, 2])
def test_initialize_model_parallel_affine_weight_partitions_like_the_reference(n, stride):
    out_f, in_f, key = 12 * stride, 24, jax.random.key(9)
    master = np.asarray(init_weight(key, (out_f, in_f), "xavier_normal"))
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    for partition_dim, full in ((0, out_f), (-1, in_f)):
        per = full // n

        def local(k, partition_dim=partition_dim, per=per):
            w = initialize_model_parallel_affine_weight_(k, out_f, in_f, per, partition_dim, stride=stride, axis_name="tp")
            return w[None]

        got = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P("tp"))(key)
        # The reference: torch.split(master, per // stride, dim)[rank::world_size], concatenated.
        pieces = np.split(master, full // (per // stride), axis=partition_dim)
        for rank in range(n):
            want = np.concatenate(pieces[rank::n], axis=partition_dim)
            np.testing.assert_array_equal(np.asarray(got[rank]), want)
    # One device: the whole weight.
    np.testing.assert_array_equal(np.asarray(initialize_model_parallel_affine_weight_(key, out_f, in_f, out_f, 0)), master)
