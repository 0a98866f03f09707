"""The commands around a run: `tokenize`, `generate`, `eval` and `export`.

Each command's options are one dataclass of the application's configuration
(`TokenizeConfig`, `GenerateConfig`, `EvalConfig`, `ExportConfig`); the parsers are
generated from them, as `train`'s, `inspect`'s and `plan`'s are.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from ._cli_base import HelpFormatter, use_cpu_devices
from ._errors import LayerConfigError


def _tokenize(args: argparse.Namespace) -> int:
    from ._app._internal import TokenizeConfig, from_args, stdlib_files, tokenize
    from ._errors import EquishardError

    c = from_args(TokenizeConfig, args)
    if bool(c.inputs) == c.stdlib:
        raise EquishardError("tokenize: give the input files (or directories), or --stdlib; one of the two.")
    manifest = tokenize(
        stdlib_files() if c.stdlib else c.inputs, c.out, tokenizer=c.tokenizer, train_bpe_vocab=c.train_bpe, text_field=c.text_field,
        val_every=c.val_every, workers=c.workers, progress=c.progress and sys.stderr.isatty(),
    )  # fmt: skip
    splits = manifest.get("splits", {})
    counts = ", ".join(f"{name}: {s.get('tokens', 0):,} tokens in {s.get('documents', 0):,} documents" for name, s in splits.items())
    print(f"wrote {c.out}: vocabulary {manifest['tokenizer'].get('vocab_size')}, {manifest['dtype']} ids; {counts}")
    return 0


def _prompts(c: Any) -> list[str]:
    from ._errors import GenerationError

    prompts = list(c.prompt)
    if c.prompt_file is not None:
        try:
            text = pathlib.Path(c.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise GenerationError(f"generate --prompt-file {c.prompt_file}: cannot read it as UTF-8 text ({err}).") from None
        prompts += [line for line in text.splitlines() if line]
    if not prompts:
        raise GenerationError("generate: no prompt: give --prompt TEXT (repeatable) or --prompt-file FILE.")
    return prompts


def _streamer(c: Any, prompts: list[str]) -> Any:
    """`on_token` that writes a lone prompt's text as it comes (none with --json or a
    batch of prompts)."""
    if c.json or len(prompts) != 1:
        return None
    started: list[bool] = []

    def on_token(row: int, text: str) -> None:
        if not started:  # the prompt once the model runs (nothing printed before an error)
            sys.stdout.write(prompts[0])
            started.append(True)
        sys.stdout.write(text)
        sys.stdout.flush()

    return on_token


def _generate(args: argparse.Namespace) -> int:
    from ._app._internal import GenerateConfig, from_args
    from ._errors import GenerationError

    c = from_args(GenerateConfig, args)
    if (c.run_dir is None) == (c.hf is None):
        raise GenerationError("generate: give --run-dir RUN or --hf DIR; one of the two.")
    use_cpu_devices(c.devices)
    from ._app._internal import generate_from_hf, generate_from_run
    from .models import Sampling

    prompts = _prompts(c)
    options: dict[str, Any] = dict(
        max_new_tokens=c.max_new_tokens, max_len=c.max_len, seed=c.seed, stop=c.stop,
        sampling=Sampling(c.temperature, c.top_k, c.top_p), gather=c.gather,
        on_token=_streamer(c, prompts),
    )  # fmt: skip
    if c.hf is not None:
        out = generate_from_hf(c.hf, prompts, layout=c.layout or "dp=1", **options)
    else:
        out = generate_from_run(c.run_dir, prompts, layout=c.layout, **options)
    if c.json:
        print(json.dumps({k: v for k, v in out.items() if k != "stopped"} | {"prompts": prompts}))
    elif options["on_token"] is not None:
        print(prompts[0] if not out["tokens"][0] else "")
    else:
        for prompt, text in zip(prompts, out["texts"]):
            print(f"{prompt}{text}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ._app._internal import EvalConfig, from_args
    from ._errors import GenerationError

    c = from_args(EvalConfig, args)
    if c.run_dir is None:
        raise GenerationError("eval: give --run-dir RUN, the run directory to evaluate.")
    use_cpu_devices(c.devices)
    from ._app._internal import evaluate_run

    out = evaluate_run(c.run_dir, layout=c.layout, batches=c.batches, seed=c.seed, whole_split=c.whole_split)
    if c.json:
        print(json.dumps(out))
    else:
        print(
            f"step {out['step']}: validation loss {out['loss']:.6f} nats per token, perplexity "
            f"{out['perplexity']:.4f}, {out['bits_per_byte']:.4f} bits per byte ({out['batches']} "
            f"batches, {out['tokens']:,} tokens)"
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from ._app._internal import ExportConfig, from_args

    c = from_args(ExportConfig, args)
    use_cpu_devices(c.devices)
    from ._app._internal import DTYPES, export_run

    dtype = None if c.dtype is None else DTYPES[c.dtype]
    if c.merged and c.adapters:
        raise LayerConfigError("export: --merged and --adapters exclude each other; give one.")
    what = "merged" if c.merged else "adapters" if c.adapters else None
    to, wrote = export_run(
        c.run_dir, c.to, step=c.step, dtype=dtype, max_shard_bytes=int(c.max_shard_gib * 2**30), what=what
    )  # fmt: skip
    described = {
        "adapters": "the LoRA adapters, a PEFT folder: adapter_config.json, adapter_model.safetensors",
        "merged": "the model with its LoRA adapters merged, a Hugging Face folder",
        "model": "a Hugging Face folder",
    }
    print(f"exported {c.run_dir} to {to} ({described[wrote]})")
    return 0


_COMMANDS = (
    ("tokenize", "TokenizeConfig", _tokenize, "tokenize text files into token files for train --data",
     "Tokenize .txt and .jsonl files (optionally gzipped; a directory of them) with a Hugging "
     "Face tokenizer.json or a byte-level BPE trained on them into memory-mappable token "
     "files with a manifest (written last: an interrupted run leaves none) and a validation "
     "split by documents. Records with prompt/completion fields get a loss mask on the prompt."),
    ("generate", "GenerateConfig", _generate, "generate text from a run's checkpoint (key/value cache)",
     "Continue prompts with a run's latest verified checkpoint, under its layout or another: "
     "the prompts prefilled in one pass, then one compiled decode step per token with a "
     "key/value cache split as the attention is. A lone prompt's text is streamed."),
    ("eval", "EvalConfig", _eval, "validation loss and perplexity of a run's checkpoint",
     "Loss and perplexity of a run's latest verified checkpoint on its validation split: by "
     "default the very windows of the run's validation rows (the same loss at that step), or "
     "--batches N --seed S, or --whole-split."),
    ("export", "ExportConfig", _export, "write a run's checkpoint as a Hugging Face folder",
     "Write a run's verified checkpoint (any layout) as a Hugging Face folder (config.json, "
     "safetensors split at a size limit with their index, generation_config.json, the "
     "tokenizer files it came with), tensor by tensor into a temporary folder, then renamed."),
)  # fmt: skip


def add_text_parsers(sub: Any) -> None:
    """Add the `tokenize`, `generate`, `eval` and `export` commands to `sub`."""
    from ._app import _internal
    from ._app._internal import add_options

    for name, config, run, help_text, description in _COMMANDS:
        p = sub.add_parser(name, help=help_text, description=description, formatter_class=HelpFormatter)
        add_options(p, getattr(_internal, config))
        p.set_defaults(run=run)
