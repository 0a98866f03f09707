"""The standard-library byte corpus and position-indexed batches."""

import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import equishard as es
from equishard._app import (
    ByteCorpus,
    _data as data,
    get_batch,
    load_stdlib_corpus,
    split_batch,
    stdlib_corpus,
    stdlib_files,
    unigram_entropy,
)
from equishard.train import mix64


def test_selection_is_the_documented_one():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()
    expected = sorted(
        (
            p
            for p in root.iterdir()
            if p.suffix == ".py"
            and p.is_file()
            and not p.name.startswith("_sysconfigdata")
            and p.name not in ("sitecustomize.py", "usercustomize.py")
        ),
        key=lambda p: p.name,
    )
    files = stdlib_files()
    assert list(files) == expected
    assert [p.name for p in files] == sorted(p.name for p in files)
    assert all(p.parent == root for p in files)
    names = {p.name for p in files}
    # Modules every CPython ships; nothing from site-packages or subpackages.
    assert {"os.py", "argparse.py", "typing.py", "functools.py"} <= names
    assert not any("site-packages" in str(p) for p in files)
    assert len(files) > 100


def test_corpus_is_the_concatenation_and_sizes_are_sane():
    files = stdlib_files()
    corpus = stdlib_corpus()
    assert corpus == b"".join(p.read_bytes() for p in files)
    assert stdlib_corpus() is corpus  # cached per process
    assert 3_000_000 < len(corpus) < 20_000_000
    split = load_stdlib_corpus()
    assert split.train.dtype == np.uint8 and split.val.dtype == np.uint8
    assert split.train.size + split.val.size == len(corpus)
    assert 0.01 < split.val.size / len(corpus) < 0.1
    assert split.vocab_size == 256
    assert not split.train.flags.writeable and not split.val.flags.writeable


def test_corpus_does_not_depend_on_the_working_directory(tmp_path):
    code = (
        "import hashlib; from equishard._app import stdlib_corpus, stdlib_files;"
        "print(len(stdlib_files()), hashlib.sha256(stdlib_corpus()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    import hashlib

    assert out == [str(len(stdlib_files())), hashlib.sha256(stdlib_corpus()).hexdigest()]


def test_validation_files_are_held_out_whole():
    files = stdlib_files()
    split = load_stdlib_corpus()
    val_files = [p for i, p in enumerate(files) if i % data.VAL_EVERY == data.VAL_EVERY - 1]
    train_files = [p for i, p in enumerate(files) if i % data.VAL_EVERY != data.VAL_EVERY - 1]
    assert split.val.tobytes() == b"".join(p.read_bytes() for p in val_files)
    assert split.train.tobytes() == b"".join(p.read_bytes() for p in train_files)
    assert not set(val_files) & set(train_files)
    # No validation file's text occurs in the training bytes.
    train = split.train.tobytes()
    for p in val_files:
        text = p.read_bytes()
        middle = text[len(text) // 2 : len(text) // 2 + 200]
        assert middle not in train, p.name


def test_from_documents_split():
    docs = [bytes([i]) * (i + 1) for i in range(10)]
    split = ByteCorpus.from_documents(docs, val_every=5)
    assert split.val.tobytes() == docs[4] + docs[9]
    assert split.train.tobytes() == b"".join(d for i, d in enumerate(docs) if i not in (4, 9))
    with pytest.raises(es.EquishardError, match="no validation document"):
        ByteCorpus.from_documents(docs[:3], val_every=5)


def test_unigram_entropy():
    split = load_stdlib_corpus()
    h = unigram_entropy(split.train)
    assert 2.5 < h < 4.0
    assert 2.5 < unigram_entropy(split.val) < 4.0
    assert unigram_entropy(np.zeros(100, np.uint8)) == 0.0
    uniform = np.arange(256, dtype=np.uint8).repeat(3)
    assert abs(unigram_entropy(uniform) - np.log(256)) < 1e-12


def test_batch_shape_dtype_and_windows():
    split = load_stdlib_corpus()
    batch = get_batch(split.train, 0, 16, 128, seed=0)
    assert batch.shape == (16, 129) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < 256
    starts = data.sample_offsets(np.arange(16), len(split.train) - 128, seed=0)
    for row, start in zip(batch, starts):  # row j is the window at sample j's offset
        np.testing.assert_array_equal(row, split.train[start : start + 129])
    inputs, targets = split_batch(batch)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert inputs.shape == targets.shape == (16, 128)


def test_batch_is_a_function_of_position_and_seed():
    split = load_stdlib_corpus()
    a = get_batch(split.train, 48, 16, 64, seed=7)
    np.testing.assert_array_equal(a, get_batch(split.train, 48, 16, 64, seed=7))
    assert not np.array_equal(a, get_batch(split.train, 48, 16, 64, seed=8))
    assert not np.array_equal(a, get_batch(split.train, 64, 16, 64, seed=7))
    # Each row depends on its global sample index only, not on how samples are batched.
    big = get_batch(split.train, 40, 32, 64, seed=7)
    np.testing.assert_array_equal(big[8:24], a)


def test_resume_equals_continuation():
    split = load_stdlib_corpus()
    batch_size, seq_len, seed = 8, 32, 3
    run = [get_batch(split.train, s * batch_size, batch_size, seq_len, seed=seed) for s in range(6)]
    position = 3 * batch_size  # the data position a checkpoint after 3 steps records
    resumed = [
        get_batch(split.train, position + s * batch_size, batch_size, seq_len, seed=seed)
        for s in range(3)
    ]
    for x, y in zip(run[3:], resumed):
        np.testing.assert_array_equal(x, y)


def _reference_offset(seed: int, g: int, n: int) -> int:
    """The documented formula in Python integers: mix(mix(seed) + (g + 1) * φ) mod n."""
    m = 2**64

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) % m
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) % m
        return x ^ (x >> 31)

    return mix((mix(seed) + (g + 1) * 0x9E3779B97F4A7C15) % m) % n


def test_offsets_follow_the_documented_formula():
    # Fixed uint64 arithmetic, not NumPy's generators: stable across versions.
    cases = [(0, np.arange(4), 1_000_003), (7, np.arange(10**6, 10**6 + 5), 4_000_000)]
    cases.append((2**64 - 1, np.array([10**12]), 2**40))
    for seed, indices, n in cases:
        got = data.sample_offsets(indices, n, seed=seed).tolist()
        assert got == [_reference_offset(seed, int(g), n) for g in indices]
    golden = [4995, 431482, 875807, 598123]
    assert data.sample_offsets(np.arange(4), 1_000_003, seed=0).tolist() == golden
    with np.errstate(over="ignore"):
        # The first two outputs of SplitMix64 seeded with 0 (published reference values).
        states = np.array([1, 2], np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        assert mix64(states).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    counts = np.bincount(data.sample_offsets(np.arange(100_000), 100, seed=1), minlength=100)
    assert counts.min() > 850 and counts.max() < 1150  # roughly uniform


def test_row_ranges_reassemble_the_global_batch():
    # What a process reads across processes (`global_array_from_rows`): rows
    # [start, stop) of the batch at `position` are the batch at `position + start`.
    split = load_stdlib_corpus()
    full = get_batch(split.train, 80, 16, 32, seed=5)
    for count in (1, 2, 4, 8):
        per = 16 // count
        parts = [get_batch(split.train, 80 + i * per, per, 32, seed=5) for i in range(count)]
        np.testing.assert_array_equal(np.concatenate(parts), full)


def test_bad_batch_arguments():
    tiny = np.arange(10, dtype=np.uint8)
    with pytest.raises(es.EquishardError, match="too few"):
        get_batch(tiny, 0, 2, 10, seed=0)
    assert get_batch(tiny, 0, 2, 9, seed=0).tolist() == [list(range(10))] * 2
    with pytest.raises(es.EquishardError, match="position"):
        get_batch(tiny, -1, 2, 4, seed=0)
    with pytest.raises(es.EquishardError, match="seed"):
        get_batch(tiny, 0, 2, 4, seed=-1)
