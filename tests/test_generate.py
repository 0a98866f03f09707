"""Generation with a key/value cache (`equishard.models.Generator`) against recomputation.

One model (mesh-invariant init: the same parameters on every layout), one reference
(greedy decoding by full forward passes on one device), one generator per layout,
shared by the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equishard as es
from equishard._app import TrainConfig, run as train
from equishard._app._generate import evaluate_run, generate_from_run
from equishard.models import GPT, Generator, GPTConfig, Sampling, sample_token
from equishard.models._internal import to_single_device

from .helpers import FP32_RTOL, rel_err

# Grouped-query attention with 2 key/value heads: replicated over tp=4 and tp=8, split
# over tp=2.
CONFIG = GPTConfig(vocab_size=256, d_model=128, n_heads=8, n_kv_heads=2, n_layers=2, d_ff=256)
MAX_LEN = 96
NEW = 64  # the longest prompt (30) is prefilled as 32 tokens: 96 - 32 = 64 slots left
PROMPTS = [[5, 17, 3], list(range(40, 70)), [9] * 11, [200]]
LAYOUTS = ["dp=2,tp=4", "fsdp=4,tp=2", "tp=8"]
SAMPLING = Sampling(temperature=0.9, top_k=40, top_p=0.9)


@functools.cache
def _model(spec: str) -> tuple[GPT, jax.sharding.Mesh]:
    layout = es.Layout(spec).resolve(8)
    mesh = layout.mesh()
    model = es.sharded_init(lambda k: GPT(CONFIG, layout, key=k), jax.random.key(1), mesh=mesh)
    return model, mesh


@functools.cache
def _generator(spec: str, sampling: Sampling = Sampling(), gather: str = "once") -> Generator:
    model, mesh = _model(spec)
    return Generator(model, mesh, max_len=MAX_LEN, sampling=sampling, gather=gather)


@functools.cache
def _reference() -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy decoding by a full forward pass per token (no cache) on one device, and
    the full forward pass's logits at every generated position."""
    single = to_single_device(es.gather(_model(LAYOUTS[0])[0]))
    forward = eqx.filter_jit(lambda m, ids: m(ids))
    seqs = [list(p) for p in PROMPTS]
    for _ in range(NEW):
        ids = np.zeros((len(seqs), MAX_LEN), np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        logits = np.asarray(forward(single, jnp.asarray(ids)))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    padded = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    logits = np.asarray(forward(single, jnp.asarray(padded)))
    tokens = [s[len(p) :] for s, p in zip(seqs, PROMPTS)]
    steps = [logits[i, len(p) - 1 : len(p) - 1 + NEW] for i, p in enumerate(PROMPTS)]
    return tokens, steps


@pytest.mark.parametrize("spec", LAYOUTS)
def test_greedy_matches_recomputation(spec):
    tokens, logits = _reference()
    generator = _generator(spec)
    out = generator.generate(PROMPTS, max_new_tokens=NEW, record_logits=True)
    assert out.tokens == tokens
    assert out.logits is not None
    for row, (got, want) in enumerate(zip(out.logits, logits)):
        assert got.shape == (NEW, CONFIG.vocab_size)
        assert rel_err(got, want) <= FP32_RTOL, (spec, row, rel_err(got, want))
    assert out.decode_steps == NEW - 1
    # One decode step compiled for 63 tokens of prompts of four lengths.
    assert generator.compilations()["decode"] == 1


def test_rows_alone_as_in_a_batch_and_compiled_once():
    """Each prompt alone gets the tokens it gets in the batch; the decode step compiles
    once for the batch size (prompts of lengths 1 to 30, two prefill lengths)."""
    tokens, _ = _reference()
    model, mesh = _model("tp=8")
    generator = Generator(model, mesh, max_len=MAX_LEN)
    for prompt, want in zip(PROMPTS, tokens):
        assert generator.generate([prompt], max_new_tokens=NEW).tokens == [want]
    assert generator.compilations() == {"prefill": 2, "decode": 1}  # prefilled as 16 and 32 tokens


def test_fsdp_gathered_per_layer_equals_once():
    once = _generator("fsdp=4,tp=2").generate(PROMPTS, max_new_tokens=8)
    per_layer = _generator("fsdp=4,tp=2", gather="per_layer").generate(PROMPTS, max_new_tokens=8)
    assert once.tokens == per_layer.tokens


def _local_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _decode_bytes(generator: Generator, config: GPTConfig) -> tuple[float, int]:
    """The compiled decode step's bytes accessed (cost analysis) and this device's
    weights plus its cache (batch 4)."""
    batch = 4
    slots, head_dim = generator._cache_heads()
    tp = generator.mesh.shape.get("tp", 1)
    cache = 2 * config.n_layers * (batch // generator.data_size) * (slots // tp) * MAX_LEN * head_dim * 4
    cost = generator.compiled_decode(batch).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"], _local_bytes(generator.arrays) + cache


@pytest.mark.parametrize("spec", ["dp=2,tp=4", "fsdp=4,tp=2"])
def test_decode_bytes_near_minimum(spec):
    """The compiled decode step reads each weight and the cache about once: its bytes
    accessed within 1.5x of this device's weights plus its cache."""
    accessed, minimum = _decode_bytes(_generator(spec), CONFIG)
    assert minimum <= accessed <= 1.5 * minimum, (accessed, minimum)


WIDE = dataclasses.replace(CONFIG, d_model=512, d_ff=1024)
"""A model whose weights outweigh a step's activations on tp=8 too (measured: at d_model
128 the activations, about 100 KB a layer in the compiled step, are half the tp=8
device's weights; at 512 the bytes are 1.19x the minimum, at 1024 1.07x)."""


@pytest.mark.parametrize("spec", ["dp=2,tp=4", "fsdp=4,tp=2", "tp=8"])
def test_decode_bytes_near_minimum_where_the_weights_dominate(spec):
    """As above on every layout, tp=8 (key/value heads replicated) included, for a model
    whose weights, not its activations, set the step's bytes."""
    layout = es.Layout(spec).resolve(8)
    mesh = layout.mesh()
    model = es.sharded_init(lambda k: GPT(WIDE, layout, key=k), jax.random.key(1), mesh=mesh)
    accessed, minimum = _decode_bytes(Generator(model, mesh, max_len=MAX_LEN), WIDE)
    # (On fsdp=4,tp=2 the compiled step reads 0.04 % less than the sum: it need not read
    # every byte of every array, e.g. not the whole embedding table for a lookup.)
    assert 0.99 * minimum <= accessed <= 1.5 * minimum, (accessed, minimum)


def test_seeded_sampling_independent_of_layout_and_batch():
    key = jax.random.key(7)
    keys = [jax.random.fold_in(key, i) for i in range(len(PROMPTS))]
    dp = _generator("dp=8", SAMPLING).generate(PROMPTS * 2, max_new_tokens=16, keys=keys * 2)
    mixed = _generator("fsdp=4,tp=2", SAMPLING).generate(PROMPTS, max_new_tokens=16, keys=keys)
    assert dp.tokens == mixed.tokens * 2
    alone = _generator("fsdp=4,tp=2", SAMPLING).generate([PROMPTS[1]], max_new_tokens=16, keys=[keys[1]])
    assert alone.tokens == [mixed.tokens[1]]
    # Sampled, not greedy: some row differs from the greedy tokens.
    assert mixed.tokens != [t[:16] for t in _reference()[0]]


def test_stop_tokens_and_max_new_tokens():
    tokens, _ = _reference()
    stop = tokens[0][5]
    out = _generator("dp=2,tp=4").generate(PROMPTS, max_new_tokens=10, stop_tokens=[stop])
    first = tokens[0].index(stop)
    assert out.tokens[0] == tokens[0][: first + 1] and out.stopped[0]
    for row in range(1, len(PROMPTS)):
        want = tokens[row][:10]
        if stop in want:
            want = want[: want.index(stop) + 1]
        assert out.tokens[row] == want


def test_sample_token_filters():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    draws = jax.vmap(lambda k: sample_token(logits, k, Sampling(1.0, top_p=0.7), 4))(
        jax.random.split(jax.random.key(0), 200)
    )
    assert set(np.asarray(draws).tolist()) == {0, 1}
    draws = jax.vmap(lambda k: sample_token(logits, k, Sampling(1.0, top_k=3), 2))(
        jax.random.split(jax.random.key(0), 200)
    )
    assert set(np.asarray(draws).tolist()) == {0, 1}  # ids from the vocabulary limit on: never


@pytest.mark.parametrize(
    "kwargs, prompts, match",
    [
        ({}, [list(range(MAX_LEN))], "longer than max_len"),
        ({}, [[1, 2], []], "prompt 1 is empty"),
        ({}, [[1, 300]], "outside"),
        ({"sampling": Sampling(1.0, top_p=0.0)}, [[1]], "top_p"),
        ({"sampling": Sampling(1.0, top_p=1.5)}, [[1]], "top_p"),
        ({"sampling": Sampling(-1.0)}, [[1]], "temperature"),
        ({"vocab_size": 512}, [[1]], "vocabulary of 512"),
        ({"gather": "never"}, [[1]], "gather"),
    ],
)
def test_bad_inputs_named(kwargs, prompts, match):
    model, mesh = _model("dp=2,tp=4")
    with pytest.raises(es.GenerationError, match=match):
        Generator(model, mesh, max_len=MAX_LEN, **kwargs).generate(prompts, max_new_tokens=4)


def test_pipeline_refused_by_name():
    layout = es.Layout("pp=2,tp=4").resolve(8)
    model = eqx.filter_eval_shape(lambda: GPT(CONFIG, layout, key=jax.random.key(0)))
    with pytest.raises(es.GenerationError, match="pipeline"):
        Generator(model, layout.mesh(), max_len=MAX_LEN)


TINY_RUN = TrainConfig(
    model="tiny", layout="dp=2,fsdp=2,tp=2", steps=2, batch_size=8, seq_len=32, eval_every=2,
    eval_batches=3, checkpoint_every=2, log_every=2, sample_bytes=8, progress=False, plot=False,
    tensorboard=False, seed=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    summary = train(dataclasses.replace(TINY_RUN, run_dir=str(run_dir)), print_fn=lambda line: None)
    assert summary["sample"]  # 8 bytes by the cached path (`sample_text`)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in rows if "val_loss" in r][-1]


def test_evaluate_run_reproduces_its_validation_row(finished_run):
    run_dir, row = finished_run
    result = evaluate_run(run_dir)
    assert result["step"] == row["step"] == TINY_RUN.steps
    assert abs(result["loss"] - row["val_loss"]) <= 1e-6
    assert result["perplexity"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-6)
    assert result["tokens"] == 3 * 8 * 32
    # Under another layout, the same windows: the same loss to the layouts' rounding.
    other = evaluate_run(run_dir, layout="tp=4,dp=2", batches=3, seed=TINY_RUN.seed)
    assert other["loss"] == pytest.approx(row["val_loss"], rel=FP32_RTOL)
    whole = evaluate_run(run_dir, whole_split=True)
    assert whole["batches"] >= 1 and math.isfinite(whole["loss"])


def test_generate_from_run(finished_run):
    run_dir, _ = finished_run
    out = generate_from_run(run_dir, ["def ", "import o"], max_new_tokens=12, layout="dp=2,tp=4")
    assert [len(t) for t in out["tokens"]] == [12, 12]
    assert all(0 <= t < 256 for row in out["tokens"] for t in row)
    with pytest.raises(es.GenerationError, match="single bytes"):
        generate_from_run(run_dir, ["x"], stop=["ab"])


def test_run_without_verified_checkpoint_named(finished_run, tmp_path):
    run_dir, _ = finished_run
    shutil.copy(run_dir / "config.toml", tmp_path / "config.toml")
    with pytest.raises(es.GenerationError, match="no verified checkpoint"):
        evaluate_run(tmp_path)
    with pytest.raises(es.GenerationError, match="config.toml"):
        evaluate_run(tmp_path / "nothing")
