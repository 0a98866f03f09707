"""Your own Equinox model, round 3: model states into FSDP units, `unbox` and tied weights
under FSDP.

- A ResNet-style CNN whose stem's batch norm updates the state before the `ResBlock`
  units: the state (its integer counter computed under differentiation) enters each unit
  and the CNN trains to the one-device losses on fsdp=8 and dp=4,fsdp=2, both views.
- `es.unbox(model)` inside the local view gathers each FSDP unit's parameters (an
  embedding-only unit and a model of nested units): the one-device losses.
- A tied head reading `embed.weight`: through an FSDP unit, a `LayerConfigError` naming
  the path; with the guide's pattern (blocks wrapped, the model wrapped around them), the
  one-device losses, and the outer unit gathers only its own parameters.

The trained runs are cached per (model, layout, view) and shared between the tests.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.train import init_train_state, make_train_step

STEPS = 3
OPTIMIZER = optax.adamw(3e-3)


class ResBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d

    def __init__(self, c, *, key):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(c, c, 3, padding=1, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(c, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(c, c, 3, padding=1, use_bias=False, key=k2)

    def __call__(self, x, state):  # x: f32[C, H, W], one image
        h, state = self.norm(self.conv1(x), state)
        return x + self.conv2(jax.nn.relu(h)), state


class ResNet(eqx.Module):
    """A stem (conv, batch norm) before two residual blocks, written without equishard."""

    stem: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k0, k1, k2 = jax.random.split(key, 3)
        self.stem = eqx.nn.Conv2d(3, 16, 3, padding=1, use_bias=False, key=k0)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.blocks = [ResBlock(16, key=k) for k in jax.random.split(k1, 2)]
        self.head = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.stem(x), state)  # the state, updated before the units
        h = jax.nn.relu(h)
        for block in self.blocks:
            h, state = block(h, state)
        return self.head(h.mean(axis=(1, 2))), state


V, D = 64, 32


class Block(eqx.Module):
    norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.RMSNorm(D)
        self.up, self.down = eqx.nn.Linear(D, 4 * D, key=k1), eqx.nn.Linear(4 * D, D, key=k2)

    def __call__(self, x):  # x: f32[D], one token
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TiedLM(eqx.Module):
    """A language model whose head is the embedding's table (tied weights)."""

    embed: eqx.nn.Embedding
    blocks: list

    def __init__(self, *, key):
        k0, k1 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(V, D, key=k0)
        self.blocks = [Block(key=k) for k in jax.random.split(k1, 2)]

    def __call__(self, tokens):  # int32[S] -> f32[S, V]
        h = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            h = jax.vmap(block)(h)
        return h @ self.embed.weight.T / D


WRAPS = {
    "none": lambda m: m,
    "resblocks": lambda m: es.nn.fsdp_wrap(m, policy=lambda path, m: isinstance(m, ResBlock), min_weight_size=16),
    "embed": lambda m: es.nn.fsdp_wrap(m, policy=lambda path, m: path == "embed", min_weight_size=16),
    # The tied-head pattern: each block a unit, and the model wrapped around them.
    "tied": lambda m: es.nn.FSDP(es.nn.fsdp_wrap(m, policy=Block, min_weight_size=16), min_weight_size=16),
}


def _data(mesh):
    return tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))


def _resnet_loss(view, data):
    def loss_fn(model, state, batch, key):
        images, labels = batch
        if view == "global":
            model = es.unbox(model)
        forward = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
        logits, state = forward(images, state)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return (jax.lax.pmean(loss, data) if view == "local" else loss), ({}, state)

    return loss_fn


def _lm_loss(view, data, unbox):
    def loss_fn(model, batch, key):
        plain = es.unbox(model) if unbox else model
        logits = jax.vmap(plain)(batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return (jax.lax.pmean(loss, data) if view == "local" else loss), {}

    return loss_fn


@functools.cache
def _batches(kind):
    rng = np.random.default_rng(0)
    if kind == "resnet":
        return [(rng.normal(size=(16, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32))
                for _ in range(STEPS)]  # fmt: skip
    return [rng.integers(0, V, (16, 9)).astype(np.int32) for _ in range(STEPS)]


@functools.cache
def _train(kind, layout, view="local", wrap="none", unbox=True):
    mesh = es.make_mesh(layout)
    data = _data(mesh)

    def make(key):
        if kind == "resnet":
            model, state = eqx.nn.make_with_state(ResNet)(key=key)
            return WRAPS[wrap](model), state
        return WRAPS[wrap](TiedLM(key=key))

    loss = _resnet_loss(view, data) if kind == "resnet" else _lm_loss(view, data, unbox)
    state = init_train_state(make, OPTIMIZER, jax.random.key(0), mesh=mesh)
    step = make_train_step(loss, OPTIMIZER, mesh=mesh, batch_spec=P(data), view=view)
    losses = []
    for batch in _batches(kind):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def _assert_losses(losses, reference, tol=1e-5):
    assert len(losses) == len(reference) == STEPS
    for a, b in zip(losses, reference):
        assert abs(a - b) <= tol * abs(b), (losses, reference)


@pytest.mark.parametrize("view", ["local", "global"])
@pytest.mark.parametrize("layout", ["fsdp=8", "dp=4,fsdp=2"])
def test_a_state_updated_before_fsdp_units_enters_them(layout, view):
    reference = _train("resnet", "dp=1")
    assert reference[-1] != reference[0]
    _assert_losses(_train("resnet", layout, view, "resblocks"), reference)


@pytest.mark.parametrize("wrap", ["embed", "tied"])
def test_unbox_in_the_local_view_gathers_the_units(wrap):
    # `es.unbox(model)(x)` inside the local view: the units' parameters gathered, never
    # this device's blocks passed as the global parameter.
    _assert_losses(_train("lm", "fsdp=8", "local", wrap, unbox=True), _train("lm", "dp=1"))


@pytest.mark.parametrize("view", ["local", "global"])
def test_the_tied_head_pattern_trains_as_on_one_device(view):
    reference = _train("lm", "dp=1")
    _assert_losses(_train("lm", "dp=2,fsdp=4", view, "tied", unbox=view == "global"), reference)


def test_reading_a_split_parameter_through_a_unit_is_refused_by_path():
    with jax.set_mesh(es.make_mesh("fsdp=8")):
        model = WRAPS["embed"](TiedLM(key=jax.random.key(0)))
    with pytest.raises(es.LayerConfigError, match=r"`embed\.weight`: `embed` is an FSDP unit") as info:
        model.embed.weight  # noqa: B018
    assert "policy=lambda path, m: path == \"\"" in str(info.value)
    assert isinstance(info.value, AttributeError)  # hasattr keeps its meaning
    assert not hasattr(model.embed, "weight") and not hasattr(model.embed, "no_such_field")
    with pytest.raises(AttributeError, match="no_such_field"):
        model.embed.no_such_field  # noqa: B018


def test_a_unit_around_units_gathers_only_its_own_parameters():
    mesh = es.make_mesh("fsdp=8")
    with jax.set_mesh(mesh):
        model = WRAPS["tied"](TiedLM(key=jax.random.key(0)))
    inner = model.module.blocks[0].module.up.weight  # split over fsdp

    seen = []

    def gathered(model):
        outer = es.nn.fsdp_gather_params(model.module, "fsdp", skip_units=True)
        # f32[V, D] whole; the blocks' f32[4D/fsdp, D] still this device's blocks
        seen.append((outer.embed.weight.shape, outer.blocks[0].module.up.weight.value.shape))
        return jnp.zeros(())

    jax.eval_shape(es.filter_shard_map(gathered, mesh=mesh, out_specs=P()), model)
    assert inner.spec == P("fsdp", None)
    assert seen == [((V, D), (4 * D // 8, D))]


def test_a_plan_for_a_convolution_names_the_path_rule_route():
    class Net(eqx.Module):
        conv: eqx.nn.Conv2d

        def __init__(self, *, key):
            self.conv = eqx.nn.Conv2d(3, 8, 3, key=key)

    with pytest.raises(es.LayerConfigError, match=r"`conv` \(Conv2d\).*no style for a convolution") as info:
        es.parallelize(Net(key=jax.random.key(0)), {"conv": "column"}, es.make_mesh("dp=4,tp=2"))
    assert "path rules" in str(info.value) and 'view="global"' in str(info.value)
