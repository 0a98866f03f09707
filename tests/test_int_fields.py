"""Integer and boolean array fields pass through the train step.

A model holding an `int32` counter and a `bool` mask beside its weights trains with
adam-family optimizers as on one device: only its floating arrays are differentiated,
optimized, clipped and checked for finiteness (optax sees `eqx.filter(model,
eqx.is_inexact_array)`), the others are carried and checkpointed unchanged.

One program trains three copies of the model, one under each optimizer
(`optax.multi_transform`: each optimizer sees its copy's arrays alone, as it would
train that copy by itself): three compiles per layout become one.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.train import Checkpointer, init_train_state, make_train_step

from .helpers import assert_tree_allclose

DIM, BATCH, STEPS = 48, 16, 5


class Masked(eqx.Module):
    """An MLP whose first weight is masked by a fixed `bool` pattern, with an `int32`
    field that scales its output (a counter a user keeps in the model)."""

    first: eqx.nn.Linear
    second: eqx.nn.Linear
    mask: jax.Array  # bool[DIM, DIM]: split over fsdp by FSDP (2304 elements)
    scale: jax.Array  # int32[]

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.first = eqx.nn.Linear(DIM, DIM, key=k1)
        self.second = eqx.nn.Linear(DIM, 1, key=k2)
        self.mask = jax.random.bernoulli(k3, 0.7, (DIM, DIM))
        self.scale = jnp.array(3, jnp.int32)

    def __call__(self, x):
        h = jnp.tanh((self.first.weight * self.mask) @ x + self.first.bias)
        return self.second(h)[0] / self.scale


OPTIMIZERS: dict[Hashable, optax.GradientTransformation] = {
    "adamw": optax.adamw(1e-2),
    "lamb": optax.lamb(1e-2),
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=32),
}


def _labels(models):
    """Each array of `models[name]` labelled `name`, for `optax.multi_transform`."""
    return {name: jax.tree.map(lambda _: name, part) for name, part in models.items()}


OPTIMIZER = optax.multi_transform(OPTIMIZERS, _labels)


def make_model(layout):
    def make(key):
        models = {name: Masked(key=jax.random.fold_in(key, i)) for i, name in enumerate(OPTIMIZERS)}
        if "fsdp" in layout:  # one unit per copy
            return es.nn.fsdp_wrap(models, "fsdp", policy=lambda path, m: isinstance(m, Masked))
        return models

    return make


def loss_for(axis):
    def loss_fn(models, batch, key):
        x, y = batch
        losses = {name: jax.lax.pmean(jnp.mean((jax.vmap(m)(x) - y) ** 2), axis) for name, m in models.items()}
        return jnp.sum(jnp.stack(list(losses.values()))), losses

    return loss_fn


@functools.cache
def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(BATCH, DIM)).astype(np.float32), rng.normal(size=BATCH).astype(np.float32)) for _ in range(STEPS)]


@functools.cache
def _train(layout):
    mesh = es.make_mesh(layout)
    axis = mesh.axis_names[0]
    state = init_train_state(make_model(layout), OPTIMIZER, jax.random.key(0), mesh=mesh)
    step = make_train_step(loss_for(axis), OPTIMIZER, mesh=mesh, batch_spec=P(axis), clip_norm=1.0)  # fmt: skip
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append({name: float(metrics[str(name)]) for name in OPTIMIZERS})
    return state, losses


def _plain(model):
    return es.unbox(es.gather(model))


@pytest.mark.parametrize("layout", ["dp=8", "fsdp=8"])
def test_integer_and_boolean_fields_pass_through(layout):
    state, losses = _train(layout)
    ref, reference = _train("dp=1")
    for name in OPTIMIZERS:  # adamw, LAMB, adafactor
        errors = [abs(a[name] - b[name]) / abs(b[name]) for a, b in zip(losses, reference)]
        assert max(errors) <= 1e-5, (name, errors)
    assert_tree_allclose(_plain(state.model), _plain(ref.model))
    initial = make_model("dp=1")(jax.random.fold_in(jax.random.key(0), 0))
    for name, trained in _plain(state.model).items():
        assert trained.mask.dtype == jnp.bool_
        assert bool((np.asarray(trained.mask) == np.asarray(initial[name].mask)).all())
        assert int(trained.scale) == 3 and trained.scale.dtype == jnp.int32
    # optax sees the floating arrays only, as `eqx.filter(model, eqx.is_inexact_array)`
    for leaf in jax.tree.leaves(es.unbox(state.opt_state)):
        assert not jnp.issubdtype(leaf.dtype, jnp.bool_)


def test_integer_and_boolean_fields_round_trip_a_checkpoint(tmp_path):
    state, _ = _train("fsdp=8")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(STEPS, state)
        records = {r["path"]: r for r in ckpt.read_metadata()["arrays"]}
    assert records["model['lamb'].module.mask"]["dtype"] == "bool"
    assert records["model['lamb'].module.scale"]["dtype"] == "int32"
    like = eqx.filter_eval_shape(lambda: init_train_state(make_model("fsdp=8"), OPTIMIZER, jax.random.key(0), mesh=es.make_mesh("fsdp=8")))
    with Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(like, mesh=es.make_mesh("fsdp=8"))
    assert_tree_allclose(_plain(restored.model), _plain(state.model), rtol=0)
    assert bool((np.asarray(_plain(restored.model)["lamb"].mask) == np.asarray(_plain(state.model)["lamb"].mask)).all())


def test_warnings_point_at_the_users_line():
    mesh = es.make_mesh("fsdp=8")
    model = {"small": eqx.nn.Linear(4, 4, key=jax.random.key(0))}
    with pytest.warns(UserWarning, match="splits 0 of the") as record:
        es.nn.fsdp_wrap(model, "fsdp", policy=lambda path, m: path == "['small']", mesh=mesh)  # this line
    assert record[0].filename == __file__, record[0].filename
    with pytest.warns(UserWarning, match="splits 0 of the") as record:
        es.nn.FSDP(eqx.nn.Linear(4, 4, key=jax.random.key(0)), "fsdp", mesh=mesh)
    assert record[0].filename == __file__, record[0].filename
