"""The train step's contract: what `make_train_step`'s step refuses, by name, and why.

Tiny models (a linear layer of 4 -> 2) on `dp=4`: every refusal happens before XLA
compiles anything, except the ones that need a step run (donation, a compiled step).
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.train import CompiledTrainStep, TrainStep, init_train_state, make_train_step

from .helpers import rel_err

SGD = optax.sgd(0.1)


@functools.cache
def _mesh(layout: str = "dp=4", first: int = 0) -> jax.sharding.Mesh:
    return es.make_mesh(layout, devices=jax.devices()[first:])


def _model(key, dtype=jnp.float32):
    model = eqx.nn.Linear(4, 2, key=key)
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


def _batch(n: int = 8):
    x = jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4) / (n * 4)
    return x, jnp.ones((n, 2), jnp.float32)


def _mse(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)


def _loss(model, batch, key):
    loss = jax.lax.pmean(_mse(model, batch), "dp")
    return loss, {"mse": loss}


def _state(optimizer=SGD, mesh=None, dtype=jnp.float32):
    mesh = mesh or _mesh()
    return init_train_state(lambda k: _model(k, dtype), optimizer, jax.random.key(0), mesh=mesh)


@functools.cache
def _step(donate: bool = True) -> TrainStep:
    """The shared step (one per `donate`), compiled once for `_batch()`."""
    return make_train_step(_loss, SGD, mesh=_mesh(), batch_spec=P("dp"), donate=donate)


@functools.cache
def _compiled() -> CompiledTrainStep:
    return _step().compile(_state(), _batch())


# --- the loss function's return value ---------------------------------------------------


def _fine(model, batch):
    return jax.lax.pmean(_mse(model, batch), "dp")


@pytest.mark.parametrize(
    "returns, match",
    [
        (lambda m, b: _fine(m, b), r"it returned float32\[\]"),
        (lambda m, b: (_fine(m, b), {}, 1.0), r"it returned a tuple of 3 \(float32\[\], a dict, a Python float"),
        (lambda m, b: (_fine(m, b), [_fine(m, b)]), r"its metrics are a list of 1 \(float32\[\]\), not a dict"),
        (lambda m, b: (jax.lax.pmean(jnp.mean(jax.vmap(m)(b[0]), 0), "dp"), {}), r"its loss has shape \(2,\)"),
        (lambda m, b: (jnp.sum(b[1] > 0), {}), r"its loss is int32\[\].*not floating"),
    ],
    ids=["bare-loss", "three-tuple", "metrics-list", "vector-loss", "integer-loss"],
)
def test_a_loss_function_that_breaks_the_contract_is_named(returns, match):
    step = make_train_step(lambda m, b, k: returns(m, b), SGD, mesh=_mesh(), batch_spec=P("dp"), donate=False)
    with pytest.raises(es.TrainStepError, match=match) as info:
        step(_state(), _batch())
    assert "loss_fn(model, batch, key) must return (loss, metrics)" in str(info.value)


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, float("nan")])
def test_clip_norm_must_be_positive(clip_norm):
    with pytest.raises(es.TrainStepError, match=rf"clip_norm must be a global norm above 0, or None for no clipping; got {clip_norm!r}"):
        make_train_step(_loss, SGD, mesh=_mesh(), batch_spec=P("dp"), clip_norm=clip_norm)


# --- the optimizer ----------------------------------------------------------------------


def test_bf16_parameters_with_a_float32_adam_state_train_as_optax_does():
    optimizer = optax.adam(1e-2, mu_dtype=jnp.float32)
    mesh = es.make_mesh("dp=1")
    state = _state(optimizer, mesh, jnp.bfloat16)
    step = make_train_step(_loss, optimizer, mesh=mesh, batch_spec=P("dp"))
    # The reference: plain optax on one device, from the same initial model.
    model = _model(jax.random.fold_in(jax.random.key(0), 0), jnp.bfloat16)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optimizer.init(params)
    for i in range(3):
        batch = _batch()
        state, metrics = step(state, batch)
        loss, grads = eqx.filter_value_and_grad(lambda p: _mse(eqx.combine(p, static), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert rel_err(metrics["loss"], loss) <= 1e-2
    ours, theirs = state.opt_state[0].mu.weight, opt_state[0].mu.weight  # pyright: ignore
    assert state.model.weight.dtype == jnp.bfloat16 and ours.dtype == jnp.float32
    assert rel_err(state.model.weight, params.weight) <= 1e-2  # pyright: ignore
    assert rel_err(ours, theirs) <= 1e-2


def _transform(update_state) -> optax.GradientTransformationExtraArgs:
    def init(params):
        return (jax.tree.map(jnp.zeros_like, params),)

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -0.1 * g, updates), update_state(state)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize(
    "update_state, match",
    [
        (lambda s: (s[0], s[0]), r"optimizer.update returned an optimizer state of another structure"),
        (
            lambda s: (jax.tree.map(lambda x: x.astype(jnp.bfloat16), s[0]),),
            r"changed the optimizer state's `opt_state\[0\]\.weight` from float32\[2, 4\] \(as "
            r"optimizer.init built it\) to bfloat16\[2, 4\]",
        ),
    ],
    ids=["structure", "dtype"],
)
def test_an_optimizer_whose_state_changes_is_named(update_state, match):
    optimizer = _transform(update_state)
    step = make_train_step(_loss, optimizer, mesh=_mesh(), batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match=match):
        step(_state(optimizer), _batch())


# --- the state and the batch ------------------------------------------------------------


@pytest.mark.parametrize(
    "layout, first, given",
    [
        ("dp=8", 0, r"\{'dp': 8\} of devices \[0, 1, 2, 3, 4, 5, 6, 7\]"),
        ("dp=4", 4, r"\{'dp': 4\} of devices \[4, 5, 6, 7\]"),
    ],
    ids=["another-layout", "other-devices"],
)
def test_a_state_of_another_mesh_is_named(layout, first, given):
    state = _state(mesh=_mesh(layout, first))
    with pytest.raises(es.TrainStepError, match=rf"the state.s `step` is laid out on mesh {given}; this step runs on mesh \{{'dp': 4\}} of devices \[0, 1, 2, 3\]"):
        _step(donate=False)(state, _batch())


def test_a_compiled_step_refuses_another_batch_shape():
    with pytest.raises(es.TrainStepError, match=r"compiled for a batch whose `batch\[0\]` is float32\[8, 4\], and was given float32\[16, 4\]"):
        _compiled()(_state(), _batch(16))


def test_a_donated_state_is_refused_not_a_crash():
    state = _state()
    new, _ = _step()(state, _batch())
    for step in (_step(), _compiled()):
        with pytest.raises(es.TrainStepError, match=r"the state.s `step` has been deleted: this state was donated") as info:
            step(state, _batch())
        assert "donate=False" in str(info.value)
    # What the step returned goes on; with donate=False the state it was given stays.
    _compiled()(new, _batch())
    kept = _state()
    once, _ = _step(donate=False)(kept, _batch())
    again, _ = _step(donate=False)(kept, _batch())
    assert rel_err(once.model.weight, again.model.weight) == 0.0


# --- the parts ---------------------------------------------------------------------------


def test_accumulate_carries_a_model_state_through_the_micro_steps_in_order():
    from equishard.train._gradients import accumulate

    def one(i, part, seen):  # the state records the micro-batches in the order they came
        out = (jnp.sum(part), {"first": part[0]}, {"g": part * 2.0})
        return seen.at[i].set(part[0]), out

    micro = jnp.arange(8.0).reshape(4, 2)
    result = accumulate(one, micro, 4, jnp.full(4, -1.0))
    assert result is not None
    seen, (loss, metrics, grads) = result
    assert seen.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert float(loss) == 7.0 and float(metrics["first"]) == 3.0
    assert grads["g"].tolist() == [6.0, 8.0]


def test_split_microbatches_takes_each_shards_slice():
    from equishard.core._microbatch import split_microbatches

    x = jnp.arange(8)
    assert split_microbatches(x, 2, what="t").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_microbatches(x, 2, what="t", shards=2).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(es.LayerConfigError, match=r"t: an input of shape \(8,\) cannot be split into 2 data shards x grad_accum=3 equal"):
        split_microbatches(x, 3, what="t", name="grad_accum", shards=2)


def test_train_state_fields_are_those_of_the_checkpoint_format(monkeypatch):
    from equishard.train import _state

    _state._check_fields()  # as defined
    monkeypatch.setitem(_state.TRAIN_STATE_FIELDS, _state.FORMAT_VERSION, ("step", "model"))
    with pytest.raises(RuntimeError, match="a change to TrainState needs a new FORMAT_VERSION"):
        _state._check_fields()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"xla_bogus_option": 1}, r"XLA refuses compiler_options \{'xla_bogus_option': 1\}: .*No such compile option: 'xla_bogus_option'"),
        ({"xla_backend_optimization_level": "fast"}, r"xla_backend_optimization_level, 'fast' is not a valid int32 value"),
        ({"xla_backend_optimization_level": [0]}, r"each value must be a number, a bool or a string"),
    ],
)
def test_compiler_options_xla_refuses_are_named_before_tracing(options, match):
    def loss_fn(model, batch, key):
        raise AssertionError("traced")  # the options are refused before

    with pytest.raises(es.EquishardError, match=rf"make_train_step: .*{match}"):
        make_train_step(loss_fn, SGD, mesh=_mesh(), batch_spec=P("dp"), compiler_options=options)
    with pytest.raises(es.EquishardError, match=rf"sharded_init: .*{match}"):
        es.sharded_init(_model, jax.random.key(0), mesh=_mesh(), compiler_options=options)
