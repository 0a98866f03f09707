"""Optimizer-state sharding (ZeRO-1, `--zero`): the same losses as plain data
parallelism, the same bytes, 1/n of the optimizer state per device, checkpoints that
restore across ZeRO and non-ZeRO layouts."""

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
from equishard._errors import LayerConfigError, MeshError
from equishard.models import GPT, GPTConfig
from equishard.models._gpt import canonical_path
from equishard.report import collective_bytes, memory_stats, read_collectives
from equishard.sharding import Layout, param_table, specs_of, zero_split
from equishard.train import Checkpointer, TrainState, ZeRO1, init_train_state, make_train_step

from .helpers import assert_tree_allclose

CONFIG = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=1, d_ff=128)
ADAMW = optax.adamw(1e-2, weight_decay=0.1)
STEPS = 5


def _data(step: int):
    return jax.random.randint(jax.random.key(100 + step), (16, 17), 0, CONFIG.vocab_size)


def _loss(model, batch, key):
    return model.loss(batch, key)


def _state(layout: Layout, optimizer=ADAMW) -> TrainState:
    par = layout.resolve()
    return init_train_state(
        lambda k: GPT(CONFIG, par, key=k), optimizer, jax.random.key(0), mesh=layout.mesh(),
        opt_sharding=_zero1(layout),
    )  # fmt: skip


def _zero1(layout: Layout) -> ZeRO1 | None:
    axes = layout.resolve().zero
    return ZeRO1(axes) if axes else None


@functools.cache
def setup(spec: str, zero: bool, grad_accum: int = 1):
    """(layout, initial state, compiled step, uncompiled step) for one layout, shared."""
    layout = Layout(spec, zero=zero)
    state = _state(layout)
    step = make_train_step(
        _loss, ADAMW, mesh=layout.mesh(), batch_spec=layout.resolve().batch_spec, clip_norm=1.0,
        donate=False, grad_accum=grad_accum, opt_sharding=_zero1(layout),
    )  # fmt: skip
    return layout, state, step.compile(state, _data(0)), step


@functools.cache
def losses(spec: str, zero: bool, grad_accum: int = 1):
    _, state, compiled, _ = setup(spec, zero, grad_accum)
    out = []
    for s in range(STEPS):
        state, metrics = compiled(state, _data(s))
        out.append(float(metrics["loss"]))
    return np.array(out), state


def _arrays(tree) -> list[np.ndarray]:
    """The global arrays of `tree`, in order (models of two layouts differ in statics)."""
    return [np.asarray(x) for x in jax.tree.leaves(es.unbox(es.gather(eqx.filter(tree, eqx.is_array))))]


def _close(a, b, rtol=1e-5):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0)


def test_zero_specs_split_the_optimizer_state_only():
    layout, state, _, _ = setup("dp=8", True)
    mu = state.opt_state[0].mu
    # The parameters stay replicated; their first moments are split over dp on the
    # largest free dimension; arrays below the min-weight-size rule stay replicated.
    assert state.model.embed.weight.spec == P(None, None)
    assert mu.embed.weight.spec == P("dp", None)
    assert mu.embed.weight.value.sharding.spec == P("dp", None)
    norm = jax.tree.leaves(specs_of(mu.norm), is_leaf=lambda x: isinstance(x, P))
    assert all(s == P(None) for s in norm)
    # Idempotent: a state built for ZeRO is its own ZeRO split.
    again = zero_split(state.opt_state, "dp", mesh=layout.mesh())
    assert jax.tree.structure(again) == jax.tree.structure(state.opt_state)


def test_zero_dp8_same_losses_as_dp8():
    plain, _ = losses("dp=8", False)
    zero, _ = losses("dp=8", True)
    _close(zero, plain)
    assert plain[-1] < plain[0]


def test_zero_dp2_tp4_same_losses_as_dp8():
    _close(losses("dp=2,tp=4", True)[0], losses("dp=8", False)[0])


def test_zero_grad_accum_same_losses_and_one_reduce_scatter():
    _close(losses("dp=8", True, grad_accum=2)[0], losses("dp=8", False)[0])
    layout, state, compiled, _ = setup("dp=8", True, grad_accum=2)
    rows = read_collectives(compiled.compiled)
    scattered = [r for r in rows if r.kind == "reduce-scatter"]
    # Reduce-scattered once per step, after the last micro-step (not inside the loop),
    # each split gradient once: (n-1)/n of the split parameters' bytes.
    assert scattered and all(r.count == 1 for r in scattered)
    split = zero_split(state.model, "dp", mesh=layout.mesh())
    split_bytes = sum(r.total_bytes for r in param_table(split, layout.mesh()) if "dp" in str(r.spec))
    assert sum(r.total_bytes for r in scattered) == pytest.approx(7 / 8 * split_bytes)


def test_zero_bytes_and_memory():
    plain = setup("dp=8", False)[2].compiled
    _, zero_state, zero_compiled, _ = setup("dp=8", True)
    zero = zero_compiled.compiled
    plain_rows, zero_rows = read_collectives(plain), read_collectives(zero)
    # All-reduce of the gradients -> reduce-scatter + all-gather: the same ring bytes.
    assert collective_bytes(zero_rows) <= 1.05 * collective_bytes(plain_rows)
    kinds = {r.kind for r in zero_rows}
    assert {"reduce-scatter", "all-gather"} <= kinds
    mesh = Layout("dp=8").mesh()
    total = sum(r.total_bytes for r in param_table(zero_state.opt_state, mesh))
    per_device = sum(r.bytes_per_device for r in param_table(zero_state.opt_state, mesh))
    # The compiler's arguments shrink by exactly the optimizer state no longer held.
    plain_memory, zero_memory = memory_stats(plain), memory_stats(zero)
    assert plain_memory is not None and zero_memory is not None
    plain_args, zero_args = plain_memory.argument_bytes, zero_memory.argument_bytes
    assert plain_args - zero_args == total - per_device
    # 1/8 of the optimizer state, plus the arrays below the min-weight-size rule.
    small = sum(
        r.total_bytes for r in param_table(zero_state.opt_state, mesh) if "dp" not in str(r.spec)
    )
    assert per_device == pytest.approx((total - small) / 8 + small)
    assert per_device <= 1.02 * total / 8


def test_zero_adafactor_factored_moments_replicated():
    """The update phase alone (the step's global view) under ZeRO and without."""
    opt = optax.adafactor(1e-2)
    plain_layout, zero_layout = Layout("dp=8"), Layout("dp=8", zero=True)
    plain, zero = _state(plain_layout, opt), _state(zero_layout, opt)
    mesh = zero_layout.mesh()
    rows = param_table(zero.opt_state, mesh)
    # Factored moments (a parameter's box rebuilt around a row or column vector) do not
    # fit their box's global shape: they are read and placed as replicated.
    factored = [r for r in rows if "v_row" in r.path or "v_col" in r.path]
    assert factored and all(r.bytes_per_device == r.total_bytes for r in factored)
    assert any("dp" in str(r.spec) for r in rows)  # the unfactored ones are split
    grads = jax.tree.map(lambda p: p * 0.5 + 0.1, eqx.filter(plain.model, eqx.is_inexact_array))

    def update(grads, opt_state, params, split):
        if split:
            grads, params = (es.shard(zero_split(t, "dp", mesh=mesh), mesh) for t in (grads, params))
        updates, new_state = opt.update(grads, opt_state, params)
        return es.unbox(updates), new_state

    update = jax.jit(update, static_argnums=3)
    params = eqx.filter(plain.model, eqx.is_array)
    a, state_a = update(grads, plain.opt_state, params, False)
    b, state_b = update(grads, zero.opt_state, params, True)
    assert_tree_allclose(b, a, rtol=1e-6)
    assert_tree_allclose(es.unbox(state_b), es.unbox(state_a), rtol=1e-6)


def test_zero_checkpoint_restores_across_layouts(tmp_path):
    _, zero_final = losses("dp=8", True)
    with Checkpointer(tmp_path / "a", path_map=canonical_path) as ckpt:
        assert ckpt.save(STEPS, zero_final)
    targets = {}
    for spec in ("dp=8", "fsdp=4,tp=2"):
        layout = Layout(spec)
        mesh = layout.mesh()
        like = eqx.filter_eval_shape(lambda: _state(layout))
        targets[spec] = Checkpointer(tmp_path / "a", path_map=canonical_path).restore(like, mesh=mesh)
        restored = _arrays((targets[spec].model, targets[spec].opt_state))
        for a, b in zip(restored, _arrays((zero_final.model, zero_final.opt_state)), strict=True):
            np.testing.assert_array_equal(a, b)
    # And back: fsdp=4,tp=2 saved, restored into the ZeRO layout, and trained on.
    with Checkpointer(tmp_path / "b", path_map=canonical_path) as ckpt:
        assert ckpt.save(STEPS, targets["fsdp=4,tp=2"])
    _, zero_init, compiled, _ = setup("dp=8", True)
    like = eqx.filter_eval_shape(lambda: zero_init)
    back: TrainState = Checkpointer(tmp_path / "b", path_map=canonical_path).restore(like, mesh=Layout("dp=8").mesh())
    assert back.opt_state[0].mu.embed.weight.value.sharding.spec == P("dp", None)
    _, after_zero = compiled(back, _data(0))
    _, plain_final = losses("dp=8", False)
    _, after_plain = setup("dp=8", False)[2](plain_final, _data(0))
    _close(float(after_zero["loss"]), float(after_plain["loss"]))


def test_zero_errors():
    with pytest.raises(MeshError, match="--zero"):
        Layout("fsdp=8", zero=True).resolve()
    mesh = es.make_mesh("dp=8")
    with pytest.raises(LayerConfigError, match="'pp'"):
        make_train_step(_loss, ADAMW, mesh=mesh, batch_spec=P("dp"), opt_sharding=ZeRO1("pp"))
    # A state built without ZeRO given to a ZeRO step: named before XLA sees it.
    _, plain_state, _, _ = setup("dp=8", False)
    _, _, _, zero_step = setup("dp=8", True)
    with pytest.raises(LayerConfigError, match="init_state"):
        zero_step.lower(plain_state, _data(0))
    # And a ZeRO state given to a plain step.
    _, zero_state, _, _ = setup("dp=8", True)
    _, _, _, plain_step = setup("dp=8", False)
    with pytest.raises(LayerConfigError, match="trees differ"):
        plain_step.lower(zero_state, _data(0))


def test_inspect_zero(capsys):
    from equishard._cli import main

    argv = ["inspect", "--model", "tiny", "--seq-len", "32", "--layout", "dp=8", "--zero", "--wide"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # The report's minimum knows ZeRO: the same ring bytes, named as what runs.
    assert "gradient reduce-scatter + parameter all-gather over dp (zero)" in out
    assert re.search(r"measured .* = 1\.000", out)


def test_zero_plain_equinox_model_in_both_views():
    """An unmodified `eqx.nn.MLP` (plain arrays, no boxes): its large moments are boxed
    and split, its parameters stay plain; the local and the global view with micro-steps."""
    mesh = es.make_mesh("dp=8")
    x = jax.random.normal(jax.random.key(1), (16, 64))
    y = jax.random.normal(jax.random.key(2), (16, 8))

    def local_loss(model, batch, key):
        inputs, targets = batch
        return jax.lax.pmean(jnp.mean((jax.vmap(model)(inputs) - targets) ** 2), "dp"), {}

    def global_loss(model, batch, key):
        inputs, targets = batch
        return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2), {}

    def run(zero, view):
        state = init_train_state(
            lambda k: eqx.nn.MLP(64, 8, 128, 2, key=k), ADAMW, jax.random.key(0), mesh=mesh,
            opt_sharding=zero,
        )
        loss = local_loss if view == "local" else global_loss
        step = make_train_step(loss, ADAMW, mesh=mesh, batch_spec=P("dp"), opt_sharding=zero, view=view, grad_accum=2)
        out = []
        for _ in range(3):
            state, metrics = step(state, (x, y))
            out.append(float(metrics["loss"]))
        return np.array(out), state

    plain, _ = run(None, "local")
    for view in ("local", "global"):
        zero, state = run(ZeRO1("dp"), view)
        _close(zero, plain)
        assert isinstance(state.model.layers[1].weight, jax.Array)  # still a plain array
        assert state.opt_state[0].mu.layers[1].weight.spec == P("dp", None)
