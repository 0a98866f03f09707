"""ParallelEmbedding (split over features or over the vocabulary, with padding),
Embedding -> Column -> Row against eqx.nn's Embedding -> Linear -> Linear, and
vocab_parallel_cross_entropy against optax: forward and every gradient on tp = 1, 2, 4, 8
and dp=2 x tp=4; the cross-entropy's compiled program never holds the full vocabulary."""

from __future__ import annotations

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.nn import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    vocab_parallel_cross_entropy,
)
from equishard.report import read_collectives

from .helpers import check_against_single_device, perturb

B, T, V, IN, OUT = 4, 8, 40, 16, 24
PAD, IGNORE = 3, -100
LAYOUTS = ["dp=1,tp=1", "dp=1,tp=2", "dp=1,tp=4", "dp=1,tp=8", "dp=2,tp=4"]
SEQUENCE_SPLIT = ("emb_sp", "emb_vocab_sp")


def out_spec(name):
    return P("dp", "tp") if name in SEQUENCE_SPLIT else P("dp")


def build(key):
    k = jax.random.split(key, 6)
    return {
        "emb": ParallelEmbedding(V, IN, key=k[0]),
        "emb_vocab": ParallelEmbedding(V, IN, partition="vocab", padding_idx=PAD, init_type="normal", key=k[1]),
        "emb_pad": ParallelEmbedding(V, IN, padding_idx=PAD - V, key=k[2]),
        "chain": (
            ParallelEmbedding(V, IN, key=k[3]),
            ColumnParallelLinear(IN, OUT, gather_output=False, key=k[4]),
            RowParallelLinear(OUT, OUT, input_is_parallel=True, key=k[5]),
        ),
        "head": ColumnParallelLinear(IN, V, gather_output=False, key=jax.random.fold_in(key, 9)),
        # Outputs split over the tokens, for a sequence-parallel block.
        "emb_sp": ParallelEmbedding(V, IN, sequence_parallel=True, key=jax.random.fold_in(key, 10)),
        "emb_vocab_sp": ParallelEmbedding(V, IN, partition="vocab", sequence_parallel=True, key=jax.random.fold_in(key, 11)),
    }


def apply(layers, inputs):
    ids, h, logits, labels = (inputs[k] for k in ("ids", "h", "logits", "labels"))
    emb, col, row = layers["chain"]
    return {
        "emb": layers["emb"](ids),
        "emb_vocab": layers["emb_vocab"](ids),
        "emb_pad": layers["emb_pad"](ids),
        "chain": row(col(emb(ids))),
        "ce_head": vocab_parallel_cross_entropy(layers["head"](h), labels, "tp", ignore_index=IGNORE),
        "ce": vocab_parallel_cross_entropy(logits, jnp.maximum(labels, 0), "tp"),
        "emb_sp": layers["emb_sp"](ids),
        "emb_vocab_sp": layers["emb_vocab_sp"](ids),
    }


def to_eqx(layer):
    """Equinox's own single-device layer holding a parallel layer's master weights."""
    if isinstance(layer, ParallelEmbedding):
        return eqx.nn.Embedding(weight=layer.master_weight)
    plain = eqx.nn.Linear(layer.in_features, layer.out_features, key=jax.random.key(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), plain, (layer.master_weight, layer.master_bias))


def per_token(module, x):
    return jax.vmap(jax.vmap(module))(x)


def reference(layers, inputs):
    """eqx.nn's Embedding -> Linear -> Linear on the master weights, and optax's cross-entropy."""
    ids, h, logits, labels = (inputs[k] for k in ("ids", "h", "logits", "labels"))
    plain = {n: tuple(to_eqx(p) for p in l) if isinstance(l, tuple) else to_eqx(l) for n, l in layers.items()}

    def padded(module, ids):
        return jnp.where((ids == PAD)[..., None], 0.0, per_token(module, ids))

    chain = plain["chain"]
    assert isinstance(chain, tuple)
    emb, col, row = chain
    ce_head = optax.softmax_cross_entropy_with_integer_labels(
        per_token(plain["head"], h), jnp.where(labels == IGNORE, 0, labels)
    )
    return {
        "emb": per_token(plain["emb"], ids),
        "emb_vocab": padded(plain["emb_vocab"], ids),
        "emb_pad": padded(plain["emb_pad"], ids),
        "chain": per_token(row, per_token(col, per_token(emb, ids))),
        "ce_head": jnp.where(labels == IGNORE, 0.0, ce_head),
        "ce": optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0)),
        "emb_sp": per_token(plain["emb_sp"], ids),
        "emb_vocab_sp": per_token(plain["emb_vocab_sp"], ids),
    }


@functools.cache
def problem():
    key = jax.random.key(1)
    kl, kp, ki, kh, kg = jax.random.split(key, 5)
    layers = perturb(build(kl), kp)
    ids = jax.random.randint(ki, (B, T), 0, V).at[:, 0].set(PAD)  # the padding row is used
    labels = jax.random.randint(jax.random.fold_in(ki, 1), (B, T), 0, V).at[0, :3].set(IGNORE)
    h = jax.random.normal(kh, (B, T, IN))
    logits = 3.0 * jax.random.normal(kg, (B, T, V))
    return layers, ids, h, logits, labels


OUT_SPECS = {n: out_spec(n) for n in ("emb", "emb_vocab", "emb_pad", "chain", "ce_head", "ce", "emb_sp", "emb_vocab_sp")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embeddings_and_cross_entropy_equal_unsharded(layout):
    layers, ids, h, logits, labels = problem()
    inputs = {
        "ids": es.Sharded(ids, P("dp")),
        "h": es.Sharded(h, P("dp")),
        "logits": es.Sharded(logits, P("dp", None, "tp")),
        "labels": es.Sharded(labels, P("dp")),
    }
    [(_, (layer_grads, _))] = check_against_single_device(
        layers, apply, inputs, [layout], out_specs=OUT_SPECS, reference=reference
    )
    # The padding row gets no gradient.
    layer_grads = es.gather(layer_grads)
    for name in ("emb_vocab", "emb_pad"):
        assert float(jnp.abs(layer_grads[name].master_weight[PAD]).sum()) == 0.0


def test_cross_entropy_never_holds_the_full_vocabulary():
    _, _, _, logits, labels = problem()
    mesh = es.make_mesh("tp=4")

    def body(logits, labels):
        def loss(logits):
            per_token = vocab_parallel_cross_entropy(logits.value, labels, "tp", ignore_index=IGNORE)
            return jnp.mean(per_token)

        return jax.value_and_grad(loss)(logits)

    fn = jax.jit(es.filter_shard_map(body, mesh=mesh))
    compiled = fn.lower(es.Sharded(logits, P(None, None, "tp")), labels).compile()
    ops = read_collectives(compiled)
    assert ops, "the sharded program communicates"
    for op in ops:
        for _, shape in (*op.operand_shapes, *op.result_shapes):
            assert V not in shape, (op.kind, shape)
    text = compiled.as_text()
    assert text is not None
    dims = [int(d) for group in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", text) for d in group.split(",") if d]
    assert V // 4 in dims and V not in dims


def test_configuration_errors_name_the_layer_and_value():
    key = jax.random.key(0)
    for bad in (V, -V - 1):
        with pytest.raises(es.LayerConfigError, match=rf"ParallelEmbedding: padding_idx={bad} is out of range for num_embeddings={V}"):
            ParallelEmbedding(V, IN, padding_idx=bad, key=key)
    with pytest.raises(es.LayerConfigError, match=r"ParallelEmbedding: unknown partition 'rows'"):
        ParallelEmbedding(V, IN, partition="rows", key=key)
    with pytest.raises(es.LayerConfigError, match=r"ParallelEmbedding: unknown init_type 'glorot'"):
        ParallelEmbedding(V, IN, init_type="glorot", key=key)
    mesh = es.make_mesh("tp=8")
    ids = jnp.zeros((2, 3), jnp.int32)
    for partition, dim, name in (("embedding", 12, "embedding_dim=12"), ("vocab", 12, "num_embeddings=12")):
        layer = ParallelEmbedding(12, 12, partition=partition, key=key)
        with pytest.raises(es.EquishardError, match=r"weight` \(shape \(12, 12\)\).*not divisible by 8"):
            es.filter_shard_map(lambda layer, ids: layer(ids), mesh=mesh)(layer, ids)
        replicated = jax.shard_map(lambda layer, ids: layer(ids), mesh=mesh, in_specs=P(), out_specs=P())
        with pytest.raises(es.LayerConfigError, match=rf"ParallelEmbedding: {name} is not divisible by 8"):
            jax.eval_shape(replicated, layer, ids)
        del dim
