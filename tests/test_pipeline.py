"""Pipeline parallelism: schedules, GPipe and circular parity with the sequential model,
collectives in the compiled program, composition with DP/TP/FSDP, and bad input."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import (
    execute_circular_pipeline,
    execute_pipeline,
    execute_pipeline_step,
    execute_schedule,
    from_last_stage,
    pipeline_layer_order,
    pipeline_schedule,
    schedule_report,
    schedule_weights,
)
from equishard.nn import PipelineModule
from equishard.report import read_collectives

from .helpers import assert_tree_allclose

D = 16  # model width
T = 4  # tokens
B = 16  # global batch
L = 8  # layers


def _rms(x, scale):
    # f32[b, T, D] -> f32[b, T, D]
    norm = jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    return x * norm * scale[None, None, :]


class Block(eqx.Module):
    """A plain transformer block: causal single-head attention and a GELU MLP, pre-norm."""

    ln1: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    ln2: jax.Array
    w1: jax.Array
    w2: jax.Array

    def __init__(self, key):
        ks = jax.random.split(key, 8)
        self.ln1 = 1 + 0.1 * jax.random.normal(ks[0], (D,))
        self.wq, self.wk, self.wv, self.wo = (
            jax.random.normal(k, (D, D)) / D**0.5 for k in ks[1:5]
        )
        self.ln2 = 1 + 0.1 * jax.random.normal(ks[5], (D,))
        self.w1 = jax.random.normal(ks[6], (D, 2 * D)) / D**0.5
        self.w2 = jax.random.normal(ks[7], (2 * D, D)) / (2 * D) ** 0.5

    def __call__(self, x):
        h = _rms(x, self.ln1)
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv  # f32[b, T, D]
        scores = jnp.einsum("btd,bsd->bts", q, k) / D**0.5
        causal = jnp.tril(jnp.ones((T, T), bool))[None]
        att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bts,bsd->btd", att, v) @ self.wo
        h = _rms(x, self.ln2)
        return x + jax.nn.gelu(h @ self.w1) @ self.w2


def _loss(y):
    return jnp.mean(jnp.sin(y) * y)


@functools.cache
def _reference():
    """Blocks from split keys run in order on one device: loss, output, gradients."""
    key = jax.random.key(0)
    blocks = [Block(k) for k in jax.random.split(key, L)]
    x = jax.random.normal(jax.random.key(1), (B, T, D))

    def run(blocks, x):
        for block in blocks:
            x = block(x)
        return _loss(x), x

    (loss, y), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(blocks, x)
    return key, x, blocks, loss, y, grads


def _compile(fn, *args):
    """Compile `fn(*args)` once; return a runner and the compiled program (for its HLO)."""
    dyn, static = eqx.partition(args, eqx.is_array)
    out_static = []

    def call(dyn):
        out = fn(*eqx.combine(dyn, static))
        out_dyn, rest = eqx.partition(out, eqx.is_array)
        out_static.append(rest)
        return out_dyn

    compiled = jax.jit(call).lower(dyn).compile()
    return (lambda: eqx.combine(compiled(dyn), out_static[-1])), compiled


def _pipeline_grad(mesh, pipe_specs, data_axis=None):
    """Loss, every stage's output and gradients of a pipelined loss (inside shard_map)."""

    def inner(pipe, x):
        def loss_fn(pipe):
            y = pipe(x)  # f32[B/dp, T, D] on the last stage, zeros elsewhere
            loss = _loss(y)
            if data_axis is not None:
                loss = jax.lax.pmean(loss, data_axis)
            return from_last_stage(loss, "pp"), y

        (loss, y), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(pipe)
        return loss, y[None], grads

    y_spec = P("pp", data_axis)
    x_spec = P(data_axis)
    return es.filter_shard_map(
        inner, mesh=mesh, in_specs=(None, x_spec), out_specs=(P(), y_spec, pipe_specs)
    )


def _check_permutes_only(compiled, pp, num_microbatches, repeats, batch):
    """Activations move only by collective-permutes along pp; one scalar all-reduce (the loss)."""
    ops = read_collectives(compiled)
    steps = repeats * num_microbatches + pp - 1
    permutes = [op for op in ops if op.kind == "collective-permute"]
    others = [op for op in ops if op.kind != "collective-permute"]
    assert not any(op.kind == "all-gather" for op in ops)
    # The ring shift of the forward pass and its transpose in the backward pass, on
    # every step but the last (whose output stays on the last stage).
    assert len(permutes) == 2, [str(op) for op in ops]
    for op in permutes:
        assert op.group_size == pp
        assert op.count == steps - 1
        assert op.operand_shapes == (("f32", (batch // num_microbatches, T, D)),)
    assert len(others) == 1 and others[0].kind == "all-reduce", [str(op) for op in ops]
    assert others[0].operand_shapes == (("f32", ()),)


def _check_parity(pp, num_microbatches, repeats):
    key, x, blocks, loss_ref, y_ref, grads_ref = _reference()
    mesh = es.make_mesh(f"pp={pp}")
    # Built eagerly (cheap: the ops are cached across configurations) and placed by
    # filter_shard_map; born-sharded construction is tested in test_init_mesh_invariant.
    pipe = PipelineModule(
        Block, "pp", num_microbatches, num_layers=L, num_stages=pp, repeats=repeats, key=key
    )
    run, compiled = _compile(_pipeline_grad(mesh, es.specs_of(pipe)), pipe, x)
    loss, y, grads = run()
    # Outputs: the last stage's equal the sequential model's, the others are zeros.
    assert_tree_allclose(loss, loss_ref)
    assert_tree_allclose(y[-1], y_ref)
    assert float(jnp.max(jnp.abs(y[:-1]))) == 0.0
    # Gradients of every parameter of every layer.
    assert_tree_allclose(grads.unstack(), grads_ref)
    _check_permutes_only(compiled, pp, num_microbatches, repeats, B)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("mb_per_stage", [0, 1, 2])
def test_gpipe_matches_sequential(pp, mb_per_stage):
    _check_parity(pp, max(1, mb_per_stage * pp), 1)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mb_per_stage", [1, 2])
def test_circular_matches_sequential(pp, mb_per_stage):
    _check_parity(pp, mb_per_stage * pp, 2)


# ------------------------------------------------------------------------ schedules


def _when(sched):
    """{(op, micro-batch, global stage): step} of a table; every entry exactly once."""
    when = {}
    for t in range(sched.num_steps):
        for d in range(sched.num_stages):
            op, mb, v = (int(a[t, d]) for a in (sched.op, sched.microbatch, sched.virtual))
            assert (op == 0) == (mb < 0) == (v < 0)
            if op:
                key = (op, mb, v * sched.num_stages + d)
                assert key not in when
                when[key] = t
    return when


SCHEDULE_CASES = [
    ("gpipe", 1, 3, 1), ("gpipe", 4, 6, 1), ("circular", 2, 2, 2), ("circular", 4, 8, 2),
    ("circular", 4, 4, 3), ("1f1b", 4, 1, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1),
    ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 4, 3), ("zb-h1", 4, 8, 1),
    ("zb-h1", 8, 16, 1), ("zb-h1", 1, 2, 1),
]  # fmt: skip


@pytest.mark.parametrize("name, pp, m, r", SCHEDULE_CASES)
def test_schedule_table(name, pp, m, r):
    """Every piece of work runs once, after what it needs (one step to reach a neighbour)."""
    sched = pipeline_schedule(name, pp, m, repeats=r)
    when = _when(sched)
    stages = pp * r
    ops = (1, 2, 3) if name == "zb-h1" else (1, 2)
    assert set(when) == {(op, mb, g) for op in ops for mb in range(m) for g in range(stages)}
    for mb in range(m):
        for g in range(stages):
            if g:
                assert when[1, mb, g] > when[1, mb, g - 1]
            assert when[2, mb, g] > when[1, mb, g]
            if g < stages - 1:
                assert when[2, mb, g] > when[2, mb, g + 1]
            if name == "zb-h1":
                assert when[3, mb, g] > when[2, mb, g]
    report = schedule_report(sched)
    assert report.num_steps == sched.num_steps and "bubble=" in str(report)
    busy = len(ops) * m * r
    assert report.idle_fraction == pytest.approx(1 - busy / sched.num_steps)
    textbook = (pp - 1) / (r * m + pp - 1)
    if name in ("gpipe", "circular", "1f1b", "interleaved-1f1b"):
        assert report.bubble_fraction == pytest.approx(textbook)
    else:  # zero bubble: between the ideal (S - 1) / (3 M + S - 1) and 1F1B's
        assert (pp - 1) / (3 * m + pp - 1) - 1e-9 <= report.bubble_fraction <= textbook
    peak = report.peak_in_flight
    if name in ("gpipe", "circular"):
        assert peak == (r * m,) * pp
    elif name == "1f1b":
        assert peak == tuple(min(m, pp - d) for d in range(pp))
    elif name == "zb-h1":
        assert max(peak) <= min(m, pp)
    else:  # Megatron's warm-up: 2 (S - d - 1) + (R - 1) S forwards, then one more
        assert peak == tuple(min(r * m, 2 * (pp - d - 1) + (r - 1) * pp + 1) for d in range(pp))


def test_schedule_gpipe_forward_timing():
    """GPipe/circular tables: device d does its k-th forward at step k + d (one ring shift)."""
    for r in (1, 2):
        sched = pipeline_schedule("gpipe" if r == 1 else "circular", 4, 8, repeats=r)
        for d in range(4):
            steps = [t for t in range(sched.num_steps) if sched.op[t, d] == 1]
            assert steps == list(range(d, d + r * 8))


def test_schedule_errors():
    with pytest.raises(es.LayerConfigError, match="unknown schedule 'pipedream'"):
        pipeline_schedule("pipedream", 4, 8)
    with pytest.raises(es.LayerConfigError, match="'1f1b' schedule runs one stage per device"):
        pipeline_schedule("1f1b", 4, 8, repeats=2)
    with pytest.raises(es.LayerConfigError, match="num_microbatches=6 must be a multiple of"):
        pipeline_schedule("interleaved-1f1b", 4, 6, repeats=2)
    with pytest.raises(es.LayerConfigError, match="num_stages must be at least 1"):
        pipeline_schedule("gpipe", 0, 6)


def test_layer_order():
    assert pipeline_layer_order(8, 4) == tuple(range(8))
    # Device 0 holds global stages 0 and 2, device 1 stages 1 and 3 (2 layers each).
    assert pipeline_layer_order(8, 2, 2) == (0, 1, 4, 5, 2, 3, 6, 7)


def test_init_mesh_invariant():
    """Layer l of the pipeline is `Block(split(key, L)[l])`, on any pp and schedule."""
    key, _, blocks, *_ = _reference()
    # Born sharded on the mesh (circular: the stack is in device-major order).
    mesh = es.make_mesh("pp=4")
    make = lambda k: PipelineModule(Block, "pp", 4, num_layers=L, num_stages=4, repeats=2, key=k)  # noqa: E731
    pipe = es.sharded_init(make, key, mesh=mesh)
    assert es.specs_of(pipe.layers).w1 == P("pp", None, None)
    assert pipe.layers.w1.value.sharding.spec == P("pp", None, None)
    for got, want in zip(pipe.unstack(), blocks):
        assert_tree_allclose(got, want)
    # GPipe's stack is the model's layers in order, whatever pp.
    for pp in [2, 8]:
        pipe = PipelineModule(Block, "pp", 1, num_layers=L, num_stages=pp, key=key)
        assert_tree_allclose(pipe.unstack(), blocks)
        assert_tree_allclose(pipe.layers.w1.value, jnp.stack([b.w1 for b in blocks]))


# ------------------------------------------------------------------- core, directly


def test_execute_pipeline_step_and_callable_stage():
    """A stage is any callable; extra args and kwargs reach it; one step shifts by one."""
    mesh = es.make_mesh("pp=4")
    scales = jnp.arange(1.0, 5.0)  # stage i multiplies by (i + 1)

    def inner(scale, x):
        stage = lambda h, c, *, shift: h * scale[0] + c + shift  # noqa: E731
        state = jnp.full_like(x, 100.0)
        new_state, out = execute_pipeline_step(stage, state, x, 1.0, model_axis_name="pp", shift=2.0)
        y = execute_pipeline(stage, x, 0.0, num_microbatches=2, model_axis_name="pp", shift=0.0)
        return new_state[None], out[None], y[None]

    x = jnp.ones((4, 3))
    f = es.filter_shard_map(inner, mesh=mesh, in_specs=(P("pp"), P()), out_specs=P("pp"))
    new_state, out, y = f(scales, x)
    # Stage 0 reads the input, the others the state; each output moves on by one.
    want_out = jnp.stack([1.0 * 1 + 3, 100.0 * 2 + 3, 100.0 * 3 + 3, 100.0 * 4 + 3])
    # The step's output is the last stage's, zeros on the others (as in xLSTM-JAX).
    np.testing.assert_allclose(out[:, 0, 0], want_out * (jnp.arange(4) == 3))
    np.testing.assert_allclose(new_state[:, 0, 0], jnp.roll(want_out, 1))
    np.testing.assert_allclose(y[-1], jnp.full((4, 3), 24.0))
    np.testing.assert_array_equal(y[:-1], jnp.zeros((3, 4, 3)))


def test_input_gradient():
    """Gradients reach the input too (an embedding before the pipeline), summed over
    the stage axis by one all-reduce after the loop, not one per step."""
    mesh = es.make_mesh("pp=4")
    w = jax.random.normal(jax.random.key(5), (4, D))
    x = jax.random.normal(jax.random.key(6), (8, D))
    block = lambda w_i, h: jnp.tanh(h * w_i[None, :]) + h  # noqa: E731

    def inner(w, x):
        def loss_fn(w, x):
            y = execute_pipeline(lambda h: block(w[0], h), x, num_microbatches=4, model_axis_name="pp")
            return from_last_stage(jnp.mean(jnp.sin(y)), "pp")

        return jax.value_and_grad(loss_fn, argnums=(0, 1))(w, x)

    def reference(w, x):
        for i in range(4):
            x = block(w[i], x)
        return jnp.mean(jnp.sin(x))

    f = es.filter_shard_map(inner, mesh=mesh, in_specs=(P("pp"), P()), out_specs=(P(), (P("pp"), P())))
    run, compiled = _compile(f, w, x)
    loss, grads = run()
    loss_ref, grads_ref = jax.value_and_grad(reference, argnums=(0, 1))(w, x)
    assert_tree_allclose((loss, grads), (loss_ref, grads_ref))
    # The loss's psum and the input cotangent's (XLA may combine them into one tuple).
    reduces = [op for op in read_collectives(compiled) if op.kind == "all-reduce"]
    assert all(op.count == 1 for op in reduces), [str(op) for op in reduces]
    arrays = [shape for op in reduces for _, shape in op.operand_shapes if shape != ()]
    assert len(arrays) == 1 and math.prod(arrays[0]) == x.size, [str(op) for op in reduces]


def test_circular_callable_stage_gets_repeat():
    mesh = es.make_mesh("pp=2")

    def inner(x):
        # Global stage g = repeat * 2 + device appends digit g: 0, 1, 2, 3 in order.
        stage = lambda rep, h: h * 10 + (rep * 2 + jax.lax.axis_index("pp"))  # noqa: E731
        return execute_circular_pipeline(stage, x, num_microbatches=2, repeats=2, model_axis_name="pp")[None]

    y = es.filter_shard_map(inner, mesh=mesh, in_specs=P(), out_specs=P("pp"))(jnp.ones((4,), jnp.int32))
    np.testing.assert_array_equal(y[-1], jnp.full((4,), 10123))


# ------------------------------------------------------------------- composition


class TPBlock(eqx.Module):
    """Norm + MLP + residual whose MLP is column/row-split over "tp"."""

    ln: jax.Array
    up: es.nn.ColumnParallelLinear
    down: es.nn.RowParallelLinear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln = 1 + 0.1 * jax.random.normal(k1, (D,))
        self.up = es.nn.ColumnParallelLinear(D, 4 * D, axis_name="tp", gather_output=False, key=k2)
        self.down = es.nn.RowParallelLinear(4 * D, D, axis_name="tp", input_is_parallel=True, key=k3)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(_rms(x, self.ln))))


def test_compose_dp_pp_tp_fsdp():
    """(dp=2, pp=2, tp=2): data parallel batch, TP layers and FSDP over dp inside stages."""
    mesh = es.make_mesh("dp=2,pp=2,tp=2")
    key = jax.random.key(3)
    x = jax.random.normal(jax.random.key(4), (B, T, D))
    num_layers = 4

    def run(blocks, x):
        for block in blocks:
            x = block(x)
        return _loss(x), x

    ref_blocks = [TPBlock(k) for k in jax.random.split(key, num_layers)]
    (loss_ref, y_ref), grads_ref = jax.jit(jax.value_and_grad(run, has_aux=True))(ref_blocks, x)

    make_block = lambda k: es.nn.FSDP(TPBlock(k), "dp", min_weight_size=0, mesh=mesh)  # noqa: E731
    pipe = PipelineModule(make_block, "pp", 4, num_layers=num_layers, num_stages=2, repeats=2, key=key)
    # Stage parameters: split over pp in front, TP and FSDP splits inside.
    w_up = pipe.layers.module.up.weight
    assert w_up.spec[0] == "pp" and "tp" in w_up.spec and "dp" in w_up.spec

    run_pipe, compiled = _compile(_pipeline_grad(mesh, es.specs_of(pipe), "dp"), pipe, x)
    loss, y, grads = run_pipe()
    assert_tree_allclose(loss, loss_ref)
    assert_tree_allclose(y[-1], y_ref)
    assert_tree_allclose([g.module for g in grads.unstack()], grads_ref)

    # Activations still move only by collective-permutes over pp (group 2); nothing
    # all-gathers an activation (FSDP's all-gathers are of weights).
    ops = read_collectives(compiled)
    act = ("f32", (B // 2 // 4, T, D))
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert permutes and all(op.operand_shapes == (act,) and op.group_size == 2 for op in permutes)
    for op in ops:
        if op.kind == "all-gather":
            assert all(shape[-2:] != (T, D) for _, shape in op.result_shapes), str(op)


def test_stage_box_reports_global_shape():
    """Inside shard_map a stage's boxes keep their global shape: (16, 16), not the (16, 4) block."""
    mesh = es.make_mesh("pp=2,tp=4")
    seen = []

    class Recorder(eqx.Module):
        w: es.Sharded

        def __init__(self, key):
            self.w = es.Sharded(jax.random.normal(key, (D, D)) / D**0.5, P(None, "tp"))

        def __call__(self, h):
            seen.append((self.w.global_shape, tuple(jnp.shape(self.w.value))))
            return h

    pipe = PipelineModule(Recorder, "pp", 2, num_layers=2, num_stages=2, key=jax.random.key(0))
    stacked = pipe.layers.w
    assert stacked.global_shape == (2, D, D) and stacked.spec == P("pp", None, "tp")
    assert es.specs_of(pipe.unstack()[0]).w == P(None, "tp")
    assert pipe.unstack()[0].w.global_shape == (D, D)
    _trace(lambda p, x: from_last_stage(p(x).sum(), "pp"), mesh, pipe, jnp.ones((4, T, D)))
    assert seen and set(seen) == {((D, D), (D, D // 4))}


# ------------------------------------------------------------------- bad input


def _trace(fn, mesh, *args, in_specs=None):
    return jax.eval_shape(es.filter_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P()), *args)


def test_errors():
    mesh = es.make_mesh("pp=2")
    x = jnp.ones((6, T, D))
    ident = lambda h: h  # noqa: E731

    with pytest.raises(es.LayerConfigError, match=r"\(6, 4, 16\).*num_microbatches=4"):
        _trace(lambda x: execute_pipeline(ident, x, num_microbatches=4, model_axis_name="pp").sum(), mesh, x)
    with pytest.raises(es.LayerConfigError, match="num_layers=6 is not divisible.*2 \\* 2"):
        PipelineModule(Block, "pp", 2, num_layers=6, num_stages=2, repeats=2, key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="num_microbatches=3 must be a multiple.*2"):
        PipelineModule(Block, "pp", 3, num_layers=8, num_stages=2, repeats=2, key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="num_microbatches=3 must be a multiple"):
        stage = lambda rep, h: h  # noqa: E731
        _trace(
            lambda x: execute_circular_pipeline(stage, x, num_microbatches=3, repeats=2, model_axis_name="pp").sum(),
            mesh,
            x,
        )
    with pytest.raises(es.LayerConfigError, match=r"returned float32\[3, 4, 8\].*float32\[3, 4, 16\]"):
        _trace(lambda x: execute_pipeline(lambda h: h[..., :8], x, num_microbatches=2, model_axis_name="pp").sum(), mesh, x)

    class Shrink(eqx.Module):
        w: jax.Array

        def __init__(self, key):
            self.w = jax.random.normal(key, (D, D // 2))

        def __call__(self, h):
            return h @ self.w

    bad = PipelineModule(Shrink, "pp", 2, num_layers=2, num_stages=2, key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match=r"layer Shrink returned float32\[3, 4, 8\]"):
        _trace(lambda p, x: p(x).sum(), mesh, bad, x)
    wrong = PipelineModule(Block, "pp", 2, num_layers=4, num_stages=4, key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="num_stages=4.*size 2"):
        _trace(lambda p, x: p(x).sum(), mesh, wrong, x)
    with pytest.raises(es.LayerConfigError, match="'pp' is not bound"):
        execute_pipeline(ident, x, num_microbatches=2, model_axis_name="pp")


# ------------------------------------------------------------- explicit schedules


def _head(w, y, t):
    # f32[b, T, D] @ f32[D] -> f32[b, T]: a regression head and its loss.
    return jnp.mean((y @ w - t) ** 2)


@functools.cache
def _head_reference(num_layers, block_cls: type = Block):
    """Blocks from split keys in order, then the head: loss and gradients (one device)."""
    key = jax.random.key(0)
    blocks = [block_cls(k) for k in jax.random.split(key, num_layers)]
    w = jax.random.normal(jax.random.key(7), (D,)) / D**0.5
    # A batch of 32: 4 micro-batches per stage on 8 stages.
    x = jax.random.normal(jax.random.key(1), (32, T, D))
    t = jax.random.normal(jax.random.key(8), (32, T))

    def run(blocks, w, x):
        for block in blocks:
            x = block(x)
        return _head(w, x, t)

    loss, grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2)))(blocks, w, x)
    return key, blocks, w, x, t, loss, grads


def _schedule_loss_grad(mesh, pipe_specs, data_axis=None):
    """The pipeline's loss (`PipelineModule.loss`) and its gradients (inside shard_map)."""

    def inner(pipe, w, x, t):
        def loss_fn(pipe, w, x):
            loss = pipe.loss(x, t, last=_head, last_params=w)
            return jax.lax.pmean(loss, data_axis) if data_axis else loss

        return jax.value_and_grad(
            lambda p, w, x: loss_fn(eqx.combine(p, static), w, x), argnums=(0, 1, 2)
        )(eqx.filter(pipe, eqx.is_array), w, x)

    static = None

    def wrapped(pipe, w, x, t):
        nonlocal static
        static = eqx.filter(pipe, eqx.is_array, inverse=True)
        return inner(pipe, w, x, t)

    return es.filter_shard_map(
        wrapped, mesh=mesh, in_specs=(None, P(), P(data_axis), P(data_axis)),
        out_specs=(P(), (pipe_specs, P(), P(data_axis))),
    )  # fmt: skip


def _check_schedule(schedule, pp, m, layout=None, block_cls: type = Block, data_axis=None, wrap=None):
    repeats = 2 if schedule == "interleaved-1f1b" else 1
    num_layers = 2 * pp * repeats
    key, blocks, w, x, t, loss_ref, (g_blocks, g_w, g_x) = _head_reference(num_layers, block_cls)
    mesh = es.make_mesh(layout or f"pp={pp}")
    make = block_cls if wrap is None else (lambda k: wrap(block_cls(k), mesh))
    pipe = PipelineModule(
        make, "pp", m, num_layers=num_layers, num_stages=pp, repeats=repeats,
        schedule=schedule, key=key,
    )  # fmt: skip
    run, compiled = _compile(_schedule_loss_grad(mesh, es.specs_of(pipe), data_axis), pipe, w, x, t)
    loss, (grads, gw, gx) = run()
    assert_tree_allclose(loss, loss_ref)
    layers = grads.unstack()
    if wrap is not None:
        layers = [layer.module for layer in layers]
    assert_tree_allclose(layers, g_blocks)
    assert_tree_allclose(gw, g_w)
    assert_tree_allclose(gx, g_x)
    return compiled


class TanhBlock(eqx.Module):
    """A small residual block (cheap to compile: the schedule grid below has 27 cases)."""

    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (D, D)) / D**0.5

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


EXPLICIT = ["1f1b", "interleaved-1f1b", "zb-h1"]


@pytest.mark.parametrize("schedule", EXPLICIT)
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("mb_per_stage", [1, 2, 4])
def test_explicit_schedule_matches_sequential(schedule, pp, mb_per_stage):
    _check_schedule(schedule, pp, mb_per_stage * pp, block_cls=TanhBlock)


def test_explicit_schedule_transformer_block():
    _check_schedule("1f1b", 4, 8)


def _fsdp(block, mesh):
    return es.nn.FSDP(block, "fsdp", min_weight_size=0, mesh=mesh)


@pytest.mark.parametrize(
    "layout, schedule, block_cls, data_axis, wrap",
    [
        ("pp=4,tp=2", "1f1b", TPBlock, None, None),
        ("dp=2,pp=4", "1f1b", Block, "dp", None),
        ("fsdp=2,pp=4", "1f1b", Block, "fsdp", _fsdp),
        ("dp=2,pp=2,tp=2", "1f1b", TPBlock, "dp", None),
        ("dp=2,pp=2,tp=2", "zb-h1", TPBlock, "dp", None),
        ("dp=2,pp=2,tp=2", "interleaved-1f1b", TPBlock, "dp", None),
    ],
)
def test_explicit_schedule_composes(layout, schedule, block_cls, data_axis, wrap):
    """Tensor-parallel, data-parallel and FSDP layers inside the stages of each schedule."""
    pp = es.make_mesh(layout).shape["pp"]
    _checked_schedule(schedule, pp, 2 * pp, layout=layout, block_cls=block_cls, data_axis=data_axis, wrap=wrap)


_checked_schedule = functools.cache(_check_schedule)  # the compiled programs, shared


def test_fsdp_beside_pipeline_gathers_once_per_step():
    """Each stage's FSDP units are gathered once per step, before the schedule, and their
    gradients reduce-scattered once, after it: at M = 4 as many all-gathers and
    reduce-scatters as at M = 8 (each once, outside the schedule's loop: one per split
    array of the stage, 8), and the values and gradients equal the sequential model's."""
    found = []
    for m in (4, 8):
        compiled = _checked_schedule("1f1b", 4, m, layout="fsdp=2,pp=4", block_cls=Block, data_axis="fsdp", wrap=_fsdp)
        ops = [op for op in read_collectives(compiled) if op.kind in ("all-gather", "reduce-scatter")]
        assert {op.count for op in ops} == {1}, [str(op) for op in ops]
        found.append(sorted((op.kind, op.operand_shapes) for op in ops))
        for kind in ("all-gather", "reduce-scatter"):
            assert sum(len(op.operand_shapes) for op in ops if op.kind == kind) == 8, (m, kind)
    assert found[0] == found[1]


def test_explicit_schedule_errors():
    mesh = es.make_mesh("pp=2")
    x = jnp.ones((4, T, D))
    pipe = PipelineModule(TanhBlock, "pp", 2, num_layers=2, num_stages=2, schedule="1f1b", key=jax.random.key(0))
    assert pipe.explicit and pipe.table().name == "1f1b"
    with pytest.raises(es.LayerConfigError, match="'1f1b' schedule runs each micro-batch's backward"):
        _trace(lambda p, x: p(x).sum(), mesh, pipe, x)
    with pytest.raises(es.LayerConfigError, match="'zb-h1' schedule runs one stage per device"):
        PipelineModule(TanhBlock, "pp", 2, num_layers=4, num_stages=2, repeats=2, schedule="zb-h1", key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="cannot be split into num_microbatches=2"):
        _trace(lambda p, x: p.loss(x, x[..., 0], last=_head, last_params=jnp.ones(D)), mesh, pipe, jnp.ones((3, T, D)))
    with pytest.raises(es.LayerConfigError, match=r"execute_schedule: the stage returned float32\[2, 4, 8\]"):
        _trace(
            lambda x: execute_schedule(lambda p, h: h[..., :8], jnp.ones((1, 2)), x, x[..., 0], last=_head,
                                       last_params=jnp.ones(D), schedule=pipeline_schedule("1f1b", 2, 2),
                                       model_axis_name="pp"),
            mesh, x,
        )  # fmt: skip
    wrong = PipelineModule(TanhBlock, "pp", 2, num_layers=4, num_stages=4, schedule="1f1b", key=jax.random.key(0))
    with pytest.raises(es.LayerConfigError, match="num_stages=4.*size 2"):
        _trace(lambda p, x: p.loss(x, x[..., 0], last=_head, last_params=jnp.ones(D)), mesh, wrong, x)


def test_schedule_weights_match_runtime_counts():
    """The reader counts a branch's collectives as often as the schedule runs the branch:
    checked against how often the stage and the loss actually run, device by device."""
    mesh = es.make_mesh("pp=2,tp=2")
    sched = pipeline_schedule("1f1b", 2, 4)
    ran = {}

    def record(kind, stage, tp):
        if int(tp) == 0:
            ran[kind, int(stage)] = ran.get((kind, int(stage)), 0) + 1

    def stage_fn(p, h):
        jax.debug.callback(record, "F", jax.lax.axis_index("pp"), jax.lax.axis_index("tp"))
        part = jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index("tp") * (D // 2), D // 2, axis=1)
        return h + jnp.tanh(jax.lax.psum(part @ p, "tp"))  # f32[b, D/tp] @ f32[D/tp, D]: partial sums

    def last(w, y, t):
        jax.debug.callback(record, "loss", jax.lax.axis_index("pp"), jax.lax.axis_index("tp"))
        return jnp.mean((y @ w - t) ** 2)

    def inner(p, w, x, t):
        f = lambda p, w: execute_schedule(stage_fn, p, x, t, last=last, last_params=w, schedule=sched, model_axis_name="pp")  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1))(p, w)

    p = jax.random.normal(jax.random.key(0), (2, D, D)) / D**0.5
    x, t, w = jnp.ones((8, D)), jnp.ones((8,)), jnp.ones((D,))
    fn = jax.jit(es.filter_shard_map(inner, mesh=mesh, in_specs=(P("pp", "tp", None), P(), P(), P()),
                                     out_specs=(P(), (P("pp", "tp", None), P()))))  # fmt: skip
    compiled = fn.lower(p, w, x, t).compile()
    jax.block_until_ready(compiled(p, w, x, t))
    k = sched.num_steps
    for device in range(2):
        weights = schedule_weights(sched, device)
        assert ran["F", device] == round(weights["pipeline_forward"] * k) == 4
        assert ran.get(("loss", device), 0) == round(weights["pipeline_last"] * k) == 4 * device
    # The stage's all-reduce over tp, inside the forward branch: K times unweighted, the
    # schedule's forwards (M) weighted; the transfers run on the steps that send.
    weighted = read_collectives(compiled, weights=schedule_weights(sched))
    plain = read_collectives(compiled)
    fwd = [op for op in weighted if op.kind == "all-reduce" and op.operand_shapes == (("f32", (2, D)),)]
    assert fwd and {op.count for op in fwd} <= {4}, [str(op) for op in weighted]
    assert max(op.count for op in plain if op.kind == "all-reduce" and op.operand_shapes == (("f32", (2, D)),)) == k
    permutes = [op for op in weighted if op.kind == "collective-permute"]
    assert sorted(op.count for op in permutes) == [4, 4]  # M activations forward, M cotangents back
