"""The data side of `equishard train --data DIR`: a tokenized corpus's splits, the model's
vocabulary from its manifest, the checkpoint's record of it, and batches by position.

Not wired to the command line here: the train command's option (`--data`, with
`--no-document-masking` for `GPTConfig.document_masking`) calls `load_token_data` and
reads its batches with `TokenData.batch`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax

from .._errors import EquishardError
from ..train import TokenFiles, batch_at

VOCAB_MULTIPLE = 64
"""The model's vocabulary is the tokenizer's rounded up to a multiple of this (so that it
splits over a tensor axis, as nanoGPT pads GPT-2's 50257 to 50304)."""


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A tokenized corpus's training and validation splits (`TokenFiles`).

    **Fields:**

    - `train`, `val`: the splits, packed into sequences of `seq_len + 1` tokens.
    - `vocab_size`: the model's vocabulary (the tokenizer's, rounded up to
      `VOCAB_MULTIPLE`).
    """

    train: TokenFiles
    val: TokenFiles
    vocab_size: int

    def batch(
        self, split: str, position: int, batch_size: int, *, seed: int,
        sharding: jax.sharding.Sharding | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The global packed batch at a data position (`equishard.train.batch_at`): the
        training split in a permutation per epoch, the validation split in order."""
        source = self.train if split == "train" else self.val
        return batch_at(source, position, batch_size, seed=seed, sharding=sharding, shuffle=split == "train")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data, to refuse resuming on other data."""
        m = self.train.manifest
        return {
            "data": str(self.train.directory.resolve()),
            "tokenizer_sha256": m["tokenizer"]["sha256"],
            "train_tokens": m["splits"]["train"]["tokens"],
            "val_tokens": m["splits"]["val"]["tokens"],
        }

    def nats_per_byte(self, loss_per_token: float) -> float:
        """A validation loss per token as nats per byte of the validation text (the
        manifest's token and byte counts), comparable with the byte model's loss."""
        split = self.val.manifest["splits"]["val"]
        return loss_per_token * split["tokens"] / max(split["bytes"], 1)


def load_token_data(
    directory: str | pathlib.Path, seq_len: int, *, cp: int = 1, init_vocab_size: int | None = None
) -> TokenData:
    """The splits of the corpus `equishard tokenize` wrote to `directory`.

    **Arguments:**

    - `directory`: the tokenized corpus.
    - `seq_len`: tokens per input sequence.
    - `cp`: the context-parallel axis size.
    - `init_vocab_size`: the vocabulary of the checkpoint a run starts from
      (`--init-from`), which must hold the tokenizer's.

    **Returns:**

    A `TokenData`.

    **Raises:**

    `EquishardError` as `TokenFiles` does, or naming both vocabularies when the
    checkpoint's differs from the one the manifest gives.
    """
    train = TokenFiles(directory, seq_len, split="train", cp=cp)
    val = TokenFiles(directory, seq_len, split="val", cp=cp)
    vocab = -(-train.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if init_vocab_size is not None and init_vocab_size != vocab:
        if init_vocab_size < train.vocab_size:
            raise EquishardError(
                f"--init-from: the checkpoint's vocabulary of {init_vocab_size} is smaller "
                f"than the tokenizer's {train.vocab_size} in {directory}."
            )
        vocab = init_vocab_size
    train.check_vocab(vocab)
    return TokenData(train=train, val=val, vocab_size=vocab)
