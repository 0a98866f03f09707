"""LoRA adapter dropout on the reference GPT: the masks are a pure function of the key,
the layer, the target and each element's global coordinates, so a run with dropout
computes on every layout (and under `grad_accum`) what it computes on one device."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import global_index
from equishard.models import (
    GPT,
    GPTConfig,
    LoRA,
    adapters_trainable,
    add_lora,
    lora_trainable,
    token_batch,
)
from equishard.models._internal import to_single_device
from equishard.nn._internal import LoRADropout
from equishard.train import make_train_step, pack_windows

from .helpers import assert_tree_allclose, rel_err
from .test_lora import _adapters, _nonzero_b

# Four layers: a circular pipeline of 2 stages x 2 repeats holds one each.
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, d_ff=48)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DROP = LoRA(4, alpha=8.0, dropout=0.3, targets=TARGETS)
WINDOWS = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
RUN_KEY = jax.random.key(7)
KEY = jax.random.fold_in(RUN_KEY, 0)  # the key of a train state's first step (`fold_in(key, step)`)
# "+sp": sequence parallelism; "+r2": a circular pipeline (its layers stored out of
# order); "+1f1b": an explicit schedule (the loss computed inside the pipeline);
# "packed": documents packed with their boundaries (their positions and segment ids
# travel with a pipeline's activations, beside the examples' indices).
LAYOUTS = [
    ("dp=8", "remat"),  # each block recomputed in the backward pass: its masks too
    ("pp=2,dp=2,tp=2+r2", "plain"),
    ("pp=2,dp=2,tp=2+1f1b", "packed"),
    ("dp=2,cp=2,tp=2", "chunks"),  # also batch_chunks=2: the local batch in two pieces
]


def _batch(kind: str, cp: int = 1):
    if kind == "packed":
        return pack_windows(WINDOWS, eot=5, cp=cp)
    return token_batch(WINDOWS, cp) if cp > 1 else WINDOWS


def _model(lora: LoRA, par: es.Parallelism = es.Parallelism(), mesh=None, config: GPTConfig = CONFIG):
    """The adapted GPT (adapters with a non-zero `B`), on one device or on `par`'s `mesh`."""
    if mesh is None:
        base = GPT(config, key=jax.random.key(0))
    else:
        base = es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(0), mesh=mesh)
    return _nonzero_b(add_lora(base, lora, key=jax.random.key(1)))


@functools.cache
def _run_one_device():
    """`run(model, batch, key)`: the loss and the adapters' gradients on one device."""

    @eqx.filter_jit
    def run(model, batch, key):
        trainable, frozen = eqx.partition(model, lora_trainable(model))
        index = jnp.arange(WINDOWS.shape[0], dtype=jnp.int32)
        loss_fn = lambda tr: eqx.combine(tr, frozen).loss(batch, key, index=index)[0]  # noqa: E731
        return eqx.filter_value_and_grad(loss_fn)(trainable)

    return run


@functools.cache
def _reference(kind: str):
    """One device: with the mask of `KEY`, and without dropout (`key=None`)."""
    batch = jax.tree.map(jnp.asarray, _batch(kind))
    model, run = _model(DROP), _run_one_device()
    return run(model, batch, KEY), run(model, batch, None)


def _layout(layout: str):
    spec, options = layout.split("+")[0], layout.split("+")[1:]
    return es.Layout(
        spec, sequence_parallel="sp" in options, pipeline_repeats=2 if "r2" in options else 1,
        pipeline_schedule="1f1b" if "1f1b" in options else None,
    ).resolve()  # fmt: skip


def _sharded(layout: str, kind: str):
    """The loss and the adapters' gradients (on one device's layout) under `layout`."""
    par = _layout(layout)
    mesh, spec = par.mesh(), par.batch_spec
    options = {"chunks": {"batch_chunks": 2}, "remat": {"remat": "full"}}.get(kind, {})
    config = dataclasses.replace(CONFIG, **options)
    model = _model(DROP, par, mesh, config)

    def body(trainable, frozen, batch, key):
        batch = jax.tree.map(lambda x: x.value, batch, is_leaf=lambda x: isinstance(x, es.Sharded))
        ids = batch["inputs"] if isinstance(batch, dict) else batch
        # The indices a train step gives a loss function that takes `index`.
        index = global_index(ids.shape[0], par.data_axes or None)
        loss_fn = lambda tr: eqx.combine(tr, frozen).loss(batch, key, index=index)[0]  # noqa: E731
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        return loss, _adapters(grads)

    call = eqx.filter_jit(es.filter_shard_map(body, mesh=mesh, out_specs=(P(), None)))
    batch = jax.tree.map(lambda x: es.Sharded(jnp.asarray(x), spec), _batch(kind, par.size(par.context)))
    trainable, frozen = eqx.partition(model, lora_trainable(model))
    loss, grads = call(trainable, frozen, batch, KEY)
    grads = to_single_device(es.gather(eqx.tree_at(_adapters, model, grads, is_leaf=lambda x: x is None)))
    return loss, eqx.filter(grads, lora_trainable(grads))


@pytest.mark.parametrize("layout, kind", LAYOUTS, ids=[f"{lay}-{kind}" for lay, kind in LAYOUTS])
def test_dropout_equals_one_device(layout, kind):
    (ref_loss, ref_grads), (plain_loss, plain_grads) = _reference("packed" if kind == "packed" else "plain")
    loss, grads = _sharded(layout, kind)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_tree_allclose(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))  # configs may differ
    # ... and the masks drop something: not the undropped loss and gradients.
    assert abs(float(ref_loss) - float(plain_loss)) > 1e-3 * abs(float(plain_loss))
    assert max(rel_err(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads))) > 1e-2


def test_no_key_is_no_dropout():
    """`key=None` (evaluation) computes what the same adapters without dropout compute,
    bit for bit, as does a key given to a model without adapter dropout."""
    batch = jnp.asarray(WINDOWS)
    run = _run_one_device()
    _, (plain_loss, plain_grads) = _reference("plain")
    undropped = _model(LoRA(4, alpha=8.0, targets=TARGETS))  # the same arrays, dropout 0
    for key in (None, KEY):
        loss, grads = run(undropped, batch, key)
        assert float(loss) == float(plain_loss)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)))
    with pytest.raises(es.LayerConfigError, match=r"index has shape \(3,\); it must hold the global index of each of the 8"):
        _model(DROP).loss(jax.tree.map(jnp.asarray, token_batch(WINDOWS)), KEY, index=jnp.arange(3))


def test_keep_rate_and_scale():
    """About `1 - p` of the elements are kept, scaled by `1 / (1 - p)`; another target
    or layer draws another mask."""
    x = jnp.ones((8, 64, 96), jnp.float32)
    drop = LoRADropout.from_key(KEY, jnp.arange(8, dtype=jnp.int32), jnp.arange(64, dtype=jnp.int32))
    for rate in (0.1, 0.3, 0.5):
        y = np.asarray(drop.at(0, 3).apply(x, rate))
        kept = y != 0
        assert abs(kept.mean() - (1 - rate)) < 0.01, (rate, kept.mean())
        np.testing.assert_allclose(y[kept], 1 / (1 - rate), rtol=1e-6)
    masks = [np.asarray(drop.at(*where).apply(x, 0.3)) != 0 for where in ((0, 3), (0, 4), (1, 3))]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert abs((masks[a] == masks[b]).mean() - (0.7**2 + 0.3**2)) < 0.01  # independent


def test_grad_accum_and_layout_independent():
    """A train step whose loss function takes `index` (the examples' global indices) and
    passes it on draws the masks of one device without micro-steps, under any layout and
    `grad_accum`: its loss, gradient norm and update are the one-device ones (here on
    fsdp=4,tp=2 with sequence parallelism, in 2 micro-steps)."""
    (ref_loss, ref_grads), _ = _reference("plain")
    par = _layout("fsdp=4,tp=2+sp")
    config = CONFIG
    lr = 1e4  # the update -lr * g dwarfs the adapters: comparing them compares the gradients

    def loss_fn(model, batch, key, *, index):
        return model.loss(batch, key, index=index)

    step = make_train_step(
        loss_fn, optax.sgd(lr), mesh=par.mesh(), batch_spec=par.batch_spec, grad_accum=2,
        trainable=adapters_trainable(),
    )  # fmt: skip
    state = step.init_state(lambda k: GPT(config, par, key=k, lora=DROP), RUN_KEY)
    # The reference's model, made on the layout (its arrays do not depend on it).
    state = eqx.tree_at(lambda s: s.model, state, _model(DROP, par, par.mesh(), config))
    state, metrics = step(state, jnp.asarray(WINDOWS))
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    ref_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(ref_grads)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), ref_norm, rtol=1e-5)
    model = _model(DROP)
    adapters = eqx.filter(to_single_device(es.gather(state.model)), lora_trainable(model))
    expected = jax.tree.map(lambda p, g: p - lr * g, eqx.filter(model, lora_trainable(model)), ref_grads)
    assert_tree_allclose(jax.tree.leaves(adapters), jax.tree.leaves(expected))
