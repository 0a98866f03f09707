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
from equishard.report import read_collectives
from equishard.nn import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, vocab_parallel_cross_entropy

from .helpers import assert_tree_allclose

B, T, V, IN, OUT = 4, 8, 40, 16, 24
PAD, IGNORE = 3, -100
LAYOUTS = ["dp=1,tp=1", "dp=1,tp=2", "dp=1,tp=4", "dp=1,tp=8", "dp=2,tp=4"]
SEQUENCE_SPLIT = ("emb_sp", "emb_vocab_sp")


def out_spec(name):
    return P("dp", "tp") if name in SEQUENCE_SPLIT else P("dp")


def perturb(tree, key, scale=0.1):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    out = [x + scale * jax.random.normal(k, x.shape, x.dtype) if eqx.is_inexact_array(x) else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


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


def apply(layers, ids, h, logits, labels):
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


@functools.cache
def reference():
    """eqx.nn's Embedding -> Linear -> Linear on the master weights, and optax's cross-entropy."""
    layers, ids, h, logits, labels, probes = problem()
    plain = {n: tuple(to_eqx(p) for p in l) if isinstance(l, tuple) else to_eqx(l) for n, l in layers.items()}

    def padded(module, ids):
        return jnp.where((ids == PAD)[..., None], 0.0, per_token(module, ids))

    def loss(plain, h, logits):
        emb, col, row = plain["chain"]
        ce_head = optax.softmax_cross_entropy_with_integer_labels(
            per_token(plain["head"], h), jnp.where(labels == IGNORE, 0, labels)
        )
        outs = {
            "emb": per_token(plain["emb"], ids),
            "emb_vocab": padded(plain["emb_vocab"], ids),
            "emb_pad": padded(plain["emb_pad"], ids),
            "chain": per_token(row, per_token(col, per_token(emb, ids))),
            "ce_head": jnp.where(labels == IGNORE, 0.0, ce_head),
            "ce": optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0)),
            "emb_sp": per_token(plain["emb_sp"], ids),
            "emb_vocab_sp": per_token(plain["emb_vocab_sp"], ids),
        }
        return sum(jnp.sum(outs[n] * probes[n]) for n in outs), outs

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(plain, h, logits)
    return outs, grads


@functools.cache
def problem():
    key = jax.random.key(1)
    kl, kp, ki, kh, kg, kq = jax.random.split(key, 6)
    layers = perturb(build(kl), kp)
    ids = jax.random.randint(ki, (B, T), 0, V).at[:, 0].set(PAD)  # the padding row is used
    labels = jax.random.randint(jax.random.fold_in(ki, 1), (B, T), 0, V).at[0, :3].set(IGNORE)
    h = jax.random.normal(kh, (B, T, IN))
    logits = 3.0 * jax.random.normal(kg, (B, T, V))
    shapes = {"emb": (B, T, IN), "emb_vocab": (B, T, IN), "emb_pad": (B, T, IN), "chain": (B, T, OUT), "ce_head": (B, T), "ce": (B, T), "emb_sp": (B, T, IN), "emb_vocab_sp": (B, T, IN)}
    probes = {n: jax.random.normal(jax.random.fold_in(kq, i), s) for i, (n, s) in enumerate(shapes.items())}
    return layers, ids, h, logits, labels, probes


def masters_of(layers):
    """Global parameters in eqx.nn's layout: the layers' gradients compared to the reference's."""
    out = {}
    for name, layer in layers.items():
        parts = layer if isinstance(layer, tuple) else (layer,)
        out[name] = tuple(
            {"w": p.master_weight} if isinstance(p, ParallelEmbedding) else {"w": p.master_weight, "b": p.master_bias}
            for p in parts
        )
    return out


def reference_masters(grads):
    out = {}
    for name, g in grads.items():
        parts = g if isinstance(g, tuple) else (g,)
        out[name] = tuple({"w": p.weight} if isinstance(p, eqx.nn.Embedding) else {"w": p.weight, "b": p.bias} for p in parts)
    return out


@functools.cache
def sharded_step(layout):
    mesh = es.make_mesh(layout)

    def body(layers, ids, h, logits, labels, probes):
        def loss(layers, h, logits):
            outs = apply(layers, ids.value, h.value, logits.value, labels.value)
            total = 0.0
            for n, out in outs.items():
                axes = ("dp", "tp") if n in SEQUENCE_SPLIT else ("dp",)
                total = total + jax.lax.psum(jnp.sum(out * probes[n].value), axes)
            return total, outs

        (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(layers, h, logits)
        return {n: es.Sharded(o, out_spec(n)) for n, o in outs.items()}, grads

    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embeddings_and_cross_entropy_equal_unsharded(layout):
    layers, ids, h, logits, labels, probes = problem()
    ref_out, ref_grads = reference()
    step = sharded_step(layout)
    outs, grads = step(
        layers,
        es.Sharded(ids, P("dp")),
        es.Sharded(h, P("dp")),
        es.Sharded(logits, P("dp", None, "tp")),
        es.Sharded(labels, P("dp")),
        {n: es.Sharded(p, out_spec(n)) for n, p in probes.items()},
    )
    assert_tree_allclose(es.unbox(outs), ref_out)
    layer_grads, h_grad, logits_grad = es.gather(grads)
    assert_tree_allclose(masters_of(layer_grads), reference_masters(ref_grads[0]))
    assert_tree_allclose(es.unbox(h_grad), ref_grads[1])
    assert_tree_allclose(es.unbox(logits_grad), ref_grads[2])
    # The padding row gets no gradient.
    for name in ("emb_vocab", "emb_pad"):
        assert float(jnp.abs(layer_grads[name].master_weight[PAD]).sum()) == 0.0


def test_cross_entropy_never_holds_the_full_vocabulary():
    _, _, _, logits, labels, _ = problem()
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
    dims = [int(d) for group in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", compiled.as_text()) for d in group.split(",") if d]
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
