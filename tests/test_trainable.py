"""Frozen parameters (`make_train_step(trainable=...)`): the trained arrays exact against
a one-device reference on several layouts, the frozen ones bit-identical, no gradient,
optimizer state or reduction for them in the compiled step, checkpoints of the trained
part with a fingerprint of the base."""

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
from equishard._errors import CheckpointError, LayerConfigError, TrainStepError
from equishard.models import GPT, GPTConfig
from equishard.models._gpt import canonical_path, to_single_device
from equishard.report import read_collectives
from equishard.sharding import Layout, path_str
from equishard.train import (
    Checkpointer,
    MixedPrecision,
    Trainable,
    ZeRO1,
    base_fingerprint,
    init_train_state,
    make_train_step,
    trainable_mask,
)

from .helpers import assert_tree_allclose, dot_result_shapes, one_device_training, tree_bytes

# d_ff/tp = 80 under tp=2: the MLP matrices' local blocks, f32[80, 64] and f32[64, 80],
# have shapes no other dot's result has (8 tokens of 4 local examples: 32 rows).
CONFIG = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=160)
# Momentum SGD: its update is linear in the gradients, so the trained arrays after a few
# steps compare at 1e-5 (adam's first steps are near sign(g), where a gradient element
# near zero flips with its rounding); its state (one trace per trained array) is split by
# ZeRO1 as adam's moments are.
OPTIMIZER = optax.sgd(0.3, momentum=0.9)
STEPS = 3
KEY = jax.random.key(0)


def frozen_path(path: str) -> bool:
    """The base: the embedding and the MLPs' matrices (attention, norms and head train)."""
    return path.startswith("embed") or ".mlp." in path


def trained(path: str, leaf) -> bool:
    return not frozen_path(path)


def _data(step: int):
    return jax.random.randint(jax.random.key(100 + step), (16, 9), 0, CONFIG.vocab_size)


def _loss(model, batch, key):
    return model.loss(batch, key)


def _local(tree):
    """`tree`'s arrays as one-device arrays (a reference must not get mesh-placed ones)."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if eqx.is_array(x) else x, tree)


def _plain(model):
    """A sharded GPT as a one-device GPT of plain arrays."""
    return _local(es.unbox(to_single_device(es.gather(model))))


# (opt_sharding, grad_accum, precision) per layout; ZeRO1 and grad_accum on dp=8.
LAYOUTS = {
    "dp=8": ("dp", 2),
    "fsdp=8": (None, 1),
    "fsdp=4,tp=2": (None, 1),
    "pp=2,dp=2,tp=2": (None, 1),
}


@functools.cache
def setup(spec: str, frozen: bool = True, precision=None):
    """(initial state, compiled step, step) on one layout, shared by the tests."""
    layout = Layout(spec).resolve()
    zero, accum = LAYOUTS.get(spec, (None, 1))
    step = make_train_step(
        _loss, OPTIMIZER, mesh=layout.mesh(), batch_spec=layout.batch_spec, clip_norm=1.0,
        donate=False, grad_accum=accum, opt_sharding=ZeRO1(zero) if zero else None,
        precision=precision, trainable=trained if frozen else None,
    )  # fmt: skip
    state = step.init_state(lambda k: GPT(CONFIG, layout, key=k), KEY)
    return state, step.compile(state, _data(0)), step


@functools.cache
def run(spec: str, precision=None):
    state, compiled, _ = setup(spec, True, precision)
    losses = []
    for s in range(STEPS):
        state, metrics = compiled(state, _data(s))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@functools.cache
def reference():
    """Plain JAX and optax on one device: the frozen arrays are constants, optax sees
    the trained ones only. `(losses, initial model, final model)`."""
    model = _plain(setup("dp=8")[0].model)
    spec = jax.tree_util.tree_map_with_path(lambda p, _: not frozen_path(path_str(p)), model)
    batches = [_data(s) for s in range(STEPS)]
    losses, final = one_device_training(model, spec, OPTIMIZER, batches, clip_norm=1.0)
    return losses, model, final


def _split_named(model):
    """`{path: array}` of a one-device model, frozen and trained apart."""
    flat = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(model) if eqx.is_array(x)}
    frozen = {p: x for p, x in flat.items() if frozen_path(p)}
    return frozen, {p: x for p, x in flat.items() if p not in frozen}


@pytest.mark.parametrize("spec", list(LAYOUTS))
def test_frozen_training_exact_against_one_device(spec):
    ref_losses, _, final = reference()
    losses, state = run(spec)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = _plain(state.model)
    # The trained arrays equal the one-device reference's (per array, 1e-5) ...
    assert_tree_allclose(got, final)
    # ... and the frozen ones are this layout's initial arrays, bit for bit (another
    # layout's initialisation may round an element differently).
    frozen_now, trained_now = _split_named(got)
    frozen_then, trained_then = _split_named(_plain(setup(spec)[0].model))
    assert frozen_now and frozen_now.keys() == frozen_then.keys()
    for p in frozen_now:
        np.testing.assert_array_equal(frozen_now[p], frozen_then[p], err_msg=p)
    assert any(not np.array_equal(trained_now[p], trained_then[p]) for p in trained_now)


def test_compiled_step_holds_trained_state_and_no_frozen_weight_gradient():
    state, compiled, _ = setup("fsdp=4,tp=2")
    full_state, full_compiled, _ = setup("fsdp=4,tp=2", frozen=False)
    mask = trainable_mask(state.model, trained)
    trainable, frozen = mask.split(es.unbox(state.model))
    # One momentum trace per trained array; nothing for the frozen ones.
    assert tree_bytes(state.opt_state) == tree_bytes(trainable)
    assert tree_bytes(full_state.opt_state) == tree_bytes(es.unbox(full_state.model))
    assert tree_bytes(state.opt_state) < 0.5 * tree_bytes(full_state.opt_state)  # 197,888 of 460,032 bytes
    args = compiled.compiled.memory_analysis().argument_size_in_bytes
    full_args = full_compiled.compiled.memory_analysis().argument_size_in_bytes
    # The arguments shrink by the frozen arrays' traces (per device: fsdp*tp splits them).
    saved = tree_bytes(frozen) / 8
    assert full_args - args == pytest.approx(saved, rel=0.1)
    # No dot computes a gradient of a frozen matrix: the frozen MLP matrices' local
    # blocks (one layer's, under fsdp=4,tp=2) appear as no dot's result; the full step
    # has them.
    local = {"f32[80,64]", "f32[64,80]"}  # up's (gate and up) and down's blocks [out, in]
    dots, full_dots = dot_result_shapes(compiled.compiled.as_text()), dot_result_shapes(full_compiled.compiled.as_text())
    assert not local & set(dots), local & set(dots)
    assert local <= set(full_dots)
    # Three weight-gradient products fewer (gate, up, down; the layers are one scan).
    assert len(full_dots) - len(dots) == 3
    # Under fsdp the frozen arrays are still gathered, but their gradients are not
    # reduce-scattered: fewer reduce-scatter bytes.
    def moved(compiled, kind):
        return sum(r.total_bytes for r in read_collectives(compiled.compiled) if r.kind == kind)

    assert moved(compiled, "reduce-scatter") < moved(full_compiled, "reduce-scatter")
    assert moved(compiled, "all-gather") == moved(full_compiled, "all-gather")
    # The same with FSDP units alone (fsdp=8, the units scanned as one): exactly the
    # frozen arrays' reduce-scatters go (embedding, up, down: 272,384 of 444,416 bytes).
    state8, frozen8, _ = setup("fsdp=8")
    full8 = setup("fsdp=8", frozen=False)[1]
    base8 = trainable_mask(state8.model, trained).split(es.unbox(state8.model))[1]
    assert moved(frozen8, "all-gather") == moved(full8, "all-gather")
    gone = moved(full8, "reduce-scatter") - moved(frozen8, "reduce-scatter")
    assert gone == 7 / 8 * tree_bytes(base8) == 272_384


def test_mixed_precision_and_global_view_and_model_state():
    # MixedPrecision on fsdp=4,tp=2: the frozen arrays are cast for the loss like the rest
    # and kept bit-identical in float32; the losses follow the float32 reference.
    ref_losses = reference()[0]
    losses, state = run("fsdp=4,tp=2", MixedPrecision(jnp.bfloat16))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    frozen_now, _ = _split_named(_plain(state.model))
    for p, x in _split_named(_plain(setup("fsdp=4,tp=2", True, MixedPrecision(jnp.bfloat16))[0].model))[0].items():
        np.testing.assert_array_equal(frozen_now[p], x, err_msg=p)
    # The global view and a model with a state (batch norm): only the trained linear moves.
    mesh = es.make_mesh("dp=8")

    class Net(eqx.Module):
        first: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        last: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.first = eqx.nn.Linear(4, 8, key=k1)
            self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")
            self.last = eqx.nn.Linear(8, 1, key=k2)

    def loss(model, state, batch, key):
        x, y = batch
        h, state = jax.vmap(lambda x, s: model.norm(model.first(x), s), (0, None), (0, None), axis_name="batch")(
            x, state
        )
        out = jax.vmap(model.last)(jax.nn.relu(h))
        return jnp.mean((out[:, 0] - y) ** 2), ({}, state)

    batch = (jax.random.normal(jax.random.key(1), (16, 4)), jax.random.normal(jax.random.key(2), (16,)))
    spec = lambda path, leaf: path.startswith("last")  # noqa: E731
    reduced = {}
    for view, trainable in (("local", spec), ("global", spec), ("local", None)):
        step = make_train_step(
            loss, optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"), view=view, donate=False, trainable=trainable
        )
        state0 = step.init_state(lambda k: eqx.nn.make_with_state(Net)(k), KEY)
        if view == "local":
            rows = read_collectives(step.lower(state0, batch).compile())
            reduced[trainable is None] = {s for r in rows if r.kind == "all-reduce" for _, s in r.operand_shapes}
        if trainable is None:
            continue
        state1, _ = step(state0, batch)
        assert np.array_equal(state1.model.first.weight, state0.model.first.weight)
        assert not np.array_equal(state1.model.last.weight, state0.model.last.weight)
        assert jax.tree.structure(state1.opt_state) == jax.tree.structure(state0.opt_state)
        # The batch norm's running statistics are still carried.
        means = [x for x in jax.tree.leaves(state1.model_state) if x.shape == (8,)]
        assert any(not np.array_equal(a, b) for a, b in zip(means, jax.tree.leaves(state0.model_state)))
    # The local view all-reduces the replicated gradients over dp: the trained ones only
    # (`first.weight`'s f32[8, 4] is summed by the full step alone).
    assert (8, 4) in reduced[True] and (8, 4) not in reduced[False]


def test_bool_tree_filter_equals_path_filter():
    state, _, step = setup("dp=8")
    model = state.model
    # Prefixes: the embedding and the MLP frozen whole, the rest trained leaf by leaf.
    spec = jax.tree.map(lambda _: True, model)
    spec = eqx.tree_at(lambda m: (m.embed, m.units.blocks[0].mlp), spec, (False, False))
    assert trainable_mask(model, spec).flags == trainable_mask(model, trained).flags
    # By regular expressions (as a command line gives them), printable.
    patterns = Trainable.matching(freeze=r"^embed|\.mlp\.")
    assert trainable_mask(model, patterns).flags == trainable_mask(model, trained).flags
    assert "freeze='^embed|\\\\.mlp" in repr(patterns)
    assert sum(trainable_mask(model, Trainable.matching(train="norm")).flags) == 3
    with pytest.raises(LayerConfigError, match=r"freeze='\(' is not a regular expression"):
        Trainable.matching(freeze="(")
    again = init_train_state(
        lambda k: GPT(CONFIG, Layout("dp=8").resolve(), key=k), OPTIMIZER, KEY, mesh=step.mesh,
        opt_sharding=step.opt_sharding, trainable=Trainable(spec),
    )  # fmt: skip
    assert jax.tree.structure(again.opt_state) == jax.tree.structure(state.opt_state)


def test_trainable_errors():
    state, _, step = setup("dp=8")
    model = state.model
    mesh = step.mesh
    make = lambda **kw: make_train_step(_loss, OPTIMIZER, mesh=mesh, batch_spec=P("dp"), donate=False, **kw)  # noqa: E731
    # Nothing trainable.
    with pytest.raises(LayerConfigError, match="leaves nothing trainable"):
        make(trainable=lambda path, leaf: "lora" in path).lower(state, _data(0))
    # A bool tree of another structure, named by path.
    wrong = {"embed": True}
    with pytest.raises(LayerConfigError, match="does not match the model's"):
        trainable_mask(model, wrong)
    spec = eqx.tree_at(lambda m: m.head, jax.tree.map(lambda _: True, model), None)
    with pytest.raises(LayerConfigError, match="`head.weight.value`, which the filter does not cover"):
        trainable_mask(model, spec)
    # A non-floating array marked trainable.
    with_int = {"w": jnp.ones(3), "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(LayerConfigError, match=r"`\['count'\]` trainable, a int32\[\] array"):
        trainable_mask(with_int, {"w": True, "count": True})
    with pytest.raises(LayerConfigError, match="only floating arrays"):
        trainable_mask(with_int, lambda path, leaf: True)
    assert trainable_mask(with_int, True).flags == (False, True)  # a prefix covers floats only
    # A state whose optimizer state was built for another trainable set, named.
    full_state = setup("dp=8", frozen=False)[0]
    with pytest.raises(TrainStepError, match=r"another trainable set: it holds `opt_state\[0\]\.trace\.embed\.weight`, for a parameter this step freezes"):
        make(trainable=trained).lower(full_state, _data(0))
    with pytest.raises(TrainStepError, match=r"another trainable set: it lacks `opt_state\[0\]\.trace\.embed\.weight`, for a parameter this step trains"):
        make().lower(state, _data(0))
    with pytest.raises(LayerConfigError, match="trainable must be"):
        make(trainable="mlp")


def test_checkpoint_of_the_trained_part(tmp_path):
    _, final = run("dp=8")
    source = "hf:tiny-test"
    with Checkpointer(tmp_path / "c", path_map=canonical_path) as ckpt:
        assert ckpt.save(STEPS, final, trainable=trained, base_source=source)
        meta = ckpt.read_metadata()
    stored = {r["path"] for r in meta["arrays"]}
    assert not any(frozen_path(p.removeprefix("model.")) for p in stored if p.startswith("model."))
    assert any(p.startswith("opt_state") for p in stored) and "step" in stored
    base = meta["base"]
    assert base["source"] == source and base["frozen"]
    assert base["fingerprint"] == base_fingerprint(final.model, trained, path_map=canonical_path)
    # The base loaded under another layout (here from a full checkpoint: a freshly
    # initialised fsdp=4,tp=2 model may differ from dp=8's by an ulp under the tests'
    # compiler flags) has the same fingerprint; the trained part restores onto it, and
    # trains on as the run that went on.
    initial, compiled, _ = setup("fsdp=4,tp=2")
    like = eqx.filter_eval_shape(lambda: initial)
    with Checkpointer(tmp_path / "full", path_map=canonical_path) as full:
        full.save(STEPS, final)
        loaded = full.restore(like, mesh=compiled.mesh).model
    assert base_fingerprint(loaded, trained, path_map=canonical_path) == base["fingerprint"]
    ckpt = Checkpointer(tmp_path / "c", path_map=canonical_path)
    restored = ckpt.restore(like, mesh=compiled.mesh, base=loaded)
    assert_tree_allclose(_plain(restored.model), _plain(final.model), rtol=0)
    assert int(restored.step) == STEPS
    after, _ = compiled(restored, _data(STEPS))
    after_ref, _ = setup("dp=8")[1](final, _data(STEPS))
    assert_tree_allclose(_plain(after.model), _plain(after_ref.model))
    # No base, another base: refused by name.
    with pytest.raises(CheckpointError, match="trained part of a model only"):
        ckpt.restore(like, mesh=compiled.mesh)
    other = eqx.tree_at(lambda m: m.embed.weight.value, loaded, loaded.embed.weight.value + 1)
    with pytest.raises(CheckpointError, match=rf"trained on another base: .*{base['fingerprint']} \(from {source}\).* has [0-9a-f]{{32}} \(from mine\)"):
        ckpt.restore(like, mesh=compiled.mesh, base=other, base_source="mine")
    # A damaged trained array is found by the checksums, as in a full checkpoint.
    ckpt.close()
    meta_file = next((tmp_path / "c" / str(STEPS)).rglob("meta/metadata"))
    text = meta_file.read_text()
    record = next(r for r in meta["arrays"] if r["path"].startswith("model.head"))
    meta_file.write_text(text.replace(record["checksum"], "0" * 16))
    with pytest.raises(CheckpointError, match="head.weight` reads back with checksum"):
        Checkpointer(tmp_path / "c", path_map=canonical_path).restore(like, mesh=compiled.mesh, base=loaded)
