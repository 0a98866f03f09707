"""What a run trains, from its options: LoRA adapters (`--lora-rank`, `--lora-alpha`,
`--lora-targets`, `--init-adapters`) and frozen parameters (`--freeze`).

A run that trains part of its model checkpoints that part only, with a fingerprint of
the frozen rest (its base: `--init-from`'s weights, or the seed's initialisation),
and is resumed, evaluated and exported by rebuilding the base and checking it against
the fingerprint.
"""

from __future__ import annotations

import dataclasses
import os
import re

from .._errors import LayerConfigError
from ..models import LoRA, adapters_trainable, read_peft_config
from ..nn import LORA_TARGETS
from ..train import Trainable
from ._config import TrainConfig

DEFAULT_TARGETS = TrainConfig.lora_targets
"""`--lora-targets`' default (PEFT's for the Llama family: q and v)."""


def _targets(text: str) -> tuple[str, ...]:
    """`--lora-targets q,v` as a tuple, each name checked."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown or not names:
        raise LayerConfigError(
            f"--lora-targets {text!r}: "
            + (
                f"{', '.join(map(repr, unknown))} is not a projection"
                if unknown
                else "no projection given"
            )
            + f"; choose among {', '.join(LORA_TARGETS)} (comma-separated)."
        )
    return names


def check_finetune_options(config: TrainConfig) -> None:
    """Refuse fine-tuning options that cannot make a run (see `run_lora`), before
    anything is read or built.

    **Raises:**

    `LayerConfigError` naming the option and the value.
    """
    if config.lora_rank is not None and config.lora_rank < 1:
        raise LayerConfigError(f"--lora-rank must be at least 1, got {config.lora_rank}.")
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        raise LayerConfigError(f"--lora-alpha must be above 0, got {config.lora_alpha}.")
    if not 0.0 <= config.lora_dropout < 1.0:
        raise LayerConfigError(f"--lora-dropout must be in [0, 1), got {config.lora_dropout}.")
    _targets(config.lora_targets)
    if config.freeze is not None:
        try:
            re.compile(config.freeze)
        except re.error as err:
            raise LayerConfigError(
                f"--freeze {config.freeze!r} is not a regular expression: {err}."
            ) from None
    if config.init_adapters is not None and config.init_from is None:
        raise LayerConfigError(
            f"--init-adapters {config.init_adapters}: a PEFT folder adapts the model it was "
            f"made for; give that model with --init-from DIR."
        )
    lora_only = [n for n in ("lora_alpha", "lora_dropout") if getattr(config, n) not in (None, 0.0)]
    if lora_only and config.lora_rank is None and config.init_adapters is None:
        raise LayerConfigError(
            f"--{lora_only[0].replace('_', '-')} applies to LoRA adapters: give --lora-rank R "
            f"(or --init-adapters DIR)."
        )


def run_lora(config: TrainConfig) -> LoRA | None:
    """The run's adapters: `--init-adapters`' PEFT configuration, or `--lora-rank`'s
    (alpha defaults to the rank: a scale of 1), or `None`.

    **Raises:**

    `LayerConfigError` when `--lora-rank`, `--lora-alpha` or `--lora-targets` contradict
    the PEFT folder's; `CheckpointError` for a PEFT folder the GPT cannot take.
    """
    if config.init_adapters is None:
        if config.lora_rank is None:
            return None
        alpha = float(config.lora_rank if config.lora_alpha is None else config.lora_alpha)
        return LoRA(
            config.lora_rank,
            alpha=alpha,
            dropout=config.lora_dropout,
            targets=_targets(config.lora_targets),
        )
    lora = read_peft_config(os.fspath(config.init_adapters))
    targets = None if config.lora_targets == DEFAULT_TARGETS else _targets(config.lora_targets)
    for flag, mine, theirs in (
        ("--lora-rank", config.lora_rank, lora.rank),
        ("--lora-alpha", config.lora_alpha, lora.alpha),
        ("--lora-targets", targets and set(targets), set(lora.targets)),
    ):
        if mine is not None and mine != theirs:
            raise LayerConfigError(
                f"{flag} {mine!r} contradicts the adapters of --init-adapters "
                f"{config.init_adapters} ({theirs!r}); leave it out to use theirs."
            )
    return dataclasses.replace(lora, dropout=config.lora_dropout)


def run_trainable(config: TrainConfig, lora: LoRA | None) -> Trainable | None:
    """The run's trainable filter: the adapters with LoRA (less what `--freeze`
    matches), every array but what `--freeze` matches without, or `None` (all)."""
    if lora is not None:
        return adapters_trainable(freeze=config.freeze)
    if config.freeze is not None:
        return Trainable.matching(freeze=config.freeze)
    return None


def base_source(config: TrainConfig) -> str:
    """What a run's frozen base is, for checkpoints and messages."""
    if config.init_from is not None:
        return f"--init-from {config.init_from}"
    return f"--model {config.model} initialised from --seed {config.seed}"
