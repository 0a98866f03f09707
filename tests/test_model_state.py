"""Stateful models (`eqx.nn.State`: batch norms) and integer and boolean fields.

A plain-Equinox CNN with `eqx.nn.BatchNorm`, built with `eqx.nn.make_with_state`, trains
through `make_train_step` on every data layout to the one-device losses and running
statistics; a model holding an `int32` counter and a `bool` mask trains with adam-family
optimizers, its integer and boolean fields carried unchanged. The compiled steps are
shared between the tests (module-level caches).
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
from equishard.train import (
    Checkpointer,
    LocalView,
    MixedPrecision,
    export_model,
    import_model,
    init_train_state,
    make_train_step,
)

from .helpers import assert_tree_allclose, jit_once, rel_err

BATCH, STEPS, DATA_SHARDS = 16, 10, 8
LAYOUTS = ["dp=8", "fsdp=8", "dp=4,fsdp=2"]


class ConvBlock(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm

    def __init__(self, cin, cout, *, key):
        self.conv = eqx.nn.Conv2d(cin, cout, 3, padding=1, use_bias=False, key=key)
        self.norm = eqx.nn.BatchNorm(cout, axis_name="batch", mode="batch", momentum=0.9)

    def __call__(self, x, state):
        h, state = self.norm(self.conv(x), state)
        return jax.nn.relu(h), state


class CNN(eqx.Module):
    """A small ResNet-style CNN, written without equishard: x f32[3, 8, 8] -> f32[4]."""

    stem: ConvBlock
    block: ConvBlock
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = ConvBlock(3, 16, key=k1)
        self.block = ConvBlock(16, 64, key=k2)  # its conv's 9216 elements split over fsdp
        self.head = eqx.nn.Linear(64, 4, key=k3)

    def __call__(self, x, state):
        h, state = self.stem(x, state)
        r, state = self.block(h, state)
        return self.head((r + jnp.tile(h, (4, 1, 1))).mean(axis=(1, 2))), state


def make_loss(data_axes):
    def loss_fn(model, state, batch, key):
        x, y = batch
        forward = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
        logits, state = forward(x, state)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return jax.lax.pmean(loss, data_axes), ({"accuracy": jax.lax.pmean(accuracy, data_axes)}, state)

    return loss_fn


@functools.cache
def _batches():
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(BATCH, 3, 8, 8)).astype(np.float32) * 2 + 0.5, rng.integers(0, 4, BATCH).astype(np.int32))
        for _ in range(STEPS + 1)
    ]


def _membership(batch):
    """`batch` reordered so that one device's micro-batch m holds the examples of
    micro-step m on a layout of `DATA_SHARDS` data shards with 2 micro-steps: the m-th
    half of each shard's rows."""
    return jax.tree.map(
        lambda x: x.reshape(DATA_SHARDS, 2, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape), batch
    )


OPTIMIZER = optax.adamw(3e-3)


@functools.cache
def _cnn():
    """`eqx.nn.make_with_state(CNN)(key=fold_in(key(0), 0))`, what `init_train_state`
    builds from `jax.random.key(0)`, initialised once (compiling the random-number
    kernels of an initialisation takes seconds on XLA:CPU); every layout starts from it."""
    return jit_once(lambda k: eqx.nn.make_with_state(CNN)(key=jax.random.fold_in(k, 0)))(jax.random.key(0))


def make_model(layout):
    built = _cnn()  # outside the trace of `make`

    def make(key):
        del key  # the arrays are `_cnn()`'s
        model, state = built
        if "fsdp" in es.parse_layout(layout):
            model = es.nn.fsdp_wrap(model, "fsdp", policy=lambda path, m: path == "block")
        return model, state

    return make


def data_axes(mesh):
    return tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))


@functools.cache
def _step(layout, grad_accum=1, batch_stats="global"):
    mesh = es.make_mesh(layout)
    axes = data_axes(mesh)
    return make_train_step(
        make_loss(axes), OPTIMIZER, mesh=mesh, batch_spec=P(axes), grad_accum=grad_accum,
        view=LocalView(batch_stats=batch_stats), donate=False,
    )  # fmt: skip


def _init(layout):
    return init_train_state(make_model(layout), OPTIMIZER, jax.random.key(0), mesh=es.make_mesh(layout))


@functools.cache
def _train(layout, grad_accum=1, batch_stats="global", reorder=False):
    """`(state, losses)` after `STEPS` steps (`reorder`: each batch in `_membership`'s order)."""
    state, step = _init(layout), _step(layout, grad_accum, batch_stats)
    losses = []
    for batch in _batches()[:STEPS]:
        state, metrics = step(state, _membership(batch) if reorder else batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _assert_curve(losses, reference, tol=1e-5):
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    assert max(errors) <= tol, errors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_norm_trains_as_on_one_device(layout):
    state, losses = _train(layout)
    ref_state, reference = _train("dp=1")
    _assert_curve(losses, reference)
    assert_tree_allclose(state.model_state, ref_state.model_state)  # running statistics
    assert_tree_allclose(state.model, ref_state.model)
    assert int(state.model_state.get(ref_state.model.stem.norm.batch_counter)) == STEPS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_norm_with_micro_batches_matches_one_device_with_the_same_membership(layout):
    # A micro-step's statistics are over its examples: the m-th slice of each device's
    # rows. One device with grad_accum=2 on the batch reordered so that its micro-batch
    # m holds those examples computes the same statistics.
    state, losses = _train(layout, grad_accum=2)
    ref_state, reference = _train("dp=1", grad_accum=2, reorder=True)
    _assert_curve(losses, reference)
    assert_tree_allclose(state.model_state, ref_state.model_state)


def _per_device_reference():
    """A plain-Equinox loop on one device whose batch norms see each of 8 devices'
    examples apart; the running statistics kept are their mean over the devices."""
    model, state = _cnn()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    loss_fn = make_loss(())
    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def step(params, state, opt_state, batch):
        model = eqx.combine(params, static)
        def loss(model):
            shards = jax.tree.map(lambda x: x.reshape(DATA_SHARDS, -1, *x.shape[1:]), batch)
            per = jax.vmap(lambda b: loss_fn(model, state, b, None), out_axes=(0, (0, 0)))(shards)
            losses, (_, states) = per
            return jnp.mean(losses), jax.tree.map(lambda s: jnp.mean(s, 0).astype(s.dtype), states)

        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), state, opt_state, value

    losses = []
    for batch in _batches()[:STEPS]:
        params, state, opt_state, value = step(params, state, opt_state, batch)
        losses.append(float(value))
    return eqx.combine(params, static), state, losses


def test_per_device_batch_statistics_equal_a_per_device_reference():
    state, losses = _train("dp=8", batch_stats="device")
    model, ref_state, reference = _per_device_reference()
    _assert_curve(losses, reference)
    assert_tree_allclose(state.model_state, ref_state)
    assert_tree_allclose(state.model, model)
    # and they differ from the global statistics'
    assert rel_err(state.model_state.get(model.stem.norm.batch_state_index)[1],
                   _train("dp=8")[0].model_state.get(model.stem.norm.batch_state_index)[1]) > 1e-3  # fmt: skip


def test_batch_norm_in_the_global_view():
    mesh = es.make_mesh("dp=8")
    step = make_train_step(make_loss(()), OPTIMIZER, mesh=mesh, batch_spec=P("dp"), view="global",
                           grad_accum=2)  # fmt: skip
    state = _init("dp=8")
    losses = []
    for batch in _batches()[:3]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_state, reference = _train("dp=1", grad_accum=2, reorder=True)
    _assert_curve(losses, reference[:3])


def test_mixed_precision_casts_the_model_and_keeps_the_state_float32():
    """`compute_dtype=bfloat16`: the loss sees the model in bfloat16 (the input cast is
    the user's, as on one device); the running statistics stay float32, step after step,
    and the losses follow the float32 one-device curve within bfloat16's 1e-2."""
    mesh = es.make_mesh("dp=4,fsdp=2")
    inner = make_loss(data_axes(mesh))

    def loss_fn(model, state, batch, key):
        x, y = batch
        return inner(model, state, (x.astype(jnp.bfloat16), y), key)

    step = make_train_step(
        loss_fn, OPTIMIZER, mesh=mesh, batch_spec=P(data_axes(mesh)), precision=MixedPrecision(jnp.bfloat16),
        donate=False,
    )  # fmt: skip
    state = _init("dp=4,fsdp=2")
    dtypes = [x.dtype for x in jax.tree.leaves(state.model_state)]
    losses = []
    for batch in _batches()[:3]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        assert [x.dtype for x in jax.tree.leaves(state.model_state)] == dtypes
    _assert_curve(losses, _train("dp=1")[1][:3], tol=1e-2)


def test_batch_statistics_are_an_option_of_the_local_view():
    with pytest.raises(es.LayerConfigError, match="LocalView: batch_stats must be 'global'"):
        LocalView(batch_stats="per_device")
    with pytest.raises(es.LayerConfigError, match=r"view must be 'local', 'global' or a LocalView"):
        make_train_step(make_loss(()), OPTIMIZER, mesh=es.make_mesh("dp=8"), batch_spec=P("dp"), view="device")


def _infer(model, state, x):
    def infer(model, state, x):
        forward = jax.vmap(eqx.nn.inference_mode(model), in_axes=(0, None), out_axes=(0, None), axis_name="batch")
        return forward(x, state)[0]

    return jit_once(infer)(model, state, x)


def test_inference_on_the_gathered_model_equals_one_devices(tmp_path):
    state, _ = _train("fsdp=8")
    ref_state, _ = _train("dp=1")
    x = _batches()[STEPS][0]
    plain, model_state = es.unbox(es.gather((state.model, state.model_state)))
    assert type(plain.block) is ConvBlock  # the FSDP unit gone
    out = _infer(plain, model_state, x)
    assert rel_err(out, _infer(es.unbox(es.gather(ref_state.model)), es.gather(ref_state.model_state), x)) <= 1e-5
    # exported beside the parameters, read back by plain Equinox
    path = export_model(state.model, tmp_path / "cnn", state=state.model_state)
    like = eqx.nn.make_with_state(CNN)(key=jax.random.key(1))
    model_back, state_back = eqx.tree_deserialise_leaves(path, like)
    assert rel_err(_infer(model_back, state_back, x), out) == 0
    assert_tree_allclose(import_model(path, like), (plain, model_state), rtol=0)


def test_a_non_finite_batch_leaves_the_running_statistics():
    state, _ = _train("dp=8")
    x, y = _batches()[STEPS]
    x = x.copy()
    x[3] = np.nan  # one example of one device
    after, metrics = _step("dp=8")(state, (x, y))
    assert int(metrics["skipped"]) == 1
    assert_tree_allclose(after.model_state, state.model_state, rtol=0)
    assert_tree_allclose(after.model, state.model, rtol=0)


def test_a_checkpoint_of_the_state_resumes_on_another_layout(tmp_path):
    saved, _ = _train("fsdp=8")
    canonical = lambda path: path.replace(".module.", ".")  # noqa: E731
    with Checkpointer(tmp_path, path_map=canonical) as ckpt:
        ckpt.save(STEPS, saved)
        meta = ckpt.read_metadata()
    assert meta["format_version"] == 2
    assert any(r["path"].startswith("model_state") and "checksum" in r for r in meta["arrays"])
    like = eqx.filter_eval_shape(lambda: _init("dp=4,fsdp=2"))
    with Checkpointer(tmp_path, path_map=canonical) as ckpt:
        restored = ckpt.restore(like, mesh=es.make_mesh("dp=4,fsdp=2"))
    assert_tree_allclose(restored.model_state, saved.model_state, rtol=0)
    batch = _batches()[STEPS]
    _, resumed = _step("dp=4,fsdp=2")(restored, batch)
    _, continued = _step("fsdp=8")(saved, batch)
    assert abs(float(resumed["loss"]) - float(continued["loss"])) <= 1e-5 * abs(float(continued["loss"]))


def test_a_checkpoint_written_before_model_states_reads_as_before(tmp_path, monkeypatch):
    # A format-1 checkpoint: the state of a model without a state, as equishard wrote
    # it before TrainState had `model_state` (the same arrays, under the same paths).
    from equishard.train import _checkpoint

    mesh = es.make_mesh("dp=8")
    make = lambda: init_train_state(lambda k: eqx.nn.MLP(4, 4, 8, 1, key=k), OPTIMIZER, jax.random.key(0), mesh=mesh)  # noqa: E731
    state = make()
    monkeypatch.setattr(_checkpoint, "FORMAT_VERSION", 1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
    monkeypatch.undo()
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.read_metadata()["format_version"] == 1
        restored = ckpt.restore(eqx.filter_eval_shape(make), mesh=mesh)
    assert restored.model_state is None
    assert_tree_allclose((restored.model, restored.opt_state), (state.model, state.opt_state), rtol=0)
    assert int(restored.step) == 0 and bool((jax.random.key_data(restored.key) == jax.random.key_data(state.key)).all())


def test_a_stateful_layer_without_make_with_state_is_refused_by_path():
    with pytest.raises(es.TrainStepError, match=r"`stem\.norm\.batch_counter`.*make_with_state"):
        init_train_state(lambda k: CNN(key=k), OPTIMIZER, jax.random.key(0), mesh=es.make_mesh("dp=8"))


def test_a_stateful_loss_must_return_its_new_state():
    def bad(model, state, batch, key):
        loss, (metrics, _) = make_loss("dp")(model, state, batch, key)
        return loss, metrics

    step = make_train_step(bad, OPTIMIZER, mesh=es.make_mesh("dp=8"), batch_spec=P("dp"))
    with pytest.raises(es.TrainStepError, match=r"\(loss, \(metrics, new_state\)\)"):
        step.lower(_init("dp=8"), _batches()[0])


def test_a_metric_that_is_not_a_scalar_is_refused_by_name():
    def loss_fn(model, state, batch, key):
        loss, (metrics, state) = make_loss(())(model, state, batch, key)
        return loss, ({"logits": jnp.zeros((3,))}, state)

    mesh = es.make_mesh("dp=8")
    step = make_train_step(loss_fn, OPTIMIZER, mesh=mesh, batch_spec=P("dp"), view="global")
    with pytest.raises(es.TrainStepError, match="metric 'logits' is float32\\[3\\], not a scalar"):
        step.lower(_init("dp=8"), _batches()[0])


class Spectral(eqx.Module):
    """A layer under `eqx.nn.SpectralNorm`, whose state (power-iteration vectors) is
    computed from the weight alone."""

    layer: eqx.nn.SpectralNorm
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layer = eqx.nn.SpectralNorm(eqx.nn.Linear(8, 16, key=k1), "weight", key=k2)
        self.head = eqx.nn.Linear(16, 1, key=k3)

    def __call__(self, x, state):
        h, state = self.layer(x, state)
        return self.head(jnp.tanh(h))[0], state


def _spectral_losses(layout):
    mesh = es.make_mesh(layout)
    axes = data_axes(mesh)

    def loss_fn(model, state, batch, key):
        x, y = batch
        pred, state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)
        return jax.lax.pmean(jnp.mean((pred - y) ** 2), axes), ({}, state)

    make = lambda k: eqx.nn.make_with_state(Spectral)(key=k)  # noqa: E731
    state = init_train_state(make, OPTIMIZER, jax.random.key(0), mesh=mesh)
    step = make_train_step(loss_fn, OPTIMIZER, mesh=mesh, batch_spec=P(axes))
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(4):
        batch = (rng.normal(size=(BATCH, 8)).astype(np.float32), rng.normal(size=BATCH).astype(np.float32))
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_spectral_norm_trains_as_on_one_device():
    state, losses = _spectral_losses("dp=8")
    ref_state, reference = _spectral_losses("dp=1")
    _assert_curve(losses, reference)
    assert_tree_allclose(state.model_state, ref_state.model_state)


class _Tally(eqx.Module):
    """A layer whose state is the mean of the inputs it last saw."""

    w: jax.Array
    seen: eqx.nn.StateIndex

    def __init__(self):
        self.w = jnp.ones(())
        self.seen = eqx.nn.StateIndex(jnp.zeros(()))

    def __call__(self, x, state):
        return self.w * x, state.set(self.seen, jnp.mean(x))


def test_a_state_that_differs_across_the_data_axes_is_reported():
    """A stateful loss that records this device's batch mean (not the global one): the
    step keeps the first device's copy and says so, `state_diverged` 1; recording the
    global mean (pmean over the data axes) reports 0."""
    mesh = es.make_mesh("dp=8")
    x = jnp.arange(16.0)

    def loss(local):
        def loss_fn(model, state, batch, key):
            y, state = model(batch, state)
            if not local:
                state = jax.tree.map(lambda s: jax.lax.pmean(s, "dp"), state)
            return jnp.mean(y**2), ({}, state)

        return loss_fn

    for local, expected in ((True, 1), (False, 0)):
        step = make_train_step(loss(local), optax.sgd(1e-3), mesh=mesh, batch_spec=P("dp"), donate=False)
        state = step.init_state(lambda k: eqx.nn.make_with_state(_Tally)(), jax.random.key(0))
        _, metrics = step(state, x)
        assert int(metrics["state_diverged"]) == expected
