"""The main job: train the reference GPT on bytes of the standard library, any layout.

`run(TrainConfig(...))` is what `equishard train` calls: it builds the mesh from the
layout, the model and optimizer state directly sharded on it (or restores them from a
checkpoint, resharding to this layout), trains with `make_train_step`, evaluates on the
held-out split, writes `metrics.jsonl`, checkpoints, a loss-curve PNG, the trained
model as a plain one-device Equinox file (`model.eqx`) and a text sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._errors import CheckpointError, LayerConfigError, TrainingError
from .._text import human_bytes
from ..core import pipeline_layer_order
from ..distributed import is_coordinator
from ..models import (
    GPT,
    PRESETS,
    GPTConfig,
    check_context_split,
    count_parameters,
    gpt_flops_per_token,
    gpt_matmul_parameters,
    gpt_training,
    precision_policy,
    token_batch,
)
from ..models._internal import canonical_path, to_single_device
from ..nn import remat_policy
from ..report import DeviceProfile, device_profile
from ..sharding import Parallelism, filter_shard_map, format_param_table, gather
from ..train import TrainState, batch_at, export_model
from ._config import DTYPES, TrainConfig, layout_from_options
from ._data import ByteCorpus, ByteWindows, corpus_identity, load_stdlib_corpus
from ._finetune import base_source, check_finetune_options, run_lora, run_trainable
from ._log import (
    Clock,
    Throughput,
    device_memory_stat,
    peak_memory_bytes,
    rate_summary,
    step_line,
    time_summary,
)
from ._metrics import METRICS_FILE, MetricsLog, read_metrics
from ._profile import StepProfiler, profile_resumed_note, profile_steps
from ._rundir import claim, write_atomically

if TYPE_CHECKING:
    from ..train import Checkpointer


def make_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps (at least one), then cosine decay
    to a tenth of `lr` at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, max(config.warmup, 1), max(config.steps, config.warmup + 1), config.lr / 10
    )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW on `make_schedule`'s learning rates."""
    return optax.adamw(make_schedule(config), b1=0.9, b2=0.95, weight_decay=config.weight_decay)


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def check_options(config: TrainConfig) -> None:
    """Refuse options that cannot make a run, before anything is built or compiled.

    Counts must be at least 1 (or 0 where 0 means "none"), rates finite and not
    negative, and the learning-rate schedule finite, never negative, with a peak above 0
    (its first step is 0: the warmup starts there). Nothing is silently replaced.

    **Raises:**

    `LayerConfigError` naming the option and the value.
    """
    if config.model not in PRESETS:  # the command line's choices; a config file's names
        raise LayerConfigError(
            f"unknown model preset {config.model!r}; choose one of {', '.join(PRESETS)}."
        )
    remat_policy(config.remat, offload=config.remat_offload)  # an unknown name, or offload on the CPU
    if config.dtype not in DTYPES:
        raise LayerConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}.")
    profile_steps(config.profile, config.steps)
    at_least_one = (
        "steps", "batch_size", "seq_len", "grad_accum", "checkpoint_every", "eval_every",
        "eval_batches", "log_every", "keep_checkpoints", "max_skipped_steps", "batch_chunks",
    )  # fmt: skip
    for name in at_least_one:
        if getattr(config, name) < 1:
            raise LayerConfigError(f"{_option(name)} must be at least 1, got {getattr(config, name)}.")
    for name in ("warmup", "sample_bytes"):
        if getattr(config, name) < 0:
            raise LayerConfigError(f"{_option(name)} must be 0 or more, got {getattr(config, name)}.")
    if not 0 <= config.seed < 2**63:
        raise LayerConfigError(f"--seed must be 0 or more and below 2**63, got {config.seed}.")
    if config.require_verified and not config.verify_checkpoints:
        raise LayerConfigError("--require-verified and --no-verify-checkpoints exclude each other.")
    if config.resume_step is not None and config.resume_step < 0:
        raise LayerConfigError(f"--resume-step must be 0 or more, got {config.resume_step}.")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise LayerConfigError(f"--lr must be a finite number above 0, got {config.lr}.")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        raise LayerConfigError(f"--weight-decay must be a finite number, 0 or more, got {config.weight_decay}.")
    if config.clip_norm is not None and not (math.isfinite(config.clip_norm) and config.clip_norm > 0):
        raise LayerConfigError(
            f"--clip-norm must be a finite number above 0, or 0 / none for no clipping, got "
            f"{config.clip_norm}."
        )
    _check_counters(config)
    check_schedule(make_schedule(config), config.steps, breakpoints=(config.warmup,))
    check_finetune_options(config)


MAX_COUNT = 2**31 - 1
"""The largest step count and data position a `TrainState` holds (`int32` counters)."""


def _check_counters(config: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "warmup"):
        if getattr(config, name) > MAX_COUNT:
            raise LayerConfigError(
                f"{_option(name)} {getattr(config, name)} is more than the {MAX_COUNT} a run's int32 counters hold."
            )
    if config.steps * config.batch_size > MAX_COUNT:
        raise LayerConfigError(
            f"--steps {config.steps} x --batch-size {config.batch_size} samples is more than "
            f"the {MAX_COUNT} the run's data position (an int32 counter) holds."
        )


def check_schedule(schedule: optax.Schedule, steps: int, *, breakpoints: tuple[int, ...] = ()) -> None:
    """Check a learning-rate schedule over a run: finite, not negative, peak > 0.

    It is evaluated at every step up to 4096 steps; beyond, at 4097 evenly spaced
    steps, at each of `breakpoints` (where a piecewise schedule changes pieces) and
    the steps beside them, so that a long run's check costs what a short one's does.

    **Raises:**

    `LayerConfigError` naming the first bad step and its value.
    """
    if steps <= 4096:
        at = np.arange(steps + 1)
    else:
        near = [b + d for b in (0, *breakpoints, steps) for d in (-1, 0, 1)]
        at = np.unique(np.clip(np.concatenate([np.linspace(0, steps, 4097).round(), near]), 0, steps))
    at = at.astype(np.int64)
    rates = np.asarray(jax.vmap(schedule)(jnp.asarray(at)), np.float64)
    bad = ~np.isfinite(rates) | (rates < 0)
    if bad.any():
        step = int(at[np.argmax(bad)])
        raise LayerConfigError(
            f"the learning-rate schedule gives {rates[np.argmax(bad)]} at step {step}: every rate must "
            f"be finite and 0 or more (check --lr and --warmup)."
        )
    if rates.max() <= 0:
        raise LayerConfigError(
            f"the learning-rate schedule is 0 at every one of the {steps} steps: nothing "
            f"would be learned (check --lr and --steps)."
        )


def _check(config: TrainConfig, layout: Parallelism) -> None:
    data = layout.data_parallel_size
    per_device = config.batch_size // data if config.batch_size % data == 0 else None
    if per_device is None:
        raise LayerConfigError(
            f"--batch-size {config.batch_size} is not divisible by the {data} ways the layout "
            f"{config.layout!r} splits the batch."
        )
    if per_device % (config.grad_accum * layout.num_microbatches):
        raise LayerConfigError(
            f"the per-device batch of {per_device} examples does not divide into "
            f"{config.grad_accum} accumulation steps x {layout.num_microbatches} pipeline "
            f"micro-batches."
        )
    check_context_split(layout, config.seq_len)
    if not layout.pipeline:
        given = [
            _option(name) for name, unset in
            (("pipeline_schedule", None), ("microbatches", None), ("pipeline_repeats", 1))
            if getattr(config, name) != unset
        ]  # fmt: skip
        if given:
            raise LayerConfigError(
                f"{', '.join(given)} apply only to a pipeline, and the layout {config.layout!r} "
                f"has no pp axis: drop {'them' if len(given) > 1 else 'it'} or add pp to --layout."
            )


def machine_memory(devices: list) -> tuple[int, str]:
    """The memory `devices` have together, and what it is: on accelerators the sum of
    their memory limits, on the CPU (simulated devices share it) the host's RAM."""
    limits = device_memory_stat(devices, "bytes_limit")
    if limits and len(limits) == len(devices):
        return sum(limits), f"the {len(devices)} {devices[0].platform} devices' memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def _too_large_for_one_device(model: Any, devices: list) -> str:
    """Why the end-of-run sample, which gathers the model onto one device, would not fit
    there (the model above half of the smallest device's memory), or `""`."""
    limits = device_memory_stat(devices, "bytes_limit")
    one = min(limits) if limits and len(limits) == len(devices) else machine_memory(devices)[0]
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    if 2 * size <= one:
        return ""
    return f"the model's {human_bytes(size)} would be gathered onto one device of {human_bytes(one)}"


def check_fits_machine(name: str, model: Any, devices: list) -> None:
    """Refuse a preset whose parameters, gradients and AdamW moments (16 bytes per
    parameter in float32) exceed the memory of `devices`, before anything is built.

    **Raises:**

    `LayerConfigError` with the bytes needed and had, pointing to `equishard plan`.
    """
    parameters = gpt_matmul_parameters(model) + model.vocab_size * model.d_model * (not model.tied)
    need = 16 * parameters
    have, what = machine_memory(devices)
    if need > have:
        raise LayerConfigError(
            f"--model {name}: its {parameters / 1e9:.1f} B parameters need at least "
            f"{human_bytes(need)} for the parameters, gradients and AdamW moments (16 bytes "
            f"each in float32), more than {what} ({human_bytes(have)}). Train it on a "
            f"cluster; `equishard plan --model {name} --layout ... --devices N` estimates "
            f"a layout for it."
        )


def _model_and_data(config: TrainConfig, layout: Parallelism, devices: list) -> tuple[GPTConfig, Any]:
    """The model's configuration (a preset's, or `--init-from`'s `config.json`) and the
    token data (`--data`, or `None` for the byte corpus), the vocabulary the model's."""
    from ._token_data import load_token_data

    if config.init_from is not None and config.data is None:
        raise LayerConfigError(
            f"--init-from {config.init_from}: a pretrained model reads its tokenizer's ids, "
            f"not bytes: give --data DIR, token files `equishard tokenize --tokenizer "
            f"{config.init_from}` wrote with the model's own tokenizer."
        )
    if config.init_from is not None:
        from ._hf import hf_model_config

        base = hf_model_config(config.init_from, layout, seq_len=config.seq_len)
    else:
        check_fits_machine(config.model, PRESETS[config.model], devices)
        base = PRESETS[config.model]
    if config.data is None:
        return base, None
    cp = layout.size(layout.context)
    init_vocab = base.vocab_size if config.init_from is not None else None
    tokens = load_token_data(config.data, config.seq_len, cp=cp, init_vocab_size=init_vocab)
    return dataclasses.replace(base, vocab_size=tokens.vocab_size), tokens


class Run:
    """A training run's pieces, built from a `TrainConfig` (see `run`)."""

    def __init__(self, config: TrainConfig, *, devices: list | None = None):
        check_options(config)
        self.config = config
        devices = list(jax.devices() if devices is None else devices)
        self.layout: Parallelism = layout_from_options(config).resolve(len(devices))
        self.mesh: Mesh = self.layout.mesh(devices)
        _check(config, self.layout)
        base, self.tokens = _model_and_data(config, self.layout, devices)
        self.model_config = dataclasses.replace(
            base, remat=config.remat, remat_offload=config.remat_offload,
            batch_chunks=config.batch_chunks, document_masking=config.document_masking,
        )  # fmt: skip
        self.optimizer = make_optimizer(config)
        # What is trained: LoRA adapters, or all but what --freeze matches (None: all).
        self.lora = run_lora(config)
        self.trainable = run_trainable(config, self.lora)
        self.base_source = base_source(config)
        self.batch_spec = self.layout.batch_spec
        self.batch_sharding = NamedSharding(self.mesh, self.batch_spec)
        # Mixed precision by the step (float32 master weights and optimizer state, FSDP
        # gathering in the compute dtype and reducing gradients in float32).
        self.training = gpt_training(
            self.model_config, self.layout, self.mesh, self.optimizer,
            grad_accum=config.grad_accum, clip_norm=config.clip_norm,
            precision=precision_policy(DTYPES[config.dtype]), lora=self.lora, trainable=self.trainable,
        )  # fmt: skip
        self.loss_fn = loss_fn = self.training.loss_fn
        self.train_step = self.training.step
        self.eval_loss = eqx.filter_jit(
            filter_shard_map(
                lambda model, batch: loss_fn(model, batch, None)[1]["cross_entropy"],
                mesh=self.mesh,
                in_specs=(None, self.batch_spec),
                out_specs=P(),
            )
        )

    def unit_order(self) -> list[int]:
        """The model-order index of each stored unit (a circular pipeline deals them)."""
        par = self.layout
        units = self.model_config.n_layers // max(self.model_config.moe_every, 1)
        if not par.pipeline:
            return list(range(units))
        return list(pipeline_layer_order(units, par.num_stages, par.pipeline_repeats))

    def make_model(self, key: Any) -> GPT:
        return self.training.make_model(key)

    def init_state(self) -> TrainState:
        """The initial state, born sharded (mesh-invariant: the same on every layout);
        with `--init-from`, its model's weights read from the Hugging Face folder (each
        device its own blocks; the optimizer state is built from the parameters' shapes
        alone), with `--init-adapters` its adapters from the PEFT folder."""
        state = self._initial_state()
        if self.config.init_from is None:
            return state
        from ..models import add_lora, load_peft
        from ._hf import init_from_hf

        _, loaded = init_from_hf(self.config.init_from, self.layout, self.mesh, seq_len=self.config.seq_len)
        if self.lora is not None:  # B zero: the loaded model's function
            loaded = add_lora(loaded, self.lora, key=jax.random.key(self.config.seed))
        model = _with_config_of(state.model, loaded)
        if self.config.init_adapters is not None:
            model = load_peft(model, os.fspath(self.config.init_adapters))
        return eqx.tree_at(lambda s: s.model, state, model)

    def base_model(self) -> GPT | None:
        """The frozen base a checkpoint of the trained part is restored onto (the model
        `init_state` builds: `--init-from`'s weights, or the seed's), or `None` for a run
        that trains every array."""
        return None if self.trainable is None else self.init_state().model

    def restore(self, ckpt: Checkpointer, step: int | None) -> TrainState:
        """Checkpoint `step` (default: the latest) restored under this run's layout; one
        of the trained part onto the run's base, its fingerprint checked."""
        return ckpt.restore(
            self.state_template(), step=step, mesh=self.mesh, base=self.base_model(), base_source=self.base_source
        )  # fmt: skip

    def save(self, ckpt: Checkpointer, step: int, state: TrainState, *, exist_ok: bool = False) -> bool:
        """Save checkpoint `step`: the trained part only when the run trains part of
        its model (with its base's fingerprint)."""
        return ckpt.save(step, state, exist_ok=exist_ok, trainable=self.trainable, base_source=self.base_source)

    def _initial_state(self) -> TrainState:
        return self.training.init_state(jax.random.key(self.config.seed))

    def state_template(self) -> TrainState:
        """The state's structure, shapes and specs, computed without building it."""
        return eqx.filter_eval_shape(self._initial_state)

    def train_batch(self, corpus: ByteCorpus | None, position: int) -> Any:
        """The training batch at a data position: the token files' (`--data`, packed
        documents in a permutation per epoch) or the byte corpus's windows."""
        config = self.config
        if self.tokens is not None:
            return self.tokens.batch("train", position, config.batch_size, seed=config.seed, sharding=self.batch_sharding)
        assert corpus is not None
        return self.batch(corpus.train, position)

    def sample(self, model: GPT, prompt: str, length: int) -> str:
        """`length` tokens after `prompt` from `model` (global arrays), decoded: bytes for
        the byte model, the token files' tokenizer with `--data`."""
        config = self.config
        key = jax.random.key(config.seed)
        if self.tokens is None:
            out = sample_text(model, prompt.encode(), length, seq_len=config.seq_len, key=key)
            return bytes(out).decode("utf-8", errors="replace")  # type: ignore[arg-type]
        from ._tokenize import load_tokenizer

        tokenizer = load_tokenizer(self.tokens.train.directory)
        ids = tokenizer.encode(prompt).ids or [0]
        out = sample_text(model, ids, length, seq_len=config.seq_len, key=key, vocab_size=tokenizer.get_vocab_size())
        return tokenizer.decode(list(out))  # type: ignore[arg-type]

    def per_byte(self, val_loss: float) -> dict[str, float]:
        """With `--data`, `{"val_loss_per_byte": ...}`: a loss per token as nats per
        byte of the validation text, comparable with the byte model's (else nothing: the
        byte model's tokens are bytes)."""
        return {} if self.tokens is None else {"val_loss_per_byte": self.tokens.nats_per_byte(val_loss)}

    def data_identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data (to refuse resuming on other data)."""
        return corpus_identity() if self.tokens is None else self.tokens.identity()

    def batch(self, data: np.ndarray, position: int) -> Any:
        """The global batch at a data position (a global sample count).

        In one process, the NumPy batch. Across processes, a global `jax.Array` of which
        this process read only the rows its devices hold (`equishard.train.batch_at`):
        row `j` is sample `position + j` whatever the number of processes. With a
        context axis, the `token_batch` dict (inputs, labels, positions `[B, S]` in
        zigzag order), read row by row the same way.
        """
        config = self.config
        cp = self.layout.size(self.layout.context)
        return batch_at(
            ByteWindows(data, config.seq_len, config.seed), position, config.batch_size,
            seed=config.seed, sharding=self.batch_sharding, shuffle=False,
            transform=None if cp == 1 else functools.partial(token_batch, cp=cp),
        )  # fmt: skip

    def validation_loss(self, state: TrainState, corpus: ByteCorpus | None) -> float:
        """Mean cross-entropy over `eval_batches` fixed validation batches (the token
        files' validation split in order with `--data`, else the byte corpus's)."""
        size = self.config.batch_size

        def batch(i: int) -> Any:
            if self.tokens is not None:
                return self.tokens.batch("val", i * size, size, seed=self.config.seed, sharding=self.batch_sharding)
            assert corpus is not None
            return self.batch(corpus.val, i * size)

        return float(np.mean([float(self.eval_loss(state.model, batch(i))) for i in range(self.config.eval_batches)]))


def sample_text(
    model: GPT, prompt: bytes | list[int], length: int, *, seq_len: int, key: Any, vocab_size: int = 256
) -> bytes | list[int]:
    """Generate `length` bytes after `prompt` with a one-device copy of `model`.

    The cached path (`equishard.models.Generator`, temperature 0.8): the prompt
    prefilled once, then one compiled decode step per byte. The cache holds the prompt
    and every new byte (at least `seq_len` slots): past the training window the rotary
    positions extrapolate.

    **Arguments:**

    - `model`: a `GPT` with global arrays (e.g. `gather(state.model)`), any layout.
    - `prompt`: the bytes to continue (at least one), or a tokenizer's ids.
    - `length`: bytes (tokens) to generate (temperature 0.8 sampling).
    - `seq_len`: the context window the model was trained on.
    - `key`: a PRNG key.
    - `vocab_size`: the tokenizer's vocabulary (ids from it on never drawn; 256: bytes).

    **Returns:**

    The generated bytes (without the prompt), or the ids for a prompt of ids.
    """
    from ..models import Generator, Sampling

    if length < 1:
        return b"" if isinstance(prompt, bytes) else []
    single = to_single_device(model)
    device = next(iter(jax.tree.leaves(eqx.filter(single, eqx.is_array))[0].devices()))
    mesh = Mesh(np.array([device]), ("dp",))
    max_len = max(seq_len, -(-len(prompt) // 16) * 16 + length)
    generator = Generator(single, mesh, max_len=max_len, sampling=Sampling(temperature=0.8), vocab_size=vocab_size)
    out = generator.generate([list(prompt)], max_new_tokens=length, key=key)
    return bytes(out.tokens[0]) if isinstance(prompt, bytes) else list(out.tokens[0])


def plot_losses(rows: list[dict[str, Any]], path: pathlib.Path, title: str | None = None) -> None:
    """Save the train and validation loss curves of `metrics.jsonl` rows as a PNG (at 2x
    resolution, whole-number step ticks, `title` above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    if title:
        ax.set_title(title)
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=240)  # 2x: sharp on high-density screens
    plt.close(fig)


def run(
    config: TrainConfig,
    *,
    print_fn: Callable[[str], None] = print,
    devices: list | None = None,
    clock: Clock = time.perf_counter,
    profile: DeviceProfile | None | str = "auto",
) -> dict[str, Any]:
    """Train as `equishard train` does; return a summary.

    **Arguments:**

    - `config`: the run's options.
    - `print_fn`: where to print (the sharding table, the step log, evaluations, the
      sample).
    - `devices`: the devices to use (default all).
    - `clock`: the timer every duration is measured with (seconds; a test injects one).
    - `profile`: the device profile MFU is measured against: `"auto"` (from the
      devices' kind; none on the CPU), a `DeviceProfile`, or `None` (no MFU).

    **Returns:**

    A dict: `final_loss`, `val_loss`, `steps`, `seconds` (in all), `train_seconds`
    (training steps only), `tokens_per_s` (training tokens over `train_seconds`),
    `timings` (seconds by phase: compile, train, evaluation, checkpoint, export, sample),
    `parameters`, `run_dir`, `sample`.

    **Raises:**

    `EquishardError` subclasses for bad options, layouts, models and checkpoints,
    before anything is compiled or written over.
    """

    start = clock()
    if not is_coordinator():  # one process prints: the others compute the same values
        print_fn = _silent
    with _StopSignals(print_fn) as stop:  # from the start to the end of the run
        return _run_claimed(config, devices, start, print_fn, clock, profile, stop)


def _run_claimed(
    config: TrainConfig, devices: list | None, start: float, print_fn: Callable[[str], None],
    clock: Clock, profile: DeviceProfile | None | str, stop: _StopSignals,
) -> dict[str, Any]:  # fmt: skip
    """`run` from its checks: claim the directories, then `_run_locked`."""
    from ..train._internal import probe_writable

    r = Run(config, devices=devices)
    if profile == "auto":
        profile = device_profile(r.mesh.devices.flat[0].device_kind)
    assert not isinstance(profile, str)
    # The directories are checked before anything is compiled: a checkpoint directory
    # that is a file or read-only is found now, not at the first save.
    run_dir = pathlib.Path(config.run_dir)
    checkpoint_dir = pathlib.Path(config.checkpoint_dir or run_dir / "checkpoints").absolute()
    created = [d for d in (checkpoint_dir, run_dir) if not d.exists()]
    probe_writable(run_dir, "run directory (--run-dir)")
    resuming = config.resume or config.resume_step is not None
    held, marked = None, []

    def mark() -> None:  # once every check has passed: the markers, then the run's files
        if held is not None:
            held.mark()
        marked.append(True)

    try:
        if is_coordinator():  # process 0 holds the run directory for every process
            held = claim(run_dir.absolute(), checkpoint_dir, resume=resuming, overwrite=config.overwrite, print_fn=print_fn)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("equishard run directory claimed")
        if stop.stop():  # before anything is written
            return _stopped_before_start(config, checkpoint_dir, stop, print_fn)
        return _run_locked(r, run_dir, checkpoint_dir, start, print_fn, clock, profile, mark, stop)
    finally:
        if held is not None:
            held.release()
        for directory in created if not marked else ():  # refused before writing: new ones go
            _remove_if_empty(directory)


def _stopped_before_start(
    config: TrainConfig, checkpoint_dir: pathlib.Path, stop: _StopSignals, print_fn: Callable[[str], None]
) -> dict[str, Any]:
    """A stop asked for before the run began: nothing is written. With a checkpoint to
    resume from, that is a clean stop (exit 0); without, nothing was saved.

    **Raises:**

    `TrainingError` (exit 2) when there is no checkpoint to continue from.
    """
    from ..train._internal import committed_steps

    steps = committed_steps(checkpoint_dir) if config.resume or config.resume_step is not None else []
    if not steps:
        raise TrainingError(
            f"received {stop.name} before the run began: nothing was trained, written or "
            f"saved; run the same command again to start it."
        )
    print_fn(
        f"equishard train: received {stop.name} before the run began: nothing was trained; the "
        f"last complete checkpoint is step {steps[-1]} in {checkpoint_dir}; continue with --resume."
    )
    return {"stopped": stop.name, "steps": steps[-1], "run_dir": config.run_dir}


def _run_locked(
    r: Run,
    run_dir: pathlib.Path,
    checkpoint_dir: pathlib.Path,
    start: float,
    print_fn: Callable[[str], None],
    clock: Clock,
    profile: DeviceProfile | None,
    mark: Callable[[], None],
    stop: _StopSignals,
) -> dict[str, Any]:
    """`run` once the run directory is this run's: restore or initialise, then train
    (`mark` writes the directories' markers, once every check has passed)."""
    from ..train import Checkpointer  # orbax, the `train` extra: needed from here on

    config = r.config
    resuming = config.resume or config.resume_step is not None
    # Read (and checked) before anything is compiled: a damaged log is refused now.
    rows = read_metrics(run_dir / METRICS_FILE) if resuming and is_coordinator() else []
    corpus = load_stdlib_corpus() if r.tokens is None else None
    metadata = {
        "model": _architecture(r.model_config),
        "preset": config.model,
        "layout": config.layout,
        "unit_order": r.unit_order(),
        "corpus": r.data_identity(),
    }
    ckpt = Checkpointer(
        checkpoint_dir,
        max_to_keep=config.keep_checkpoints,
        metadata=metadata,
        path_map=canonical_path,
        checksums=config.verify_checkpoints,
    )
    try:
        if not (resuming and not checkpoint_dir.exists()):  # a resume from nothing creates nothing
            ckpt.check_writable()
        resumed = ""
        if resuming:
            changes = _resume_changes(run_dir, config)  # a change of what is trained refused here
            state = _resume(r, ckpt, metadata, print_fn)
            for note in filter(None, [profile_resumed_note(config.profile, config.steps, int(state.step))]):
                print_fn(note)
            saved_layout = ckpt.read_metadata(int(state.step)).get("user", {}).get("layout")
            resumed = (
                f"resumed from step {int(state.step)} of {checkpoint_dir} (data position "
                f"{int(state.data_position)}), saved under layout {saved_layout}"
                + ("" if saved_layout == config.layout else f", resharded to {config.layout}")
            )
            for line in changes:
                print_fn(line)
            rows = [row for row in rows if row["step"] <= int(state.step)]
        else:
            if ckpt.latest_step() is not None:
                raise CheckpointError(
                    f"{checkpoint_dir} already holds checkpoints (latest step "
                    f"{ckpt.latest_step()}); pass --resume to continue that run, or choose "
                    f"another --checkpoint-dir / --run-dir. Nothing was written."
                )
            state = r.init_state()
        mark()
        _write_config(run_dir, config)
        if config.init_from is not None and not resuming and is_coordinator():
            from ._hf import record_hf_source

            record_hf_source(config.init_from, run_dir)  # its config.json and tokenizer, for export
        throughput = Throughput(
            tokens_per_step=config.batch_size * config.seq_len,
            flops_per_token=gpt_flops_per_token(r.model_config, config.seq_len),
            num_devices=r.mesh.devices.size,
            profile=profile,
            dtype=config.dtype,
        )
        log = _Log(rows, run_dir, int(state.step) if resuming else None)
        return _train(r, state, corpus, ckpt, log, start, print_fn, clock, throughput, resumed, stop)
    except BaseException:
        ckpt.close(quiet=True)  # the error in flight is the one to report
        raise
    finally:
        ckpt.close()


def _remove_if_empty(directory: pathlib.Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (another process's files), or gone: left as it is
        pass


def _resume_changes(run_dir: pathlib.Path, config: TrainConfig) -> list[str]:
    """What this resumed run changes against the run directory's `config.toml`."""
    from ._config import CONFIG_FILE, changes_on_resume, load_config

    path = run_dir / CONFIG_FILE
    if not path.exists():
        return []
    try:
        saved = load_config(path)
    except LayerConfigError as err:
        return [f"warning: the run's {CONFIG_FILE} cannot be compared with this run's options: {err}"]
    return changes_on_resume(saved, config)


def _write_config(run_dir: pathlib.Path, config: TrainConfig) -> None:
    """Process 0 writes the resolved options to `<run-dir>/config.toml`, once: a resumed
    run keeps the file its run was started with (`_resume_changes` compares with it)."""
    from ._config import CONFIG_FILE, config_toml

    path = run_dir / CONFIG_FILE
    if is_coordinator() and not (path.exists() or path.is_symlink()):
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, config_toml(config))


_NOT_ARCHITECTURE = ("remat", "remat_offload", "batch_chunks", "fused_loss", "loss_chunk_size")
"""`GPTConfig` fields that change how a step runs, not the parameters: a run may resume
under another rematerialisation policy, number of batch pieces or loss chunking."""


def _with_config_of(template: GPT, loaded: GPT) -> GPT:
    """`loaded`'s arrays in `template`'s structure: the run's `GPTConfig` (its
    rematerialisation, batch pieces, document masking), not the one the loader built
    from `config.json` alone."""
    leaves, template_leaves = jax.tree.leaves(loaded), jax.tree.leaves(template)
    if len(leaves) != len(template_leaves):
        raise CheckpointError(
            f"--init-from: the loaded model has {len(leaves)} arrays and the run's model "
            f"{len(template_leaves)}: they are not one architecture."
        )
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _without_remat(model: Any) -> Any:
    if not isinstance(model, dict):
        return model
    return {k: v for k, v in model.items() if k not in _NOT_ARCHITECTURE}


def _architecture(config: GPTConfig) -> dict[str, Any]:
    """The `GPTConfig` fields a checkpoint's parameters depend on."""
    return _without_remat(dataclasses.asdict(config))


def _resume(r: Run, ckpt: Checkpointer, metadata: dict[str, Any], print_fn: Callable[[str], None]) -> TrainState:
    """The state to continue from: the latest step, or `--resume-step`, checked to fit."""
    config = r.config
    checkpoint_dir = ckpt.directory
    if ckpt.latest_step() is None:
        raise CheckpointError(
            f"--resume: no checkpoint in {checkpoint_dir} to resume from (start "
            f"without --resume, or point --checkpoint-dir at a run's checkpoints)."
        )
    meta = ckpt.read_metadata(config.resume_step)
    saved, step = meta.get("user", {}), int(meta["step"])
    _check_verifiable(meta, ckpt, config, print_fn)
    same_model = _without_remat(saved.get("model")) == metadata["model"]
    if same_model and saved.get("unit_order") != metadata["unit_order"]:
        raise CheckpointError(
            f"the checkpoint in {checkpoint_dir} (layout {saved.get('layout')!r}) "
            f"stores its layers in another order than this layout "
            f"({config.layout!r}, pipeline repeats {config.pipeline_repeats}) does: "
            f"resume a circular-pipeline run with the same pp size and repeats."
        )
    corpus, here = saved.get("corpus"), metadata["corpus"]
    if corpus is not None and corpus != here and ("tokenizer_sha256" in corpus or "tokenizer_sha256" in here):
        raise CheckpointError(
            f"the checkpoint at step {step} in {checkpoint_dir} was trained on other data "
            f"({corpus.get('data', 'the standard library bytes')}, tokenizer sha256 "
            f"{str(corpus.get('tokenizer_sha256'))[:12]}...) than this run's "
            f"({here.get('data', 'the standard library bytes')}, tokenizer sha256 "
            f"{str(here.get('tokenizer_sha256'))[:12]}...): its data positions would index other "
            f"tokens. Resume with the --data the run started with."
        )
    if corpus is not None and corpus != here:
        raise CheckpointError(
            f"the checkpoint at step {step} in {checkpoint_dir} was trained on another corpus "
            f"({corpus.get('files')} files, {corpus.get('bytes')} bytes, sha256 "
            f"{str(corpus.get('sha256'))[:12]}...) than this Python's standard library "
            f"({here['files']} files, {here['bytes']} bytes, sha256 {here['sha256'][:12]}...): "
            f"its data positions would index other text. Resume with the Python that started "
            f"the run."
        )
    state = r.restore(ckpt, config.resume_step)
    if step >= config.steps:  # after the restore: a checkpoint that does not fit says so first
        raise CheckpointError(
            f"--resume: the checkpoint in {checkpoint_dir} is at step {step}, and --steps is "
            f"{config.steps}: nothing is left to train; pass --steps above {step} to train on."
        )
    later = [s for s in ckpt.all_steps() if s > step]
    if later:  # this run would save those steps again, and no checkpoint is written over
        raise CheckpointError(
            f"--resume-step {step}: {checkpoint_dir} also holds later step(s) "
            f"{', '.join(map(str, later))}, which this run would save again, and equishard "
            f"never writes over a checkpoint; move them out of the directory first (keep "
            f"them if they are only suspect), then resume."
        )
    return state


def _check_verifiable(meta: dict[str, Any], ckpt: Checkpointer, config: TrainConfig, print_fn: Callable[[str], None]) -> None:
    """Warn that a step without checksums is restored unverified; refuse it with
    `--require-verified`."""
    if all("checksum" in record for record in meta.get("arrays", [])):
        return
    what = (
        f"the checkpoint at step {meta['step']} in {ckpt.directory} carries no checksums (it "
        f"was saved with --no-verify-checkpoints)"
    )
    if config.require_verified:
        raise CheckpointError(
            f"--require-verified: {what}, so it cannot be verified; resume without "
            f"--require-verified to restore it unverified."
        )
    print_fn(f"warning: {what}: it is restored unverified (--require-verified refuses it).")


class _Rates:
    """The learning rate of each step, computed 1024 steps at a time as the run reaches
    them (a run of billions of steps holds one block)."""

    def __init__(self, schedule: optax.Schedule):
        self._schedule, self._start, self._block = schedule, -1, np.zeros(0)

    def __call__(self, step: int) -> float:
        start = step - step % 1024
        if start != self._start:
            self._start = start
            self._block = np.asarray(jax.vmap(self._schedule)(jnp.arange(start, start + 1024)), np.float64)
        return float(self._block[step - start])


@dataclasses.dataclass
class _Log:
    """The run's metrics: the rows in force (plotted at the end) and the file."""

    rows: list[dict[str, Any]]
    run_dir: pathlib.Path
    resumed_from: int | None


class _StopSignals:
    """SIGTERM, SIGUSR1 (a cluster's preemption notice) and SIGINT (Ctrl-C) ask the run
    to stop at its next safe point: before the next step (so after a compilation, a
    restore, a step, an evaluation or a periodic save), where the step reached is saved,
    or, after the last step, before the model is exported and the sample drawn. Once a
    stop is asked for, further signals cannot interrupt the save that commits it: they
    are reported and ignored. The handlers are installed for the whole run (main thread
    only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, print_fn: Callable[[str], None] = print) -> None:
        self.received: int | None = None
        self.saving: int | None = None  # the step being saved, once a stop is asked for
        self._print = print_fn
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        del frame
        name = signal.Signals(sig).name
        if self.received is None:
            self.received = sig
            line = f"equishard train: stopping ({name}) at the next safe point, saving the step reached..."
        elif self.saving is not None:
            line = (
                f"equishard train: received {name} while saving step {self.saving}: the save "
                f"completes first (signals cannot interrupt it; SIGKILL can, and the previous "
                f"checkpoint is kept)."
            )
        else:
            line = f"equishard train: received {name}: already stopping."
        try:
            self._print(line)
        except RuntimeError:  # the print this signal interrupted holds the stream
            os.write(2, (line + "\n").encode())

    @property
    def name(self) -> str:
        """The signal received, by name."""
        return signal.Signals(self.received).name if self.received is not None else "a stop signal (another process)"

    def stop(self) -> bool:
        """Whether to stop now: in a multi-process run, whether any process was told to
        (every process stops at the same step)."""
        asked = self.received is not None
        if jax.process_count() > 1:
            asked = bool(np.asarray(multihost_utils.process_allgather(np.int32(asked))).any())
        return asked


class _Phases:
    """Seconds spent per phase of a run, measured with one clock."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.seconds = {name: 0.0 for name in ("compile", "train", "evaluation", "checkpoint", "export", "sample")}

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        began = self.clock()
        out = fn()
        self.seconds[name] += self.clock() - began
        return out


def _train(
    r: Run,
    state: TrainState,
    corpus: ByteCorpus | None,
    ckpt: Checkpointer,
    log: _Log,
    start: float,
    print_fn: Callable[[str], None],
    clock: Clock,
    throughput: Throughput,
    resumed: str,
    stop: _StopSignals,
) -> dict[str, Any]:
    config = r.config
    run_dir = log.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    first = int(state.step)
    print_fn(
        f"equishard train: {config.model} GPT, {count_parameters(state.model) / 1e6:.2f} M "
        f"parameters, layout {config.layout} on {r.mesh.devices.size} "
        f"{jax.devices()[0].platform} devices, {config.dtype}"
    )
    print_fn(format_param_table(state.model, r.mesh))
    if resumed:
        print_fn(resumed)
    metrics_path = run_dir / METRICS_FILE
    # Process 0 writes the shared files (metrics, plot, model); every process computes.
    coordinator = is_coordinator()
    rows = log.rows
    # The learning rate each step applies (optax counts updates from 0).
    rates = _Rates(make_schedule(config))
    phases = _Phases(clock)
    val_loss: float | None = None
    loss: float | None = None
    streaks = _Streaks(config, ckpt)
    window = dataclasses.replace(throughput)  # the steps since the last log line
    step_fn = r.train_step
    if first < config.steps and not stop.received:  # a stop asked for already: no compile
        print_fn("compiling the train step...")
        first_batch = r.train_batch(corpus, int(state.data_position))
        step_fn = phases.timed("compile", lambda: r.train_step.compile(state, first_batch))
        print_fn(f"compiled the train step in {phases.seconds['compile']:.1f} s")
    bar = _progress(config, first) if coordinator else None
    board = _tensorboard(config, run_dir, first, print_fn) if coordinator else None

    def emit(line: str) -> None:
        if bar is None:
            print_fn(line)
        else:
            with bar.external_write_mode():
                print_fn(line)

    out = MetricsLog(metrics_path if coordinator else None, log.resumed_from)
    profiler = StepProfiler(profile_steps(config.profile, config.steps), run_dir)
    with out, profiler:
        for step in range(first, config.steps):
            if stop.stop():  # asked during the compilation, the restore or the last step
                break
            began = clock()
            batch = r.train_batch(corpus, int(state.data_position))
            # A skipped step (non-finite loss, gradients or update) is not applied but
            # consumes its batch: the step count and data position advance, and so does
            # a resumed run, from the same saved position.
            profiler.before(step)
            state, metrics = step_fn(state, batch)
            profiler.after(step, metrics)
            values = {k: float(v) for k, v in metrics.items()}  # waits for the step
            seconds = clock() - began
            throughput.add(seconds)
            window.add(seconds)
            phases.seconds["train"] += seconds
            loss = values["loss"]
            row = _step_row(step, values, rates(step), seconds, throughput)
            out.write(row)
            rows.append(row)
            if board is not None:
                board.step(row)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                # The line shows the mean over the steps since the last line.
                logged = {**row, "step_time": window.seconds / window.steps, **window.total()}
                emit(step_line(logged, config.steps))
                window.seconds, window.steps = 0.0, 0
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                val_loss = measured = phases.timed("evaluation", lambda: r.validation_loss(state, corpus))
                val_row = {"step": step + 1, "val_loss": measured, "val_ppl": math.exp(min(measured, 700.0)), **r.per_byte(measured)}
                out.write({**val_row, "time": time.time()})
                rows.append(val_row)
                if board is not None:
                    board.step(rows[-1])
                    board.flush()
                per_byte = f" ({val_row['val_loss_per_byte']:.4f} nats per byte)" if "val_loss_per_byte" in val_row else ""
                emit(f"step {step + 1}: validation loss {val_loss:.4f}{per_byte}")
            streaks.after(step + 1, values, emit)
            ckpt.poll()  # a checkpoint write that failed in the background stops the run
            if bar is not None:
                _advance(bar, loss, val_loss, throughput)
            if (step + 1) % config.checkpoint_every == 0:
                phases.timed("checkpoint", lambda: r.save(ckpt, step + 1, state))
        if bar is not None:
            bar.close()
        if board is not None:
            board.close()

    def final_checkpoint() -> None:  # once a stop is asked for, signals cannot interrupt it
        stop.saving = int(state.step)
        r.save(ckpt, int(state.step), state, exist_ok=True)
        ckpt.wait()
        stop.saving = None

    phases.timed("checkpoint", final_checkpoint)
    if int(state.step) < config.steps:  # stopped by a signal, its step saved
        return _stopped(config, int(state.step), ckpt, stop, print_fn, run_dir)
    return _finish(r, state, rows, phases, throughput, (loss, val_loss), start, clock, print_fn, run_dir, stop)


def _step_row(step: int, values: dict[str, Any], lr: float, seconds: float, throughput: Throughput) -> dict[str, Any]:
    """The `metrics.jsonl` row of step `step + 1`."""
    row = {"step": step + 1, **values, "lr": lr, "step_time": seconds}
    row["tokens"] = throughput.tokens_per_step * (step + 1)
    row.update(throughput.rates(1, seconds))
    memory = peak_memory_bytes()
    if memory is not None:
        row["peak_memory_bytes"] = memory
    row["time"] = time.time()
    return row


def _advance(bar: Any, loss: float, val_loss: float | None, throughput: Throughput) -> None:
    """One step more on the progress bar, with the latest losses and tokens/s."""
    postfix = {"loss": f"{loss:.3f}"}
    if val_loss is not None:
        postfix["val"] = f"{val_loss:.3f}"
    if throughput.steps:
        postfix["tok_s"] = f"{throughput.total()['tokens_per_s']:,.0f}"
    bar.set_postfix(postfix)
    bar.update(1)


def _finish(
    r: Run, state: TrainState, rows: list[dict[str, Any]], phases: Any, throughput: Throughput,
    losses: tuple[float | None, float | None], start: float, clock: Clock,
    print_fn: Callable[[str], None], run_dir: pathlib.Path, stop: _StopSignals,
) -> dict[str, Any]:  # fmt: skip
    """After the last step (saved): the plot, the exported model, a sample, the summary
    lines; a stop asked for skips what is left of them."""
    config = r.config
    coordinator = is_coordinator()
    metrics_path = run_dir / METRICS_FILE
    loss, val_loss = losses
    if stop.stop():
        return _stopped_at_end(config, "the plot, the model export and the sample were", stop, print_fn)
    if config.plot and coordinator:
        title = f"{config.model} GPT, layout {config.layout}, {config.dtype}"
        phases.timed("export", lambda: plot_losses(rows, run_dir / "loss.png", title))
    # The trained network as a plain one-device Equinox model (eqx.tree_serialise_leaves),
    # written an array at a time from the host: never gathered onto one device.
    exported = phases.timed("export", lambda: export_model(to_single_device(state.model), run_dir / "model.eqx"))
    sample = ""
    if config.sample_bytes and stop.stop():
        return _stopped_at_end(config, f"the model is in {exported}; the sample was", stop, print_fn)
    too_large = config.sample_bytes and _too_large_for_one_device(state.model, list(r.mesh.devices.flat))
    if too_large:
        print_fn(f"sample: skipped, {too_large}; `equishard generate --run-dir {run_dir}` samples under the run's layout.")
    elif config.sample_bytes:
        prompt = "def "
        whole = gather(state.model)  # across processes a collective: every process joins
        if coordinator:  # then no collective: process 0 samples alone
            sample = phases.timed("sample", lambda: r.sample(whole, prompt, config.sample_bytes))
        print_fn("sample: " + prompt + sample)
    if stop.received is not None:  # during the sample, which completed
        print_fn(f"equishard train: received {stop.name} during the sample: the run is complete.")
    seconds = clock() - start
    totals = throughput.total()
    if loss is None:  # resumed at the last step: nothing trained, nothing to report
        loss = next((row["loss"] for row in reversed(rows) if "loss" in row), float("nan"))
    val = f", validation loss {val_loss:.4f}" if val_loss is not None else ""
    print_fn(
        f"done: {config.steps} steps, train loss {loss:.4f}{val} nats/{'byte' if r.tokens is None else 'token'}; training "
        f"{rate_summary(totals)} over {throughput.steps} steps"
    )
    print_fn(f"time: {time_summary(phases.seconds, seconds)}")
    print_fn(f"metrics in {metrics_path}, model in {exported}")
    return {
        "final_loss": loss,
        "val_loss": val_loss,
        "steps": config.steps,
        "seconds": seconds,
        "train_seconds": throughput.seconds,
        "tokens_per_s": totals.get("tokens_per_s"),
        "timings": dict(phases.seconds),
        "parameters": count_parameters(state.model),
        "run_dir": str(run_dir),
        "sample": sample,
    }


def _stopped(
    config: TrainConfig, step: int, ckpt: Checkpointer, stop: _StopSignals, print_fn: Callable[[str], None], run_dir: pathlib.Path
) -> dict[str, Any]:
    """The one line a run stopped by SIGTERM or SIGUSR1 ends with, and its summary."""
    name = stop.name
    print_fn(
        f"equishard train: received {name}: stopped after step {step} of {config.steps}, saved "
        f"in {ckpt.directory}; continue with --resume."
    )
    return {"stopped": name, "steps": step, "run_dir": str(run_dir)}


ZERO_GRADIENT_STEPS = 10
"""Consecutive steps whose gradients are exactly zero after which a run warns."""


class _Streaks:
    """Steps in a row that were skipped (an error after `--max-skipped-steps`) or whose
    gradients were exactly zero (a warning after `ZERO_GRADIENT_STEPS`: a loss that does
    not depend on the parameters trains on and learns nothing)."""

    def __init__(self, config: TrainConfig, ckpt: Checkpointer):
        self.config, self.ckpt, self.skipped, self.zero = config, ckpt, 0, 0

    def after(self, step: int, values: dict[str, float], emit: Callable[[str], None]) -> None:
        """Count step `step`'s metrics in.

        **Raises:**

        `TrainingError` after `--max-skipped-steps` skipped steps in a row.
        """
        self.skipped = self.skipped + 1 if values["skipped"] else 0
        if self.skipped >= self.config.max_skipped_steps:
            raise TrainingError(_too_many_skipped(step, self.skipped, values, self.ckpt))
        self.zero = self.zero + 1 if values.get("grad_norm") == 0.0 and not values["skipped"] else 0
        if self.zero == ZERO_GRADIENT_STEPS:
            emit(
                f"warning: the gradients of steps {step - self.zero + 1} to {step} were all exactly "
                f"zero: the loss does not depend on the trained parameters, and the run learns "
                f"nothing (check the loss function and what it reads of the model)."
            )


def _stopped_at_end(config: TrainConfig, skipped: str, stop: _StopSignals, print_fn: Callable[[str], None]) -> dict[str, Any]:
    """The one line a run stopped after its last step ends with, and its summary."""
    checkpoints = config.checkpoint_dir or pathlib.Path(config.run_dir) / "checkpoints"
    print_fn(
        f"equishard train: received {stop.name} after the last step: all {config.steps} steps "
        f"are saved in {checkpoints}; {skipped} skipped; nothing is left to train."
    )
    return {"stopped": stop.name, "steps": config.steps, "run_dir": str(config.run_dir)}


def _too_many_skipped(step: int, count: int, metrics: dict[str, Any], ckpt: Checkpointer) -> str:
    last = ckpt.latest_step()
    resume = f"; the last checkpoint is step {last}" if last is not None else ""
    return (
        f"steps {step - count + 1} to {step} were all skipped ({count} in a row, "
        f"--max-skipped-steps): their loss ({float(metrics['loss']):.4g}), gradient norm "
        f"({float(metrics['grad_norm']):.4g}) or update was not finite, so the parameters "
        f"have not changed since step {step - count}{resume}. Lower --lr, or check the "
        f"model and the data."
    )


def _tensorboard(config: TrainConfig, run_dir: pathlib.Path, first: int, print_fn: Callable[[str], None]) -> Any:
    """The run's TensorBoard writer (with the configuration as text), or `None`."""
    if not config.tensorboard:
        return None
    from ._config import config_toml
    from ._tensorboard import open_tensorboard

    board, note = open_tensorboard(run_dir, first)
    if note is not None:
        print_fn(note)
    elif board is not None and not first:
        board.text("config", config_toml(config))
    return board


def _silent(text: str) -> None:
    del text


def _progress(config: TrainConfig, first: int) -> Any:
    """The progress bar, only where stderr is a terminal: in a scheduler's log file every
    redraw would be kept (the step lines say the same)."""
    if not config.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(
        total=config.steps, initial=first, desc="train", unit="step", file=sys.stderr,
        dynamic_ncols=True,
    )  # fmt: skip
