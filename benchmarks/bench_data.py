"""The data path's speed: tokenizing, and reading packed batches from token files.

    python benchmarks/bench_data.py [--vocab 4096] [--batches 200]

On the standard-library corpus (no download; `equishard._app.stdlib_files`):

- **tokenize**: a byte-level BPE of `--vocab` tokens is trained once, then the corpus is
  tokenized with its `tokenizer.json` on 1 and 2 workers: MB of UTF-8 text per second
  (wall time of `tokenize`, writing the token files included);
- **loader**: packed gpt2-small batches (16 x 1024 tokens, `TokenFiles` and
  `equishard.train.batch_at`: memory-mapped reads, epoch permutation, packing with segment
  ids, positions and masked labels) per second, as tokens/s, against the train step's
  tokens/s for the same batch measured on an H100 (`RESULTS.md`: 445,936 tokens/s, the
  124 M model at 16 x 1024): the loader must be at least 10x faster than the step needs.

Writes `benchmarks/results/data.json`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from equishard._app import stdlib_files
from equishard._app._tokenize import tokenize
from equishard.train import TokenFiles, batch_at

HERE = pathlib.Path(__file__).resolve().parent
H100_STEP_TOKENS_PER_S = 445_936  # RESULTS.md: 124m 16 x 1024, H100, best equishard row
BATCH, SEQ = 16, 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary")
    parser.add_argument("--batches", type=int, default=200, help="loader batches timed")
    args = parser.parse_args()
    files = list(stdlib_files())
    megabytes = sum(len(p.read_bytes()) for p in files) / 1e6
    results: dict[str, object] = {"corpus_mb": megabytes, "files": len(files), "vocab": args.vocab}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        t0 = time.perf_counter()
        tokenize(files, root / "bpe", train_bpe_vocab=args.vocab, progress=False)
        results["train_bpe_and_tokenize_s"] = time.perf_counter() - t0
        for workers in (1, 2):
            t0 = time.perf_counter()
            tokenize(files, root / f"w{workers}", tokenizer=root / "bpe" / "tokenizer.json", workers=workers, progress=False)
            seconds = time.perf_counter() - t0
            results[f"tokenize_mb_per_s_{workers}_workers"] = megabytes / seconds
        source = TokenFiles(root / "w1", SEQ)
        batch_at(source, 0, BATCH, seed=0)  # warm the page cache and the epoch's order
        t0 = time.perf_counter()
        for i in range(args.batches):
            batch = batch_at(source, i * BATCH, BATCH, seed=0)
        seconds = time.perf_counter() - t0
        assert np.asarray(batch["inputs"]).shape == (BATCH, SEQ)
        tokens_per_s = args.batches * BATCH * SEQ / seconds
        results.update(
            loader_tokens_per_s=tokens_per_s,
            h100_step_tokens_per_s=H100_STEP_TOKENS_PER_S,
            loader_over_step=tokens_per_s / H100_STEP_TOKENS_PER_S,
            train_tokens=source.manifest["splits"]["train"]["tokens"],
        )
    out = HERE / "results" / "data.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
