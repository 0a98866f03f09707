"""Text out of a run directory: generation and evaluation from its latest verified checkpoint.

`generate_from_run` and `evaluate_run` are what `equishard generate` and `equishard eval`
call. Both rebuild the run from its `config.toml` (under its own layout or another) and
restore the newest checkpoint whose every array carries a checksum; evaluation then uses
the training run's own validation code (`Run.validation_loss`), so that with the run's
batches and seed it reads the very windows a validation row of the run read.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._errors import GenerationError
from ..models import Generator, Sampling, read_hf_config
from ..models._internal import canonical_path
from ._config import CONFIG_FILE, TrainConfig, load_config
from ._data import ByteCorpus, load_stdlib_corpus
from ._tokenize import load_tokenizer

BYTE_VOCABULARY = 256
"""The runs' tokenizer: bytes (ids 0-255)."""


def load_run(
    run_dir: str | pathlib.Path, *, layout: str | None = None, devices: list | None = None,
    changes: dict[str, Any] | None = None,
) -> tuple[Any, Any, int]:  # fmt: skip
    """A run directory's `Run` (under its own layout, or `layout`) and its latest
    verified checkpoint restored onto that layout's mesh.

    **Arguments:**

    - `run_dir`: a directory `equishard train` wrote (its `config.toml`, its checkpoints).
    - `layout`: the layout to rebuild the run under (default: the run's own).
    - `devices`: the devices to use (default: all).
    - `changes`: other `TrainConfig` fields to replace (e.g. `eval_batches`).

    **Returns:**

    `(run, state, step)`: the `Run`, the restored `TrainState` and its step.

    **Raises:**

    `GenerationError` for a directory without `config.toml` or without a verified
    checkpoint (naming the steps there that carry no checksums).
    """
    from ..train import Checkpointer  # orbax: the train extra
    from ._run import Run

    run_dir = pathlib.Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise GenerationError(f"{run_dir} holds no {CONFIG_FILE}: not a run directory of `equishard train`.")
    config = TrainConfig(**load_config(path))
    config = dataclasses.replace(config, **(changes or {}), **({} if layout is None else {"layout": layout}))
    checkpoint_dir = pathlib.Path(config.checkpoint_dir or run_dir / "checkpoints")
    ckpt = Checkpointer(checkpoint_dir, path_map=canonical_path)
    steps = ckpt.all_steps() if checkpoint_dir.is_dir() else []
    verified = [s for s in steps if _verified(ckpt.read_metadata(s))]
    if not verified:
        unverified = f" (steps {steps} carry no checksums)" if steps else ""
        raise GenerationError(
            f"{run_dir}: no verified checkpoint in {checkpoint_dir}{unverified}; train the run "
            f"(with checkpoints verified, the default) first."
        )
    run = Run(config, devices=devices)
    return run, run.restore(ckpt, verified[-1]), verified[-1]


def _verified(meta: dict[str, Any]) -> bool:
    """Whether every array of a checkpoint step carries a checksum."""
    arrays = meta.get("arrays", [])
    return bool(arrays) and all("checksum" in record for record in arrays)


def evaluate_run(
    run_dir: str | pathlib.Path, *, layout: str | None = None, batches: int | None = None,
    seed: int | None = None, whole_split: bool = False, devices: list | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Loss and perplexity of a run's latest verified checkpoint on the validation split.

    **Arguments:**

    - `run_dir`: the run directory.
    - `layout`: evaluate under this layout (default: the run's).
    - `batches`, `seed`: the validation windows: the run's `eval_batches` batches of its
      `batch_size` windows drawn with the data seed `seed` (defaults: the run's own, so
      that the result is the run's validation loss at that step).
    - `whole_split`: instead, every window of `seq_len + 1` bytes of the validation
      split, one after another (stride `seq_len`), in batches of the run's
      `batch_size` (the windows that do not fill a last batch are left out).
    - `devices`: the devices to use (default: all).

    **Returns:**

    A dict: `step`, `loss` (nats per token), `perplexity`, `bits_per_byte` (the tokens
    are bytes), `tokens` (predicted), `batches`.

    **Raises:**

    `GenerationError` as `load_run` does, or for `batches < 1`.
    """
    if batches is not None and batches < 1:
        raise GenerationError(f"evaluate_run: batches={batches} must be at least 1.")
    changes: dict[str, Any] = {} if batches is None else {"eval_batches": batches}
    changes |= {} if seed is None else {"seed": seed}
    run, state, step = load_run(run_dir, layout=layout, devices=devices, changes=changes)
    config = run.config
    if run.tokens is not None:
        if whole_split:
            raise GenerationError("eval --whole-split: the byte corpus's windows; a --data run evaluates its validation batches.")
        loss = run.validation_loss(state, None)
        return {
            "step": step, "loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": run.per_byte(loss)["val_loss_per_byte"] / math.log(2),
            "tokens": config.eval_batches * config.batch_size * config.seq_len, "batches": config.eval_batches,
        }  # fmt: skip
    corpus = load_stdlib_corpus()
    if whole_split:
        losses = _whole_split(run, state, corpus)
        loss, count = float(np.mean(losses)), len(losses)
    else:
        # The training run's own validation: the same windows, the same code.
        loss, count = run.validation_loss(state, corpus), config.eval_batches
    return {
        "step": step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": count * config.batch_size * config.seq_len,
        "batches": count,
    }


def _whole_split(run: Any, state: Any, corpus: ByteCorpus) -> list[float]:
    """The mean loss of each batch of consecutive validation windows (one process)."""
    config = run.config
    val = np.asarray(corpus.val)
    n = (len(val) - 1) // config.seq_len
    starts = np.arange(n) * config.seq_len
    windows = np.stack([val[s : s + config.seq_len + 1] for s in starts]).astype(np.int32)
    full = n // config.batch_size
    if full == 0:
        raise GenerationError(
            f"evaluate_run: the validation split has {n} windows of {config.seq_len + 1} bytes, "
            f"fewer than one batch of {config.batch_size}."
        )
    rows = windows[: full * config.batch_size].reshape(full, config.batch_size, -1)
    return [float(run.eval_loss(state.model, batch)) for batch in rows]


def generate_from_run(
    run_dir: str | pathlib.Path, prompts: Sequence[bytes | str], *, max_new_tokens: int = 200,
    max_len: int | None = None, layout: str | None = None, sampling: Sampling = Sampling(),
    seed: int = 0, stop: Sequence[bytes | str] = (), gather: str = "once", devices: list | None = None,
    on_token: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Continue `prompts` with a run's latest verified checkpoint, on its layout's mesh.

    **Arguments:**

    - `run_dir`: the run directory.
    - `prompts`: the texts (UTF-8) or bytes to continue.
    - `max_new_tokens`: the most bytes each prompt gets.
    - `max_len`: the cache's length (default: the run's `seq_len`, the window it was
      trained on, or more where the prompts need it).
    - `layout`: generate under this layout (default: the run's).
    - `sampling`: see `equishard.models.Sampling` (default greedy).
    - `seed`: the sampling key `jax.random.key(seed)` (every row's).
    - `stop`: single bytes that end a row (the byte model's stop tokens).
    - `gather`: see `equishard.models.Generator`.
    - `devices`: the devices to use (default: all).
    - `on_token`: `on_token(row, text)` with each row's new text as its tokens come
      (decoded as a whole so far: a character split over tokens comes when complete).

    **Returns:**

    A dict: `step`, `texts` (each continuation, decoded with replacement), `tokens`,
    `stopped`, `prefill_seconds`, `decode_seconds`, `decode_steps`.

    **Raises:**

    `GenerationError` as `load_run` and `equishard.models.Generator` do, or for a stop
    string that is not one byte.
    """
    run, state, step = load_run(run_dir, layout=layout, devices=devices)
    if run.tokens is not None:  # a --data run: its token files' tokenizer
        return _generate_tokens(
            run, state, step, [str(p) for p in prompts], max_new_tokens=max_new_tokens, max_len=max_len,
            sampling=sampling, seed=seed, stop=[str(s) for s in stop], gather=gather, on_token=on_token,
        )  # fmt: skip
    data = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in prompts]
    stops = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stop]
    if any(len(s) != 1 for s in stops):
        raise GenerationError(f"generate: stop strings {stops!r}: the byte model stops on single bytes.")
    ids = [list(p) for p in data]
    length = _cache_length(ids, max_new_tokens, max_len, run.config.seq_len)
    generator = Generator(
        state.model, run.mesh, max_len=length, sampling=sampling, gather=gather, vocab_size=BYTE_VOCABULARY
    )
    decode = lambda t: bytes(t).decode("utf-8", errors="replace")  # noqa: E731
    return _generated(generator, ids, decode, [s[0] for s in stops], max_new_tokens=max_new_tokens, seed=seed, on_token=on_token, step=step)


def _cache_length(ids: Sequence[Sequence[int]], max_new_tokens: int, max_len: int | None, seq_len: int = 0) -> int:
    """The cache's length: `max_len`, else the longest prompt (as the prefill pads it, to
    a multiple of 16) plus the new tokens, at least the run's window `seq_len`."""
    longest = max((len(p) for p in ids), default=1)
    return max_len or max(seq_len, -(-longest // 16) * 16 + max_new_tokens)


def _generated(
    generator: Generator, ids: list[list[int]], decode: Any, stop_ids: list[int], *,
    max_new_tokens: int, seed: int, on_token: Any, step: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Generate from the prompts' `ids`; the result `generate_from_run` returns, the
    texts made by `decode(ids)` (streamed to `on_token` as they come)."""
    out = generator.generate(
        ids, max_new_tokens=max_new_tokens, key=jax.random.key(seed), stop_tokens=stop_ids,
        on_token=_text_stream(on_token, decode),
    )  # fmt: skip
    return {
        "step": step,
        "texts": [decode(list(t)) for t in out.tokens],
        "tokens": out.tokens,
        "stopped": out.stopped,
        "prefill_seconds": out.prefill_seconds,
        "decode_seconds": out.decode_seconds,
        "decode_steps": out.decode_steps,
    }


def _text_stream(on_token: Any, decode: Any) -> Any:
    """`on_token(row, id)` for the generator that hands `on_token(row, text)` each row's
    new text: the row's ids decoded as a whole, less what was handed before."""
    if on_token is None:
        return None
    ids: dict[int, list[int]] = {}
    shown: dict[int, str] = {}

    def each(row: int, token: int) -> None:
        ids.setdefault(row, []).append(int(token))
        text = decode(ids[row])
        new = text[len(shown.get(row, "")) :] if text.startswith(shown.get(row, "")) else ""
        if new:
            shown[row] = text
            on_token(row, new)

    return each


def _one_token_each(tokenizer: Any, stop: Sequence[str]) -> list[int]:
    """Each stop string's one token (refused by name if it is several)."""
    ids = []
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise GenerationError(
                f"generate: the stop string {text!r} is {len(encoded)} tokens of this tokenizer; "
                f"a stop string must be one token."
            )
        ids.append(encoded[0])
    return ids


def _generate_tokens(
    run: Any, state: Any, step: int, prompts: Sequence[str], *, max_new_tokens: int, max_len: int | None,
    sampling: Sampling, seed: int, stop: Sequence[str], gather: str, on_token: Any,
) -> dict[str, Any]:  # fmt: skip
    """`generate_from_run` for a `--data` run: the prompts encoded by its tokenizer, the
    tokenizer's end-of-text token a stop token."""
    tokenizer = load_tokenizer(run.tokens.train.directory)
    eot = run.tokens.train.manifest["tokenizer"].get("eot")
    ids = [tokenizer.encode(p).ids for p in prompts]
    length = _cache_length(ids, max_new_tokens, max_len, run.config.seq_len)
    generator = Generator(state.model, run.mesh, max_len=length, sampling=sampling, gather=gather, vocab_size=tokenizer.get_vocab_size())
    stops = ([eot] if eot is not None else []) + _one_token_each(tokenizer, stop)
    return _generated(generator, ids, tokenizer.decode, stops, max_new_tokens=max_new_tokens, seed=seed, on_token=on_token, step=step)


def _hf_stop_ids(folder: pathlib.Path, tokenizer: Any, stop: Sequence[str]) -> list[int]:
    """The end-of-text ids `config.json` names and each stop string's one token."""
    eos = read_hf_config(str(folder)).get("eos_token_id")
    return ([eos] if isinstance(eos, int) else list(eos or [])) + _one_token_each(tokenizer, stop)


def generate_from_hf(
    folder: str | pathlib.Path, prompts: Sequence[str], *, layout: str = "dp=1", max_new_tokens: int = 200,
    max_len: int | None = None, sampling: Sampling = Sampling(), seed: int = 0, stop: Sequence[str] = (),
    gather: str = "once", devices: list | None = None, on_token: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Continue `prompts` with the model of a Hugging Face folder (its `tokenizer.json`),
    under `layout`, each device reading its own blocks of the weights.

    **Arguments:** as `generate_from_run`, with `folder` (see `equishard.models.load_hf`)
    for the run; the stop strings must be one token each, and the `eos_token_id` of the
    folder's `config.json` stops a row too.

    **Returns:** as `generate_from_run` (`step` is `None`).

    **Raises:** `GenerationError` for a folder without `tokenizer.json`, a stop string of
    several tokens, and as `equishard.models.Generator` does; `CheckpointError` as
    `equishard.models.load_hf` does.
    """
    from ..models import load_hf
    from ..sharding import Layout

    folder = pathlib.Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise GenerationError(f"generate --hf {folder}: no tokenizer.json there to encode the prompts with.")
    tokenizer = load_tokenizer(folder)
    resolved = Layout(layout).resolve(len(devices) if devices is not None else None)
    mesh = resolved.mesh(devices)
    model = load_hf(str(folder), resolved, mesh)
    ids = [tokenizer.encode(p).ids for p in prompts]
    generator = Generator(
        model, mesh, max_len=_cache_length(ids, max_new_tokens, max_len), sampling=sampling, gather=gather,
        vocab_size=tokenizer.get_vocab_size(),
    )  # fmt: skip
    stops = _hf_stop_ids(folder, tokenizer, stop)
    return _generated(generator, ids, tokenizer.decode, stops, max_new_tokens=max_new_tokens, seed=seed, on_token=on_token, step=None)
