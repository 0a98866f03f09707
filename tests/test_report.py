"""`equishard.report`: analytical minima against hand-computed numbers and the HLO reader,
replica groups mapped to mesh axes, the report of a compiled step, `inspect` and `plan`."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard._cli import main
from equishard._cli_report import parse_bytes
from equishard.models import GPT, PRESETS, abstract_train_step, gpt_minimum, gpt_report
from equishard.nn import FSDP, TransformerBlock
from equishard.report import (
    axes_of_groups,
    axes_of_pairs,
    collective_bytes,
    data_parallel_minimum,
    expert_parallel_minimum,
    fsdp_minimum,
    parse_replica_groups,
    pipeline_minimum,
    read_collectives,
    report,
    tensor_parallel_minimum,
)
from equishard.report._axes import collective_axes
from equishard.sharding import Layout

F32 = 4
TINY = PRESETS["tiny"]  # vocabulary 256, d_model 64, 4 heads, 2 layers, d_ff 128


# ------------------------------------------------- textbook minima, hand-computed


def test_textbook_formulas_by_hand():
    assert data_parallel_minimum(800, 8) == 2 * 7 / 8 * 800
    assert fsdp_minimum(800, 80, 8) == 3 * 7 / 8 * 800 + 2 * 7 / 8 * 80
    assert fsdp_minimum(800, 0, 8, regather=False) == 2 * 7 / 8 * 800
    assert tensor_parallel_minimum(1000, 2, 3) == 3 * 4 * 2 * 1 / 2 * 1000
    assert expert_parallel_minimum(1000, 4, 2) == 2 * 4 * 3 / 4 * 1000
    assert pipeline_minimum(1000, num_microbatches=4) == 2 * 1000
    assert data_parallel_minimum(800, 1) == 0


class _MLP(eqx.Module):
    w1: jax.Array  # f32[64, 256], split over fsdp
    w2: jax.Array  # f32[256, 64], split over fsdp

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (64, 256)) / 8
        self.w2 = jax.random.normal(k2, (256, 64)) / 16

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w1) @ self.w2


def test_fsdp8_mlp_bytes_equal_the_hand_computed_minimum():
    """FSDP-8 of 65,536 split parameters and 512 replicated ones, one gradient step."""
    mesh = es.make_mesh("fsdp=8")

    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        layers = [FSDP(_MLP(key=k), "fsdp", min_weight_size=64 * 256) for k in (k1, k2)]
        return layers, jax.random.normal(k3, (64, 8))  # the head stays replicated

    model = es.sharded_init(make, jax.random.key(0), mesh=mesh)

    @eqx.filter_jit
    @es.filter_shard_map(mesh=mesh, in_specs=(None, P("fsdp")), out_specs=None)
    def grads(model, x):
        def loss(model):
            layers, head = model
            h = x
            for layer in layers:
                h = layer(h)
            return jax.lax.pmean(jnp.mean((h @ head) ** 2), "fsdp")

        return eqx.filter_grad(loss)(model)

    x = jax.random.normal(jax.random.key(1), (32, 64))
    measured = collective_bytes(read_collectives(grads.lower(model, x).compile()))
    sharded = 2 * (64 * 256 + 256 * 64) * F32  # 262,144 B, gathered whole
    replicated = 64 * 8 * F32  # 2,048 B
    # 3 (n-1)/n P_sharded + 2 (n-1)/n P_replicated = 688,128 + 3,584
    assert fsdp_minimum(sharded, replicated, 8) == 691_712
    assert measured == 691_712


def test_tp2_one_block_bytes_equal_the_hand_computed_minimum():
    """Megatron TP-2 of one transformer block: 4 all-reduces of A = [4 x 16, 64] f32."""
    mesh = es.make_mesh("tp=2")
    block = es.sharded_init(lambda k: TransformerBlock(64, 4, 128, key=k), jax.random.key(0), mesh=mesh)

    @eqx.filter_jit
    @es.filter_shard_map(mesh=mesh, in_specs=(None, P()), out_specs=None)
    def grads(block, x):
        return eqx.filter_grad(lambda b: jnp.sum(b(x) ** 2))(block)

    x = jax.random.normal(jax.random.key(1), (4, 16, 64))
    ops = read_collectives(grads.lower(block, x).compile())
    activation = 4 * 16 * 64 * F32  # 16,384 B
    assert tensor_parallel_minimum(activation, 2, 1) == 65_536  # 4 x 2 (1/2) x A
    assert [op.kind for op in ops] == ["all-reduce"] * 4
    assert collective_bytes(ops) == 65_536


def test_rms_norm_weight_gradient_is_reduced_unbroadcast():
    """Data parallel: the replicated norm weight's gradient is all-reduced as f32[dim]."""
    from equishard.nn import RMSNorm

    mesh = es.make_mesh("dp=8")
    norm = es.sharded_init(lambda: RMSNorm(64), mesh=mesh)

    @eqx.filter_jit
    @es.filter_shard_map(mesh=mesh, in_specs=(None, P("dp")), out_specs=None)
    def grads(norm, x):
        return eqx.filter_grad(lambda n: jax.lax.psum(jnp.sum(n(x) ** 2), "dp"))(norm)

    x = jax.random.normal(jax.random.key(1), (16, 32, 64))
    (op,) = read_collectives(grads.lower(norm, x).compile())
    assert op.kind == "all-reduce" and op.operand_shapes == (("f32", (64,)),)


def test_gpt_minimum_data_parallel_by_hand():
    # tiny: embedding and head 256 x 64 each, per layer qkv 3x64x64, proj 64x64,
    # up 2x128x64, down 128x64, two norms of 64; a final norm of 64.
    per_layer = 3 * 64 * 64 + 64 * 64 + 2 * 128 * 64 + 128 * 64 + 2 * 64
    params = 2 * 256 * 64 + 2 * per_layer + 64
    assert params == 115_008
    minimum = gpt_minimum(TINY, Layout("dp=8"), batch_size=8, seq_len=32)
    loss_pmean = 2 * 7 / 8 * F32
    # The non-finite guard over the update sends nothing: no parameter is split.
    assert minimum.total == pytest.approx(data_parallel_minimum(params * F32, 8) + loss_pmean)


# --------------------------------------------------- the reference GPT, measured


CASES = [  # the pipeline is measured by `inspect` below
    ("dp=2,fsdp=2,tp=2", {}, dataclasses.replace(TINY, tied=True)),
    ("dp=2,ep=4", {}, dataclasses.replace(TINY, moe_every=2, moe_group_size=16)),
]


@pytest.mark.parametrize("spec, options, config", CASES, ids=[c[0] for c in CASES])
def test_gpt_bytes_equal_the_minimum_of_equishards_algorithm(spec, options, config):
    r, facts = gpt_report(abstract_train_step(
        config, Layout(spec, **options), batch_size=8, seq_len=32, optimizer=optax.adamw(1e-3),
        clip_norm=1.0,
    ))
    assert r.ratio == pytest.approx(1.0, rel=1e-6), str(r)
    # Without a pipeline that is the textbook figure: FSDP's re-gather does not send
    # the tensor-parallel all-reduces again.
    assert r.minimum is not None and r.minimum.total == r.minimum.ideal_total
    # Every collective is named by its mesh axes; each term's axes appear measured.
    assert all(c.axes is not None for c in r.collectives)
    measured = r.bytes_by_axes()
    for axes, value in r.minimum.by_axes().items():
        assert measured.get(axes, 0.0) == pytest.approx(value, rel=1e-6), axes
    # The arguments are the state (by its specs) and the batch shard, and counters.
    assert r.memory is not None
    assert r.memory.argument_bytes == pytest.approx(facts["state_bytes"], rel=0.05)
    assert {row.path for row in r.params} >= {"embed.weight", "norm.weight"}


def test_pipeline_minimum_names_the_bubble():
    layout = Layout("pp=2,dp=4", num_microbatches=4)
    m = gpt_minimum(TINY, layout, batch_size=8, seq_len=32)
    (sends,) = [t for t in m.terms if t.kind == "collective-permute"]
    activation = 8 // 4 * 32 * 64 * F32  # [B/dp, S, D]
    # T = M + S - 1 = 5 steps, all but the last sending A/M forward and backward:
    # with two stages exactly the textbook M.
    assert sends.bytes == 2 * 4 * activation / 4
    assert sends.ideal_bytes == pipeline_minimum(activation, 4) == 2 * activation
    deep = dataclasses.replace(TINY, n_layers=4)
    m = gpt_minimum(deep, Layout("pp=4,dp=2", num_microbatches=4), batch_size=8, seq_len=32)
    (sends,) = [t for t in m.terms if t.kind == "collective-permute"]
    activation = 8 // 2 * 32 * 64 * F32
    # Four stages: T - 1 = 6 sends where the textbook has M = 4.
    assert sends.bytes == 2 * 6 * activation / 4 and sends.ideal_bytes == 2 * activation


# --------------------------------------------------------------- replica groups


MESH = {"a": 4, "b": 2}


@pytest.mark.parametrize(
    "attrs, axes",
    [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("b",)),
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("a",)),
        ("replica_groups={{0,1,2,3,4,5,6,7}}", ("a", "b")),
        ("replica_groups=[4,2]<=[8]", ("b",)),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ("a",)),
        ("replica_groups=mesh['a'=4,'b'=2] {'a'}", ("a",)),
        # GSPMD names its own axes: matched by the groups they make.
        ("replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", ("a", "b")),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", ("a",)),
        # ... over devices in another order: 0,2,4,6,1,3,5,7.
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", ("a",)),
        # A sub-axis: the major 2 of an axis of 8 is the major half of 'a'.
        ("replica_groups=mesh['x'=8] {'x':(1)2}", None),
        ("replica_groups={}, channel_id=1", ("a", "b")),
    ],
)
def test_replica_groups_to_mesh_axes(attrs, axes):
    text = (
        "HloModule m, num_partitions=8\n\n"
        f"ENTRY %main {{\n  %p = f32[8] parameter(0)\n  %r = f32[8] all-reduce(%p), {attrs}\n}}"
    )
    (op,) = read_collectives(text)  # the reader parses the groups once, in every form
    assert collective_axes(op, MESH) == axes
    assert op.group_size == (2 if axes is None else math.prod(MESH[a] for a in axes))


def test_sub_axis_groups_and_pairs():
    groups = parse_replica_groups("replica_groups=mesh['x'=8] {'x':(1)2}", 8)
    assert groups is not None and groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert axes_of_groups(groups, {"a": 2, "b": 4}) == ("a",)
    assert axes_of_pairs([(0, 1), (1, 0), (2, 3), (3, 2)], MESH) == ("b",)
    assert axes_of_pairs([(0, 2), (2, 4), (4, 6), (6, 0)], MESH) == ("a",)


def test_report_of_a_compiled_program_names_axes():
    mesh = es.make_mesh("a=4,b=2")

    def f(x):  # f32[64/8, 16] -> f32[64/2, 16] -> summed over b -> shifted along a
        y = jax.lax.all_gather(x, "a", tiled=True)
        z = jax.lax.psum(y, "b")
        return jax.lax.ppermute(z, "a", [(i, (i + 1) % 4) for i in range(4)])

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P("a")))
    r = report(fn.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32)), mesh=mesh)
    assert sorted((c.kind, c.axes, c.dtype) for c in r.collectives) == [
        ("all-gather", ("a",), "f32"),
        ("all-reduce", ("b",), "f32"),
        ("collective-permute", ("a",), "f32"),
    ]
    assert r.memory is not None and r.memory.argument_bytes == 64 * 16 * F32 // 8
    text = str(r)
    assert "Collectives per step" in text and "Memory per device" in text


# -------------------------------------------------------------- command line


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("24G") == 24 * 2**30
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert parse_bytes("4096") == 4096
    with pytest.raises(es.LayerConfigError, match="not a size"):
        parse_bytes("lots")


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if anything gets as far as building the train step."""

    def refuse(*args, **kwargs):
        raise AssertionError("the train step was built before the bad input was caught")

    monkeypatch.setattr("equishard.models._training.make_train_step", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-5", "--layout", "dp=8"], "unknown model preset 'gpt-5'; choose one of"),
        (["--model", "tiny", "--layout", "dp=4"], "uses 4 devices but 8 were asked for"),
        (["--model", "tiny", "--layout", "dp=16"], "needs 16 devices but only 8"),
        (["--model", "tiny", "--layout", "tp=8"], "n_heads=4 is not divisible by the tensor-parallel axis"),
        (["--model", "tiny", "--layout", "dp=8", "--batch-size", "12"], "does not split over the 8 ways"),
    ],
)
def test_plan_rejects_bad_input_before_compiling(argv, message, no_compile, capsys):
    assert main(["plan", *argv, "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("equishard plan: error:")


def test_inspect_prints_the_report_of_a_pipeline(capsys):
    argv = ["--model", "tiny", "--layout", "pp=2,dp=2,tp=2", "--microbatches", "4", "--batch-size", "8", "--seq-len", "32"]
    assert main(["inspect", *argv, "--no-params"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"collective-permute\s+pp\s", out)
    assert "Analytical minimum" in out and "Memory per device" in out and "Parameters:" not in out
    # T = M + S - 1 = 5 pipeline steps where a bubble-free pipeline runs 4: over the
    # textbook figure, exactly equishard's minimum.
    found = re.search(r"= ([\d.]+) \(over the bubble-free textbook figure: ([\d.]+)\)", out)
    assert found is not None
    ratio, ideal = found.groups()
    assert float(ratio) == 1.0 and float(ideal) > 1.0


def test_plan_llama_70b_on_2048_devices():
    """A 70B model on 2048 devices, in a fresh process: state bytes as analysed."""
    out = subprocess.run(
        [sys.executable, "-m", "equishard", "plan", "--model", "llama3-70b", "--layout", "fsdp=256,tp=8", "--devices", "2048"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())  # lines wrapped at 120 columns, joined
    found = re.search(r"expected with the batch and counters \(ratio ([\d.]+)\)", text)
    assert found is not None, out.stdout[-3000:]
    ratio = float(found.group(1))
    assert abs(ratio - 1) < 0.05
    assert re.search(r"collectives: .* \(ratio 1\.000\)", text)
    assert out.stdout.startswith("verdict: fits") and "fits (an estimate" in text and "Parameters:" in text


@pytest.mark.parametrize("name, billions", [("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_llama_presets_have_the_published_parameter_counts(name, billions):
    """Grouped-query attention (8 key/value heads), vocabulary 128,256, the FFN widths."""
    model = eqx.filter_eval_shape(lambda: GPT(PRESETS[name], key=jax.random.key(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(model))
    assert abs(count / 1e9 - billions) < 0.005, (name, count)


def test_plan_llama3_405b_reports_its_parameters(capsys):
    assert main(["plan", "--model", "llama3-405b", "--layout", "fsdp=8", "--devices", "8", "--seq-len", "128"]) == 0
    found = re.search(r"llama3-405b: [\d,.]+ M parameters \(([\d.]+) B\)", capsys.readouterr().out)
    assert found is not None and 405.8 <= float(found.group(1)) <= 405.9


def test_every_command_knows_the_same_presets():
    import argparse

    from equishard._cli_report import _model_names

    parser = argparse.ArgumentParser()
    from equishard._cli import _add_train

    _add_train(parser.add_subparsers())
    train = next(a for a in parser._subparsers._group_actions[0].choices["train"]._actions if a.dest == "model")  # pyright: ignore
    assert sorted(train.choices) == sorted(_model_names()) == sorted(PRESETS)
    assert {"llama3-8b", "llama3-70b", "llama3-405b"} <= set(PRESETS) and not any(n.startswith("llama-") for n in PRESETS)


@pytest.mark.parametrize(
    "layout, term",
    [
        (Layout("dp=2,cp=4"), "cp: ring attention"),
        (Layout("fsdp=2,cp=2,tp=2", sequence_parallel=True, cp_impl="alltoall"), "cp: all-to-all attention"),
        (Layout("pp=2,cp=2,dp=2"), "cp: ring attention"),
        (Layout("pp=2,cp=4"), "cp: ring attention"),
    ],
)
def test_context_parallel_step_sends_its_analytical_minimum(layout, term):
    """Ring (collective-permutes of key/value blocks and their gradients) and all-to-all
    terms, forward and backward, on the cp axis: the compiled step sends the minimum."""
    config = dataclasses.replace(TINY, n_kv_heads=2)
    r, _ = gpt_report(abstract_train_step(config, layout, batch_size=8, seq_len=64, optimizer=optax.adamw(1e-3)))
    assert r.minimum is not None
    terms = [t for t in r.minimum.terms if t.name.startswith(term)]
    assert len(terms) == 1 and terms[0].axes == ("cp",) and terms[0].bytes > 0
    # The attention's own collectives on cp (gradient all-reduces over it are other terms).
    measured = sum(c.total_bytes for c in r.collectives if c.axes == ("cp",) and c.kind != "all-reduce")
    assert abs(measured / terms[0].bytes - 1) < 1e-3, (measured, terms[0].bytes)
    assert r.ratio is not None and 0.999 <= r.ratio <= 1.05, r.ratio
    assert term in str(r)


def test_inspect_reads_an_explicit_schedule_with_its_weights(capsys):
    """1F1B's conditional branches counted as its table runs them: none of the bubble's
    re-runs, the head on the last stage's device and the embedding on the first's, as
    the analytical minimum counts them: the ratio is 1."""
    argv = ["--model", "tiny", "--layout", "pp=2,dp=2,tp=2", "--microbatches", "4", "--batch-size", "8", "--seq-len", "32"]
    assert main(["inspect", *argv, "--no-params", "--pipeline-schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "1f1b schedule, collectives of the last" in out
    found = re.search(r"collectives ([\d.]+) KiB per device per step, ([\d.]+) x the analytical", out)
    assert found is not None, out
    assert float(found.group(2)) == 1.0, out


@pytest.mark.parametrize(
    "spec, schedule", [("pp=2,dp=2,tp=2", "zb-h1"), ("pp=2,dp=2,tp=2", "interleaved-1f1b"), ("pp=2,fsdp=2,tp=2", "1f1b")]
)
def test_explicit_schedule_step_sends_its_analytical_minimum(spec, schedule):
    """Every explicit schedule, and FSDP beside one (its units gathered once per step,
    reduce-scattered once): the last stage's device sends the minimum, term by term."""
    layout = Layout(spec, num_microbatches=4, pipeline_schedule=schedule)
    r, _ = gpt_report(abstract_train_step(TINY, layout, batch_size=8, seq_len=32, optimizer=optax.adamw(1e-3)))
    assert r.minimum is not None and r.ratio is not None
    assert abs(r.ratio - 1) < 1e-3, (r.ratio, str(r))
    if "fsdp" in spec:
        # One gather and one reduce-scatter per split array: none per micro-batch.
        assert {c.count for c in r.collectives if c.kind in ("all-gather", "reduce-scatter")} == {1}
