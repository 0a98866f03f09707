"""`tokenize`: text files in, a tokenized corpus out (`equishard.train.TokenFiles` reads it).

Inputs are `.txt` files (one document each), `.jsonl` files (one document a line: a
named text field, or `prompt` and `completion` fields whose prompt tokens get a loss
mask of 0), either gzipped (`.gz`), or a directory of them (sorted, recursively). They
are read as a stream, a batch of documents at a time. Document `i` (in input order)
goes to the validation split iff `i % val_every == val_every - 1`. Each document is
encoded and ended by the tokenizer's end-of-text token. The output folder is written
under a temporary name with its manifest last, then renamed: an interrupted run leaves
no manifest and no folder under the requested name.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._errors import EquishardError
from ..train import TokenFiles

MANIFEST, FORMAT = TokenFiles.MANIFEST, TokenFiles.FORMAT

EOT_TOKEN = "<|endoftext|>"
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
_BATCH = 256


def input_files(inputs: Sequence[str | pathlib.Path]) -> list[pathlib.Path]:
    """The text files named by `inputs` (files, or directories searched recursively).

    **Raises:**

    `EquishardError` for a missing path or no input file at all.
    """
    files: list[pathlib.Path] = []
    for item in map(pathlib.Path, inputs):
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        elif item.is_file():
            files.append(item)
        else:
            raise EquishardError(f"tokenize: input {item} does not exist.")
    if not files:
        raise EquishardError(f"tokenize: no input files ({', '.join(SUFFIXES)}) in {list(map(str, inputs))}.")
    return files


def _lines(path: pathlib.Path) -> Iterator[tuple[int, bytes]]:
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        yield from enumerate(f, 1)


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise EquishardError(f"{where}: not UTF-8 text (byte {err.start}: {data[err.start:err.start + 4]!r}).") from None


def documents(files: Sequence[pathlib.Path], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """The documents of `files` as `(prompt, text)`: `prompt` is `""` but for
    `prompt`/`completion` records.

    **Raises:**

    `EquishardError` naming the file (and line) of non-UTF-8 text, a `.jsonl` line that
    is not a JSON object, or one without `text_field` (nor `prompt` and `completion`).
    """
    for path in files:
        if ".jsonl" not in path.name:
            opener: Any = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                text = _decode(f.read(), str(path))
            if text:  # an empty file is no document
                yield "", text
            continue
        for number, raw in _lines(path):
            where = f"{path}:{number}"
            line = _decode(raw, where).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise EquishardError(f"{where}: not JSON ({err.msg}).") from None
            if not isinstance(record, dict):
                raise EquishardError(f"{where}: not a JSON object.")
            if text_field in record and isinstance(record[text_field], str):
                yield "", record[text_field]
            elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
                yield record["prompt"], record["completion"]
            else:
                raise EquishardError(
                    f"{where}: no string field {text_field!r} (nor 'prompt' and 'completion')."
                )


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """A Hugging Face `tokenizers.Tokenizer` from a `tokenizer.json` (or a folder with one).

    **Raises:**

    `EquishardError` for a missing file or one that does not parse.
    """
    from tokenizers import Tokenizer

    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise EquishardError(f"tokenize: tokenizer file {path} does not exist.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise EquishardError(f"tokenize: {path} does not parse as a tokenizer.json: {err}.") from None


def train_bpe(files: Sequence[pathlib.Path], vocab_size: int, *, text_field: str = "text") -> Any:
    """A byte-level BPE tokenizer trained on the inputs, with `EOT_TOKEN` as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator((p + t for p, t in documents(files, text_field)), trainer=trainer)
    return tokenizer


def _special(tokenizer: Any) -> tuple[int, int | None]:
    """The end-of-text id (required) and the beginning-of-text id (or `None`)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eot = next((vocab[t] for t in (EOT_TOKEN, "</s>", "<|end_of_text|>", "<eos>") if t in vocab), None)
    if eot is None:
        raise EquishardError(f"tokenize: the tokenizer has no end-of-text token ({EOT_TOKEN!r} or '</s>').")
    bos = next((vocab[t] for t in ("<s>", "<|begin_of_text|>", "<bos>") if t in vocab), None)
    return eot, bos


class _Writer:
    """One split's shard files, appended to document by document."""

    def __init__(self, folder: pathlib.Path, split: str, dtype: np.dtype, with_mask: bool):
        self.split, self.dtype = split, dtype
        self.file = f"{split}-00000.bin"
        self.mask_file = f"{split}-00000.mask.bin" if with_mask else None
        self._f = open(folder / self.file, "wb")
        self._m = open(folder / self.mask_file, "wb") if self.mask_file else None
        self.tokens = self.documents = self.bytes = 0

    def add(self, ids: np.ndarray, prompt_len: int, nbytes: int) -> None:
        self._f.write(ids.astype(self.dtype).tobytes())
        if self._m is not None:
            mask = np.ones(len(ids), np.uint8)
            mask[:prompt_len] = 0
            self._m.write(mask.tobytes())
        self.tokens += len(ids)
        self.documents += 1
        self.bytes += nbytes

    def close(self) -> dict[str, Any]:
        self._f.close()
        if self._m is not None:
            self._m.close()
        shard = {"file": self.file, "tokens": self.tokens, "documents": self.documents, "mask": self.mask_file}
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes, "shards": [shard]}


def _encoded(
    tokenizer: Any, docs: Iterator[tuple[str, str]], workers: int
) -> Iterator[tuple[list[int], int, int]]:
    """`(ids, prompt_len, utf8_bytes)` per document, encoded in batches on `workers` threads."""

    def encode(batch: list[tuple[str, str]]) -> list[tuple[list[int], int, int]]:
        prompts = tokenizer.encode_batch([p for p, _ in batch], add_special_tokens=False)
        texts = tokenizer.encode_batch([t for _, t in batch], add_special_tokens=False)
        sizes = [len(p.encode()) + len(t.encode()) for p, t in batch]
        return [(p.ids + t.ids, len(p.ids), n) for p, t, n in zip(prompts, texts, sizes)]

    def batches() -> Iterator[list[tuple[str, str]]]:
        batch: list[tuple[str, str]] = []
        for doc in docs:
            batch.append(doc)
            if len(batch) == _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    with ThreadPoolExecutor(max(workers, 1)) as pool:
        for out in pool.map(encode, batches()):
            yield from out


def tokenize(
    inputs: Sequence[str | pathlib.Path],
    out_dir: str | pathlib.Path,
    *,
    tokenizer: str | pathlib.Path | None = None,
    train_bpe_vocab: int | None = None,
    text_field: str = "text",
    val_every: int = 20,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize text files into token files and a manifest (see the module documentation).

    **Arguments:**

    - `inputs`: files or directories of `.txt`/`.jsonl` (optionally `.gz`).
    - `out_dir`: the new folder (must not exist, or be empty).
    - `tokenizer`: a `tokenizer.json` (or a folder holding one).
    - `train_bpe_vocab`: instead, train a byte-level BPE of this vocabulary on the inputs.
    - `text_field`: the `.jsonl` records' text field.
    - `val_every`: one document in this many goes to the validation split.
    - `workers`: threads encoding batches of documents.
    - `progress`: a progress bar on a terminal (plain lines elsewhere).

    **Returns:**

    The manifest written.

    **Raises:**

    `EquishardError` for bad inputs (named by file and line), a tokenizer that does not
    parse or lacks an end-of-text token, an empty input, or an `out_dir` not empty.
    """
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EquishardError(f"tokenize: {out} exists and is not empty; nothing was written.")
    if (tokenizer is None) == (train_bpe_vocab is None):
        raise EquishardError("tokenize: give a tokenizer file or train_bpe_vocab, not both or neither.")
    if val_every < 2:
        raise EquishardError(f"tokenize: val_every must be at least 2, got {val_every}.")
    files = input_files(inputs)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else train_bpe(files, int(train_bpe_vocab or 0), text_field=text_field)
    eot, bos = _special(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _write(tmp, tok, files, text_field, val_every, workers, dtype, progress, eot)
        manifest["tokenizer"].update(eot=eot, bos=bos, vocab_size=vocab)
        manifest["source"] = {"files": [str(f) for f in files], "val_every": val_every, "text_field": text_field}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return manifest


def _write(
    folder: pathlib.Path, tok: Any, files: list[pathlib.Path], text_field: str, val_every: int,
    workers: int, dtype: np.dtype, progress: bool, eot: int,
) -> dict[str, Any]:  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    digest = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    with_mask = any(".jsonl" in f.name for f in files)
    writers = {s: _Writer(folder, s, dtype, with_mask) for s in ("train", "val")}
    bar = _bar(progress)
    for i, (ids, prompt_len, nbytes) in enumerate(_encoded(tok, documents(files, text_field), workers)):
        split = "val" if i % val_every == val_every - 1 else "train"
        writers[split].add(np.asarray([*ids, eot], np.int64), prompt_len, nbytes)
        bar(i + 1)
    splits = {s: w.close() for s, w in writers.items()}
    if splits["train"]["documents"] == 0:
        raise EquishardError(f"tokenize: the inputs {[str(f) for f in files]} hold no document.")
    return {
        "format": FORMAT,
        "dtype": dtype.name,
        "tokenizer": {"file": "tokenizer.json", "sha256": digest},
        "splits": splits,
    }


def _bar(progress: bool) -> Any:
    """`update(documents)`: a tqdm bar on a terminal, a line every 10,000 documents elsewhere."""
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="tokenize", unit="doc", file=sys.stderr, dynamic_ncols=True)
        return lambda n: bar.update(n - bar.n)
    if not progress:
        return lambda n: None
    return lambda n: print(f"tokenize: {n} documents", file=sys.stderr) if n % 10000 == 0 else None


def check_token_files(directory: str | pathlib.Path, seq_len: int, vocab_size: int) -> TokenFiles:
    """The training split of a tokenized corpus, checked against a model's vocabulary.

    **Raises:**

    `EquishardError` as `TokenFiles` does, or for token ids >= `vocab_size`.
    """
    files = TokenFiles(directory, seq_len)
    files.check_vocab(vocab_size)
    return files
