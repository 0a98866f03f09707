"""MoE with expert parallelism against a single-device reference written here in plain JAX.

The reference (`reference_moe`) shares no code with `equishard`: it computes every expert
on every token and ranks assignments within each group by pairwise comparison, where
the layer sorts, dispatches through capacity buffers or ragged exchanges, and splits
the tokens and experts over the mesh.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    capacity_mask,
    chunk_offsets,
    expert_capacity,
    ragged_all_to_all_emulated,
    top_k_router,
)
from equishard.nn import FSDP, MoE

from .helpers import assert_tree_allclose

# Layer and batch used by the layout tests: 64 tokens, groups of 4, capacity 2, so
# assignments are dropped on every layout.
B, S, D, F, E, K = 2, 32, 8, 16, 8, 2
GROUP, FACTOR = 4, 1.25
LB_COEF, Z_COEF = 0.1, 0.01


# ----------------------------------------------------------------------- reference


def reference_moe(gate, w_in, w_out, x, *, top_k, capacity_factor, group_size,
                  softmax_over="selected", drops=True):
    """Plain-JAX single-device MoE: returns y, (lb loss, z loss, dropped, load), keep."""
    batch, seq, dim = x.shape
    num_experts = gate.shape[1]
    t = x.reshape(batch * seq, dim)  # tokens in global [batch, seq] row-major order
    logits = t @ gate
    chosen = jnp.argsort(-logits, axis=-1, stable=True)[:, :top_k]  # [T, k]
    if softmax_over == "selected":
        probs = jax.nn.softmax(jnp.take_along_axis(logits, chosen, axis=-1), axis=-1)
    else:
        probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), chosen, axis=-1)

    # Capacity (factors used here are exact in binary) and pairwise ranks per group.
    cap = math.ceil(group_size * top_k * capacity_factor / num_experts)
    n_assign = group_size * top_k
    e_g = chosen.reshape(-1, n_assign)
    p_g = jax.lax.stop_gradient(probs).reshape(-1, n_assign)
    tok = jnp.arange(n_assign) // top_k
    same = e_g[:, :, None] == e_g[:, None, :]
    ahead = (p_g[:, None, :] > p_g[:, :, None]) | (
        (p_g[:, None, :] == p_g[:, :, None]) & (tok[None, None, :] < tok[None, :, None])
    )
    rank = jnp.sum(same & ahead, axis=-1)
    keep = (rank < cap).reshape(chosen.shape) if drops else jnp.ones(chosen.shape, bool)

    # Every expert on every token, then pick.
    hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", t, w_in))
    every = jnp.einsum("tef,efd->ted", hidden, w_out)  # [T, E, D]
    picked = jnp.take_along_axis(every, chosen[:, :, None], axis=1)  # [T, k, D]
    y = jnp.einsum("tk,tkd->td", jnp.where(keep, probs, 0.0), picked)

    onehot = jax.nn.one_hot(chosen, num_experts)  # [T, k, E]
    fraction = jnp.sum(onehot, axis=(0, 1)) / (t.shape[0] * top_k)
    mean_prob = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
    lb = num_experts * jnp.sum(fraction * mean_prob)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    dropped = jnp.sum(~keep)
    load = jnp.sum(onehot, axis=(0, 1)).astype(jnp.int32)
    return y.reshape(x.shape), (lb, z, dropped, load), keep


def _reference_loss(params, x, c, **kw):
    gate, w_in, w_out = params
    y, (lb, z, dropped, load), _ = reference_moe(gate, w_in, w_out, x, **kw)
    loss = jnp.mean(jnp.sum(y * c, axis=-1)) + LB_COEF * lb + Z_COEF * z
    return loss, (y, lb, z, dropped, load)


def _inputs():
    kx, kc = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (B, S, D))
    c = jax.random.normal(kc, (B, S, D))
    return x, c


def _model(data_axis_name=None, dispatch: Literal["auto", "dense", "ragged"] = "dense", capacity_factor=FACTOR):
    return MoE(
        D, F, E, K,
        capacity_factor=capacity_factor,
        group_size=GROUP,
        data_axis_name=data_axis_name,
        dispatch=dispatch,
        key=jax.random.key(3),
    )


def _params(model):
    return (model.gate.value, model.w_in.value, model.w_out.value)


@functools.cache
def _reference(capacity_factor=FACTOR, drops=True):
    x, c = _inputs()
    params = _params(_model())
    kw = dict(top_k=K, capacity_factor=capacity_factor, group_size=GROUP, drops=drops)
    grad_fn = jax.value_and_grad(functools.partial(_reference_loss, **kw), argnums=(0, 1), has_aux=True)
    (loss, out), grads = jax.jit(grad_fn)(params, x, c)
    return loss, out, grads


# --------------------------------------------------------------------- the layer run


def _loss(model, x, c, axes):
    y, aux = model(x)
    local = jnp.mean(jnp.sum(y * c, axis=-1))
    if axes:
        local = jax.lax.pmean(local, axes)
    return local + LB_COEF * aux.load_balancing_loss + Z_COEF * aux.z_loss, (y, aux)


@functools.cache
def _run(layout, dispatch: Literal["auto", "dense", "ragged"] = "dense", capacity_factor=FACTOR):
    """Loss, output, aux and gradients of the layer on `layout` (None: no shard_map)."""
    x, c = _inputs()
    grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
    if layout is None:
        model = _model(dispatch=dispatch, capacity_factor=capacity_factor)
        (loss, (y, aux)), (gm, gx) = jax.jit(grad_fn, static_argnums=3)(model, x, c, ())
        return loss, y, aux, gm, gx
    mesh = es.make_mesh(layout)
    data = "dp" if "dp" in mesh.axis_names else None
    model = _model(data_axis_name=data, dispatch=dispatch, capacity_factor=capacity_factor)
    axes = tuple(a for a in ("dp", "ep") if a in mesh.axis_names)
    tokens = P(data, "ep", None)

    def step(model, x, c):
        (loss, (y, aux)), (gm, gx) = grad_fn(model, x, c, axes)
        return loss, y, aux, gm, gx

    fn = es.filter_shard_map(
        step,
        mesh=mesh,
        in_specs=(None, tokens, tokens),
        out_specs=(P(), tokens, P(), es.specs_of(model), tokens),
    )
    return eqx.filter_jit(fn)(model, x, c)


def _check_against_reference(run, reference):
    loss, y, aux, gm, gx = run
    ref_loss, (ref_y, lb, z, dropped, load), (ref_gp, ref_gx) = reference
    assert_tree_allclose(y, ref_y)
    assert_tree_allclose(
        (loss, aux.load_balancing_loss, aux.z_loss), (ref_loss, lb, z)
    )
    assert int(aux.dropped) == int(dropped)
    np.testing.assert_array_equal(np.asarray(aux.expert_load), np.asarray(load))
    assert_tree_allclose((gm.gate, gm.w_in, gm.w_out, gx), (*ref_gp, ref_gx))


@pytest.mark.parametrize("layout", [None, "ep=1", "ep=2", "ep=4", "ep=8", "dp=2,ep=4"])
def test_matches_reference(layout):
    reference = _reference()
    assert int(reference[1][3]) > 0  # the batch does overflow some experts
    _check_against_reference(_run(layout), reference)


@pytest.mark.parametrize("layout", ["ep=8", "dp=2,ep=4"])
def test_ragged_equals_dense(layout):
    dense = _run(layout)
    ragged = _run(layout, dispatch="ragged")
    _, y, aux, gm, gx = ragged
    _, dense_y, dense_aux, dense_gm, dense_gx = dense
    assert_tree_allclose(
        (y, gm.gate, gm.w_in, gm.w_out, gx),
        (dense_y, dense_gm.gate, dense_gm.w_in, dense_gm.w_out, dense_gx),
    )
    assert int(aux.dropped) == int(dense_aux.dropped)
    _check_against_reference(ragged, _reference())


def test_native_ragged_path_reduces_like_the_emulation():
    # XLA:CPU cannot compile the native ragged_all_to_all, but the program can be traced:
    # its gradient must contain exactly the reductions of the emulated path (a received
    # buffer typed as replicated would add a psum of its cotangent in the backward pass).
    mesh = es.make_mesh("dp=2,ep=4")
    x, c = _inputs()
    tokens = P("dp", "ep", None)
    reductions = {}
    for impl in ("emulated", "native"):
        model = _model(data_axis_name="dp").with_dispatch("ragged", impl)
        grad_fn = jax.grad(lambda m, x, c: _loss(m, x, c, ("dp", "ep"))[0], argnums=(0, 1))
        fn = es.filter_shard_map(grad_fn, mesh=mesh, in_specs=(None, tokens, tokens),
                                 out_specs=(es.specs_of(model), tokens))
        text = str(jax.make_jaxpr(fn)(model, x, c))
        reductions[impl] = sorted(re.findall(r"(psum\w*)\[axes=\(([^)]*)\)", text))
        assert ("ragged_all_to_all[" in text) == (impl == "native")
    assert reductions["native"] == reductions["emulated"]


def test_ragged_single_device():
    _check_against_reference(_run(None, dispatch="ragged"), _reference())


def test_no_drops_equals_dense_top_k():
    # capacity_factor = E / k makes the capacity the whole group: nothing can drop.
    factor = E / K
    assert expert_capacity(GROUP, K, E, factor) == GROUP
    run = _run("ep=2", capacity_factor=factor)
    reference = _reference(capacity_factor=factor, drops=False)
    assert int(run[2].dropped) == 0
    _check_against_reference(run, reference)


# ------------------------------------------------------------------ routing details


def test_capacity_mask_priority_and_ties():
    # One group of 6 tokens, k=2; expert 0 is everyone's first choice, capacity 3.
    probs0 = jnp.array([0.5, 0.9, 0.7, 0.7, 0.6, 0.8])
    experts = jnp.stack([jnp.zeros(6, jnp.int32), jnp.array([1, 2, 3, 1, 2, 3])], axis=-1)
    weights = jnp.stack([probs0, 1 - probs0], axis=-1)
    keep, slot = capacity_mask(experts[None], weights[None], num_experts=4, capacity=3)
    # Expert 0 keeps 0.9 (token 1), 0.8 (token 5) and, of the tied 0.7s, token 2.
    np.testing.assert_array_equal(np.asarray(keep[0, :, 0]), [0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(slot[0, :, 0]), [5, 0, 2, 3, 4, 1])
    # Experts 1-3 get two assignments each: all kept, higher probability first
    # (expert 1: token 0 at 0.5 before token 3 at 0.3; expert 2: token 4 at 0.4 before
    # token 1 at 0.1; expert 3: token 2 at 0.3 before token 5 at 0.2).
    assert bool(jnp.all(keep[0, :, 1]))
    np.testing.assert_array_equal(np.asarray(slot[0, :, 1]), [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(chunk_offsets(jnp.array([3, 0, 2, 1]))), [0, 3, 3, 5])
    assert expert_capacity(4, 2, 8, 1.25) == 2
    assert expert_capacity(10, 1, 1, 1.1) == 11  # exact: 10 * 11/10, not 11.000000000000002


def test_router_softmax_options():
    logits = jnp.array([[1.0, 3.0, 2.0, -1.0]])
    w, e = top_k_router(logits, 2)
    np.testing.assert_array_equal(np.asarray(e), [[1, 2]])
    assert_tree_allclose(w, jax.nn.softmax(jnp.array([[3.0, 2.0]])))
    w_all, e_all = top_k_router(logits, 2, softmax_over="all")
    np.testing.assert_array_equal(np.asarray(e_all), [[1, 2]])
    assert_tree_allclose(w_all, jax.nn.softmax(logits)[:, jnp.array([1, 2])])


def _overflow_case():
    """Every token prefers expert 0; its probability varies from token to token."""
    batch, seq, dim = 2, 16, 8
    model = MoE(dim, 16, 4, 1, capacity_factor=1.0, group_size=8, softmax_over="all",
                dispatch="dense", key=jax.random.key(11))
    gate = jnp.zeros((dim, 4)).at[0, 0].set(4.0).at[1].set(jnp.array([0.0, 1.0, -1.0, 0.5]))
    model = eqx.tree_at(lambda m: m.gate.value, model, gate)
    x = jax.random.normal(jax.random.key(12), (batch, seq, dim)).at[..., 0].set(1.0)
    return model, x


def _expected_overflow_drops(model, x):
    """Numpy: within each group of 8, expert 0 keeps its 2 most probable tokens."""
    t = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = t @ np.asarray(model.gate.value, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    assert (logits.argmax(-1) == 0).all()
    capacity = 2  # ceil(8 tokens * 1 / 4 experts * 1.0)
    dropped = np.zeros(len(t), bool)
    for g in range(len(t) // 8):
        idx = np.arange(8 * g, 8 * g + 8)
        order = sorted(idx, key=lambda i: (-p[i, 0], i))
        dropped[order[capacity:]] = True
    return dropped


def test_overflow_drops_exactly_the_expected_assignments():
    model, x = _overflow_case()
    expected = _expected_overflow_drops(model, x)
    assert expected.sum() == 24  # 4 groups x (8 - 2)

    # The pure drop mask.
    @jax.jit
    def mask(x, gate):
        w, e = top_k_router(x.reshape(-1, 8) @ gate, 1, softmax_over="all")
        return capacity_mask(e.reshape(4, 8, 1), w.reshape(4, 8, 1), num_experts=4, capacity=2)[0]

    keep = mask(x, model.gate.value)
    np.testing.assert_array_equal(~np.asarray(keep).reshape(-1), expected)

    # The layer, on one device and on dp=2 x ep=2 (sequence split 2 ways: groups of 8
    # are whole on each device): a token whose only assignment is dropped outputs zero.
    y1, aux1 = jax.jit(lambda m, x: m(x))(model, x)
    mesh = es.make_mesh("dp=2,ep=2")
    model_dp = MoE(8, 16, 4, 1, capacity_factor=1.0, group_size=8, softmax_over="all",
                   data_axis_name="dp", dispatch="ragged", key=jax.random.key(11))
    model_dp = eqx.tree_at(lambda m: m.gate.value, model_dp, model.gate.value)
    fn = es.filter_shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(None, P("dp", "ep")),
                             out_specs=(P("dp", "ep"), P()))
    y8, aux8 = eqx.filter_jit(fn)(model_dp, x)
    for y, aux in ((y1, aux1), (y8, aux8)):
        zero_rows = np.all(np.asarray(y).reshape(-1, 8) == 0, axis=-1)
        np.testing.assert_array_equal(zero_rows, expected)
        assert int(aux.dropped) == 24
        np.testing.assert_array_equal(np.asarray(aux.expert_load), [32, 0, 0, 0])
    assert_tree_allclose(y8, y1)
    ref_y, _, ref_keep = jax.jit(functools.partial(
        reference_moe, top_k=1, capacity_factor=1.0, group_size=8, softmax_over="all"
    ))(*_params(model), x)
    np.testing.assert_array_equal(~np.asarray(ref_keep).reshape(-1), expected)
    assert_tree_allclose(y1, ref_y)


# -------------------------------------------------------- ragged_all_to_all emulation


def _ragged_semantics(operands, outputs, in_off, send, out_off, recv):
    """Numpy model of the documented semantics, over all devices at once."""
    n = len(operands)
    per = len(in_off[0]) // n
    results = [o.copy() for o in outputs]
    for src in range(n):
        for i in range(len(in_off[src])):
            dst = i // per
            rows = operands[src][in_off[src][i]: in_off[src][i] + send[src][i]]
            results[dst][out_off[src][i]: out_off[src][i] + len(rows)] = rows
            assert recv[dst][src * per + i % per] == send[src][i]
    return results


def test_ragged_all_to_all_emulation():
    mesh = es.make_mesh("ep=2")
    # The example of jax.lax.ragged_all_to_all's documentation.
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    output = np.zeros((2, 4), np.float32)
    in_off = np.array([[0, 1], [0, 1]], np.int32)
    send = np.array([[1, 2], [1, 1]], np.int32)
    out_off = np.array([[0, 0], [1, 2]], np.int32)
    recv = np.array([[1, 1], [2, 1]], np.int32)

    def emulated(*args):
        args = [a[0] for a in args]
        return ragged_all_to_all_emulated(*args, axis_name="ep")[None]

    fn = jax.jit(jax.shard_map(emulated, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    got = fn(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])

    # Two slices per device on 4 devices, random sizes, rows of width 3.
    n, per, rows, width = 4, 2, 6, 3
    rng = np.random.default_rng(0)
    send = rng.integers(0, 3, size=(n, n * per)).astype(np.int32)  # [src, slot]
    in_off = np.stack([np.concatenate([[0], np.cumsum(s)[:-1]]) for s in send]).astype(np.int32)
    operands = rng.normal(size=(n, n * per * 2, width)).astype(np.float32)
    # Receiver d lays out its incoming slices by source, then slot.
    incoming = np.stack([send[:, d * per:(d + 1) * per].reshape(-1) for d in range(n)])
    starts = np.stack([np.concatenate([[0], np.cumsum(s)[:-1]]) for s in incoming])
    out_off = np.zeros_like(send)
    for src in range(n):
        for i in range(n * per):
            out_off[src, i] = starts[i // per, src * per + i % per]
    outputs = np.full((n, n * per * 2 + rows, width), -1.0, np.float32)
    expect = _ragged_semantics(list(operands), list(outputs), in_off, send, out_off, incoming)
    mesh4 = es.make_mesh("ep=4")
    fn4 = jax.jit(jax.shard_map(emulated, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))
    got = fn4(operands, outputs, in_off, send, out_off, incoming.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(got), np.stack(expect))
    if es.core.native_ragged_all_to_all():
        def native(*args):
            args = [a[0] for a in args]
            return jax.lax.ragged_all_to_all(*args, axis_name="ep")[None]

        fn_native = jax.jit(jax.shard_map(native, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))
        np.testing.assert_array_equal(
            np.asarray(fn_native(operands, outputs, in_off, send, out_off, incoming.astype(np.int32))),
            np.stack(expect),
        )


# ------------------------------------------------------------------- configuration


def test_dispatch_choice_in_repr_and_overridable():
    model = MoE(8, 16, 4, 2, group_size=4, key=jax.random.key(0))
    native = es.core.native_ragged_all_to_all()
    assert model.dispatch == ("ragged" if native else "dense")
    assert f"dispatch='{model.dispatch}'" in repr(model)
    ragged = model.with_dispatch("ragged", "emulated")
    assert ragged.dispatch == "ragged" and ragged.ragged_impl == "emulated"
    assert "dispatch='ragged'" in repr(ragged) and "ragged_impl='emulated'" in repr(ragged)
    assert ragged.gate.value is model.gate.value
    assert es.specs_of(model).w_in == P("ep", None, None)
    assert es.specs_of(model).gate == P(None, None)


def test_with_dispatch_leaves_the_layer_unchanged():
    model = MoE(8, 16, 4, 2, group_size=4, dispatch="dense", key=jax.random.key(0))
    ragged = model.with_dispatch("ragged", "emulated")
    assert model.dispatch == "dense" and ragged.dispatch == "ragged"
    assert ragged.w_in.value is model.w_in.value and ragged.w_out.value is model.w_out.value


def test_transformer_block_with_an_moe_layer():
    """`TransformerBlock(moe=...)`: the MoE as the feed-forward sub-layer, its aux returned."""
    from equishard.nn import TransformerBlock

    key = jax.random.key(5)
    moe = _model()
    block = TransformerBlock(D, 2, 4 * D, moe=moe, key=key)
    dense = TransformerBlock(D, 2, 4 * D, key=key)
    assert_tree_allclose(block.attn, dense.attn)  # the same key gives the same attention
    x, _ = _inputs()
    y, aux = block.call_with_aux(x)
    h = x + block.attn(block.norm1(x))
    want, want_aux = moe(block.norm2(h))
    assert_tree_allclose((y, aux), (h + want, want_aux))
    assert dense.call_with_aux(x)[1] is None
    with pytest.raises(es.LayerConfigError, match="call_with_aux"):
        block(x)
    with pytest.raises(es.LayerConfigError, match="hidden=8 is not d_model=16"):
        TransformerBlock(16, 2, 64, moe=moe, key=key)


def test_bad_configuration():
    key = jax.random.key(0)
    with pytest.raises(es.LayerConfigError, match=r"MoE.*top_k=5.*num_experts=4"):
        MoE(8, 16, 4, 5, key=key)
    for factor in (0, -1.0):
        with pytest.raises(es.LayerConfigError, match=rf"MoE.*capacity_factor must be > 0, got {factor}"):
            MoE(8, 16, 4, 2, capacity_factor=factor, key=key)


def _call(model, x, layout, spec, weights=None):
    mesh = es.make_mesh(layout)
    fn = es.filter_shard_map(lambda m, x: m(x)[0], mesh=mesh, in_specs=(weights, spec), out_specs=spec)
    return jax.eval_shape(fn, model, x)


def test_bad_input():
    key = jax.random.key(0)
    x = jnp.zeros((2, 32, 8))
    # num_experts not divisible over the expert axis: the boxed weights do not split ...
    six = MoE(8, 16, 6, 2, group_size=4, key=key)
    with pytest.raises(es.SpecError, match=r"w_in.*\(6, 8, 16\)"):
        _call(six, x, "ep=4", P(None, "ep"))
    # ... and the layer says so itself when the weights reach it unsplit.
    with pytest.raises(es.LayerConfigError, match=r"MoE.*num_experts=6 is not divisible by 4, the size of mesh axis 'ep'"):
        _call(six, x, "ep=4", P(None, "ep"), weights=P())
    # Tokens not divisible into groups on each device.
    model = MoE(8, 16, 4, 2, group_size=3, key=key)
    with pytest.raises(es.LayerConfigError, match=r"group_size=3.*sequence slice of 8 tokens"):
        _call(model, x, "ep=4", P(None, "ep"))
    with pytest.raises(es.LayerConfigError, match=r"group_size=3.*2 x 32 = 64 tokens"):
        jax.eval_shape(model, x)
    # ep > 1: groups must not straddle devices along the sequence, even if they divide
    # the local token count (2 x 8 = 16 tokens, groups of 16).
    wide = MoE(8, 16, 4, 2, group_size=16, key=key)
    with pytest.raises(es.LayerConfigError, match=r"group_size=16.*sequence slice of 8"):
        _call(wide, x, "ep=4", P(None, "ep"))
    # Sequence not divisible over the expert axis.
    with pytest.raises(es.SpecError, match=r"\(2, 30, 8\)"):
        _call(model, jnp.zeros((2, 30, 8)), "ep=4", P(None, "ep"))
    # Tokens split over a data axis the layer was not told about.
    ok = MoE(8, 16, 4, 2, group_size=4, key=key)
    with pytest.raises(es.SpecError, match=r"MoE.*\['dp'\].*data_axis_name"):
        _call(ok, x, "dp=2,ep=4", P("dp", "ep"))
    # Wrong width.
    with pytest.raises(es.SpecError, match=r"MoE.*hidden=8.*\(2, 8, 6\)"):
        _call(ok, jnp.zeros((2, 32, 6)), "ep=4", P(None, "ep"))


# ---------------------------------------------------------------------------- FSDP


def test_composes_with_fsdp_over_the_data_axis():
    # Expert weights split over ep (experts) and over dp (FSDP, gathered before the call);
    # the gate is split over dp too. Gradients come back split the same way.
    # regather=False: FSDP's re-gathering backward does not yet accept a module with
    # integer outputs (MoEAux's counts).
    mesh = es.make_mesh("dp=2,ep=4")
    model = FSDP(_model(data_axis_name="dp"), "dp", min_weight_size=0, regather=False, mesh=mesh)
    specs = es.specs_of(model)
    assert specs.module.w_in == P("ep", None, "dp") and specs.module.w_out == P("ep", "dp", None)
    x, c = _inputs()
    tokens = P("dp", "ep", None)
    grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)

    def step(model, x, c):
        (loss, (y, aux)), (gm, gx) = grad_fn(model, x, c, ("dp", "ep"))
        return loss, y, aux, gm, gx

    fn = es.filter_shard_map(step, mesh=mesh, in_specs=(None, tokens, tokens),
                             out_specs=(P(), tokens, P(), specs, tokens))
    loss, y, aux, gm, gx = eqx.filter_jit(fn)(model, x, c)
    assert es.specs_of(gm) == specs
    _check_against_reference((loss, y, aux, gm.module, gx), _reference())
