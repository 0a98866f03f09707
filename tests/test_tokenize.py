"""Tokenized corpora: `tokenize` into token files, `TokenFiles` and the data sources'
order, per-process reading and named errors."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import grain
import jax
import numpy as np
import optax
import pytest

import equishard as es
from equishard import EquishardError
from equishard._app._token_data import load_token_data
from equishard._app._tokenize import check_token_files, tokenize
from equishard.models import GPT, GPTConfig
from equishard.train import (
    IGNORE_LABEL,
    TokenFiles,
    _data as data_module,
    batch_at,
    example_indices,
    init_train_state,
    make_train_step,
)

SEQ = 16


def _corpus(root: pathlib.Path) -> pathlib.Path:
    """A folder of small inputs: text files, a gzipped jsonl and a prompt/completion jsonl."""
    src = root / "src"
    src.mkdir()
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps".split()
    rng = np.random.default_rng(0)
    for i in range(6):
        (src / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 40)))
    with gzip.open(src / "more.jsonl.gz", "wt") as f:
        for _ in range(30):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 25))}) + "\n")
    with open(src / "chat.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"prompt": "Q: fox? A:", "completion": " the fox jumps"}) + "\n")
    return src


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("tok")
    out = root / "data"
    tokenize([_corpus(root)], out, train_bpe_vocab=300, workers=2, progress=False)
    return out


def test_tokenize_writes_token_files_and_manifest(corpus):
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16"
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert train["documents"] + val["documents"] == 40 and val["documents"] == 2
    tokens = np.fromfile(corpus / train["shards"][0]["file"], np.uint16)
    eot = manifest["tokenizer"]["eot"]
    assert len(tokens) == train["tokens"] and (tokens == eot).sum() == train["documents"]
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256((corpus / "tokenizer.json").read_bytes()).hexdigest()
    files = TokenFiles(corpus, SEQ)
    assert len(files) == (train["tokens"] - 1) // SEQ
    # The prompt's tokens are not predicted: their labels are masked.
    mask = np.fromfile(corpus / train["shards"][0]["mask"], np.uint8)
    assert (mask == 0).sum() > 0
    batch = files.read(np.arange(len(files)))
    assert (batch["labels"] == IGNORE_LABEL).sum() >= train["documents"] - 1


def test_every_sequence_once_per_epoch_and_pure_in_position(corpus):
    files = TokenFiles(corpus, SEQ)
    n = len(files)
    idx = example_indices(n, np.arange(n), seed=3)
    assert sorted(idx.tolist()) == list(range(n))
    assert not np.array_equal(idx, example_indices(n, np.arange(n, 2 * n), seed=3))
    # A batch is a function of (seed, position): read in two halves or resumed, the same
    # tokens; under cp=2 the same tokens in zigzag order.
    whole = batch_at(files, 5, 4, seed=3)
    halves = [batch_at(files, 5, 2, seed=3), batch_at(files, 7, 2, seed=3)]
    assert np.array_equal(whole["inputs"], np.concatenate([h["inputs"] for h in halves]))
    zig = batch_at(TokenFiles(corpus, SEQ, cp=2), 5, 4, seed=3)
    digest = lambda b: hashlib.sha256(np.sort(b["inputs"], axis=1).tobytes()).hexdigest()  # noqa: E731
    assert digest(zig) == digest(whole)


def test_each_process_reads_only_its_rows(corpus, monkeypatch):
    files = TokenFiles(corpus, SEQ)
    reads: list[tuple[int, int, int]] = []
    real = files.read_range
    monkeypatch.setattr(files, "read_range", lambda s, a, b: reads.append((s, a, b)) or real(s, a, b))
    # As process 1 of 2, holding rows [2, 4) of a batch of 4.
    monkeypatch.setattr(data_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(data_module, "process_rows", lambda sharding, shape: [range(2, 4)])
    monkeypatch.setattr(data_module, "global_array_from_rows", lambda sharding, shape, read: read(2, 4))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for step in range(3):
        reads.clear()
        batch = batch_at(files, 4 * step, 4, seed=1, sharding=sharding)
        mine = example_indices(len(files), np.arange(4 * step + 2, 4 * step + 4), seed=1)
        # One read per row it holds, of that row's window, and nothing else.
        assert reads == [(0, int(i) * SEQ, int(i) * SEQ + SEQ + 1) for i in mine]
        assert np.array_equal(batch["inputs"], files.read(mine)["inputs"])


def test_numpy_and_grain_sources():
    windows = np.arange(10 * 5).reshape(10, 5)
    for source in (windows, grain.MapDataset.source(list(windows))):
        batch = batch_at(source, 10, 4, seed=0)
        assert batch.shape == (4, 5)
        rows = example_indices(10, np.arange(10, 14), seed=0)
        assert np.array_equal(batch, windows[rows])


def _write(path: pathlib.Path, text: str | bytes) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.txt", "", "no document"),
        ("bad.jsonl", '{"text": "a"}\nnot json\n', r"bad.jsonl:2: not JSON"),
        ("field.jsonl", '{"body": "a"}\n', r"field.jsonl:1: no string field 'text'"),
        ("latin.txt", b"caf\xe9", "not UTF-8"),
    ],
)
def test_bad_inputs_are_named_and_leave_nothing(tmp_path, name, content, match):
    src = _write(tmp_path / "in" / name, content)
    out = tmp_path / "out"
    with pytest.raises(EquishardError, match=match):
        tokenize([src], out, train_bpe_vocab=260, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_bad_tokenizer_and_data_sets(tmp_path, corpus):
    src = _write(tmp_path / "in" / "a.txt", "hello world")
    with pytest.raises(EquishardError, match="does not parse"):
        tokenize([src], tmp_path / "o", tokenizer=_write(tmp_path / "tokenizer.json", "{nope"), progress=False)
    with pytest.raises(EquishardError, match="no input files"):
        tokenize([_empty_dir(tmp_path)], tmp_path / "o", train_bpe_vocab=260)
    with pytest.raises(EquishardError, match="vocabulary of 300 has token ids >= the model's vocabulary of 256"):
        check_token_files(corpus, SEQ, 256)
    with pytest.raises(EquishardError, match="fewer than one batch"):
        batch_at(TokenFiles(corpus, SEQ, split="val"), 0, 10**6, seed=0)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(EquishardError, match="truncated"):
        TokenFiles(copy, SEQ)
    shard.unlink()
    with pytest.raises(EquishardError, match="is missing"):
        TokenFiles(copy, SEQ)
    (copy / "manifest.json").unlink()
    with pytest.raises(EquishardError, match="interrupted"):
        TokenFiles(copy, SEQ)


def _empty_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


@functools.cache
def _train_on_token_files(corpus: pathlib.Path, spec: str, steps: int = 3, **layout_kw):
    """Per step: the loss and a hash of the step's token ids (in sequence order)."""
    return _token_steps(corpus, spec, steps=steps, **layout_kw)[1]


def test_training_on_token_files_is_the_same_on_two_layouts(corpus):
    a = _train_on_token_files(corpus, "dp=2")
    b = _train_on_token_files(corpus, "dp=2,cp=2", cp_impl="alltoall")
    assert [d for _, d in a] == [d for _, d in b]
    for (la, _), (lb, _) in zip(a, b):
        assert abs(la - lb) <= 1e-4 * abs(la)


def test_token_data_for_the_train_command(corpus):
    data = load_token_data(corpus, SEQ)
    assert data.vocab_size == 320  # the tokenizer's 300, rounded up to a multiple of 64
    assert 0 < data.nats_per_byte(1.0) < 1.0  # a BPE token holds more than a byte
    val = data.batch("val", 0, 2, seed=0)
    assert val["inputs"].shape == (2, SEQ)
    assert data.identity()["tokenizer_sha256"] == json.loads((corpus / "manifest.json").read_text())["tokenizer"]["sha256"]
    with pytest.raises(EquishardError, match="checkpoint's vocabulary of 256 is smaller than the tokenizer's 300"):
        load_token_data(corpus, SEQ, init_vocab_size=256)


_TWO_PROCESSES = """
import sys, numpy as np, jax
from equishard import distributed
distributed.initialize()
from jax.experimental import multihost_utils
import equishard as es
from equishard.train import TokenFiles, batch_at, example_indices

layout = es.Layout("dp=8")
sharding = jax.sharding.NamedSharding(layout.mesh(), layout.resolve().batch_spec)
files = TokenFiles(sys.argv[1], 16)
reads = []
real = files.read_range
files.read_range = lambda s, a, b: reads.append((a, b)) or real(s, a, b)
i = jax.process_index()
for step in range(3):
    reads.clear()
    batch = batch_at(files, 8 * step, 8, seed=2, sharding=sharding)
    every = example_indices(len(files), np.arange(8 * step, 8 * step + 8), seed=2)
    mine = every[4 * i : 4 * i + 4]  # process i holds rows [4i, 4i + 4)
    assert reads == [(int(j) * 16, int(j) * 16 + 17) for j in mine], (reads, mine)
    whole = multihost_utils.process_allgather(batch["inputs"], tiled=True)
    np.testing.assert_array_equal(whole, files.read(every)["inputs"])
print("token rows ok")

# Three steps of the tiny GPT on the 2 x 4 devices: the same tokens and losses as one process.
import hashlib, optax
from equishard.models import GPT, GPTConfig
from equishard.train import init_train_state, make_train_step
config = GPTConfig(vocab_size=320, d_model=32, n_heads=4, n_layers=2, d_ff=64)
mesh, par = layout.mesh(), layout.resolve()
optimizer = optax.adamw(3e-3)
state = init_train_state(lambda k: GPT(config, par, key=k), optimizer, jax.random.key(0), mesh=mesh)
step = make_train_step(lambda m, b, k: m.loss(b, k), optimizer, mesh=mesh, batch_spec=layout.resolve().batch_spec)
files = TokenFiles(sys.argv[1], 16)
for s in range(3):
    batch = batch_at(files, 8 * s, 8, seed=0, sharding=sharding)
    ids = np.asarray(multihost_utils.process_allgather(batch["inputs"], tiled=True))
    state, metrics = step(state, batch)
    print(f"step {s} loss {float(metrics['loss']):.9f} tokens {hashlib.sha256(ids.tobytes()).hexdigest()}")
"""


def test_two_processes_read_only_their_rows_of_the_token_files(corpus, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQUISHARD_")}
    argv = [sys.executable, "-m", "equishard", "launch", "-n", "2", "--devices", "8", "--",
            sys.executable, "-c", _TWO_PROCESSES, str(corpus)]  # fmt: skip
    done = subprocess.run(argv, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "[0] token rows ok" in out and "[1] token rows ok" in out
    one = _train_on_token_files(corpus, "dp=2")
    for process in (0, 1):
        steps = re.findall(rf"^\[{process}\] step \d+ loss (\S+) tokens (\w+)$", out, re.M)
        assert [d for _, d in steps] == [d for _, d in one]
        assert all(abs(float(loss) - ref) <= 1e-4 * abs(ref) for (loss, _), (ref, _) in zip(steps, one))


def _token_steps(corpus: pathlib.Path, spec: str, state=None, steps: int = 2, **layout_kw):
    """`steps` steps from `state` (or a new one) on token files, each batch read at the
    state's data position: the final state and per step the loss and the tokens' hash."""
    layout = es.Layout(spec, **layout_kw)
    mesh, par = layout.mesh(), layout.resolve()
    config = GPTConfig(vocab_size=320, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    files = TokenFiles(corpus, SEQ, cp=par.size(par.context))
    optimizer = optax.adamw(3e-3)
    if state is None:
        state = init_train_state(lambda k: GPT(config, par, key=k), optimizer, jax.random.key(0), mesh=mesh)
    step = make_train_step(lambda m, b, k: m.loss(b, k), optimizer, mesh=mesh, batch_spec=layout.resolve().batch_spec)
    out = []
    for _ in range(steps):
        batch = batch_at(files, int(state.data_position), 8, seed=0)
        order = np.argsort(batch["positions"][0])  # sequence order, whatever the cp split
        out.append(hashlib.sha256(batch["inputs"][:, order].tobytes()).hexdigest())
        state, metrics = step(state, batch)
        out[-1] = (float(metrics["loss"]), out[-1])
    return state, out


def test_a_resume_continues_on_the_same_tokens(corpus, tmp_path):
    from equishard.train import Checkpointer

    state, first = _token_steps(corpus, "dp=2")
    with Checkpointer(tmp_path / "ckpt") as ckpt:  # waits for the save before the step donates it
        assert ckpt.save(2, state)
    _, straight = _token_steps(corpus, "dp=2", state)
    # The same layout: bit-identical losses; another layout (cp=2): the same tokens.
    like = _token_steps(corpus, "dp=2", steps=0)[0]  # a new state: the restore's template
    restored = Checkpointer(tmp_path / "ckpt").restore(like)
    assert _token_steps(corpus, "dp=2", restored)[1] == straight
    other = _token_steps(corpus, "dp=2,cp=2", steps=0, cp_impl="ring")[0]
    resumed = _token_steps(corpus, "dp=2,cp=2", Checkpointer(tmp_path / "ckpt").restore(other), cp_impl="ring")[1]
    assert [d for _, d in resumed] == [d for _, d in straight]
    assert all(abs(a - b) <= 1e-4 * abs(b) for (a, _), (b, _) in zip(resumed, straight))
    assert len(first) == 2
