"""`parallelize` and an `eqx.nn.Dropout` on a split activation (timm's ViT MLP: dropout
after `fc1`, whose output a plan splits over tp): with the plan entry the message
names, it trains to the one-device losses; without it, the dropout's path is named in a
`LayerConfigError`, with and without a probe, before anything trains on other masks.
"""

from __future__ import annotations

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import example_keys
from equishard.train import init_train_state, make_train_step

DIM, HIDDEN, TOKENS, BATCH, STEPS = 32, 64, 4, 8, 4


class Mlp(eqx.Module):
    """timm's `Mlp`: fc1, GELU, dropout, fc2, dropout."""

    fc1: eqx.nn.Linear
    drop1: eqx.nn.Dropout
    fc2: eqx.nn.Linear
    drop2: eqx.nn.Dropout

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(DIM, HIDDEN, key=k1)
        self.drop1 = eqx.nn.Dropout(0.2)
        self.fc2 = eqx.nn.Linear(HIDDEN, DIM, key=k2)
        self.drop2 = eqx.nn.Dropout(0.2)

    def __call__(self, x, *, key):  # x: f32[D], one token
        k1, k2 = jax.random.split(key)
        h = self.drop1(jax.nn.gelu(self.fc1(x)), key=k1)  # f32[H] (local: f32[H/tp])
        return self.drop2(self.fc2(h), key=k2)


class Net(eqx.Module):
    mlp: Mlp
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.mlp = Mlp(key=k1)
        self.head = eqx.nn.Linear(DIM, 1, key=k2)

    def __call__(self, x, *, key):  # x: f32[T, D]
        keys = jax.random.split(key, x.shape[0])
        h = x + jax.vmap(self.mlp)(x, key=keys)
        return self.head(h.mean(0))[0]


BASE_PLAN = {r"mlp\.fc1": "column", r"mlp\.fc2": "row"}
FIXED_PLAN = {**BASE_PLAN, r"mlp\.drop1": es.nn.DropoutParallel(dim=-1)}


@functools.cache
def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(BATCH, TOKENS, DIM)).astype(np.float32), rng.normal(size=BATCH).astype(np.float32))
            for _ in range(STEPS)]  # fmt: skip


def loss_for(axes):
    def loss_fn(model, batch, key, *, index):
        x, y = batch
        pred = jax.vmap(model)(x, key=example_keys(key, index))
        return jax.lax.pmean(jnp.mean((pred - y) ** 2), axes), {}

    return loss_fn


def probe(model):
    return model(_batches()[0][0][0], key=jax.random.key(3))


def _train(layout, plan=None, with_probe=False):
    mesh = es.make_mesh(layout)
    data = tuple(a for a in mesh.axis_names if a == "dp")

    def make(key):
        model = Net(key=key)
        if plan is not None:
            model = es.parallelize(model, plan, mesh, probe=probe if with_probe else None)
        return model

    optimizer = optax.adamw(1e-2)
    state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(loss_for(data), optimizer, mesh=mesh, batch_spec=P(data))
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


@functools.cache
def _reference():
    return _train("dp=1")


@pytest.mark.parametrize("with_probe", [False, True])
def test_dropout_on_a_split_activation_trains_as_on_one_device_with_the_named_entry(with_probe):
    losses = _train("dp=4,tp=2", FIXED_PLAN, with_probe)
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, _reference())]
    assert max(errors) <= 1e-5, errors


def test_dropout_on_a_split_activation_is_refused_by_path_without_a_probe():
    with pytest.raises(es.LayerConfigError, match=r"Dropout at `mlp\.drop1` acts on an activation split over 'tp'") as info:
        _train("dp=4,tp=2", BASE_PLAN)
    # The entry it suggests is the fix tested above.
    assert re.escape(r'r"mlp\.drop1": es.nn.DropoutParallel(dim=...)') in re.escape(str(info.value))


def test_dropout_on_a_split_activation_is_refused_by_path_with_a_probe():
    mesh = es.make_mesh("dp=4,tp=2")
    with pytest.raises(es.LayerConfigError, match=r"Dropout at `mlp\.drop1`"):
        es.parallelize(Net(key=jax.random.key(0)), BASE_PLAN, mesh, probe=probe)


def test_dropout_on_a_whole_activation_is_the_one_device_dropout():
    model = es.parallelize(Net(key=jax.random.key(0)), FIXED_PLAN, es.make_mesh("dp=4,tp=2"))
    assert isinstance(model.mlp.drop2, es.nn.GuardedDropout)  # after the row layer: whole
    assert isinstance(model.mlp.drop1, es.nn.SplitDropout)
    plain = es.unbox(model)
    assert type(plain.mlp.drop1) is eqx.nn.Dropout and type(plain.mlp.drop2) is eqx.nn.Dropout


def test_dropout_parallel_refuses_a_module_that_is_no_dropout():
    with pytest.raises(es.LayerConfigError, match=r"mlp\.fc1"):
        es.parallelize(Net(key=jax.random.key(0)), {r"mlp\.fc1": es.nn.DropoutParallel()}, es.make_mesh("dp=4,tp=2"))
