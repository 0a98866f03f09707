"""LoRA fine-tuning end to end: the `small` GPT's adapters trained by `gpt_training` follow
the one-device curve on four layouts, the base stays bit-identical, the compiled step holds
and computes nothing for the frozen matrices, an adapter checkpoint is refused on another
base, and instruction tuning on `equishard tokenize`'s prompt masks learns from the
completions alone."""

from __future__ import annotations

import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import equishard as es
from equishard._app._tokenize import tokenize
from equishard._errors import CheckpointError
from equishard.models import (
    PRESETS,
    GPTConfig,
    LoRA,
    adapters_trainable,
    gpt_training,
    lora_trainable,
)
from equishard.models._gpt import canonical_path, to_single_device
from equishard.train import IGNORE_LABEL, Checkpointer, TokenFiles, base_fingerprint, pack_windows

from .helpers import dot_result_shapes, one_device_training, tree_bytes

CONFIG = PRESETS["small"]  # d_model 192, 8 heads, 4 layers, d_ff 512, vocabulary 256
QV = LoRA(8, alpha=16.0, targets=("q", "v"))
ALL = LoRA(4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.01)
BATCH, SEQ, STEPS, LONG = 16, 16, 20, 50
# (layout, adapters): q and v on four layouts, all seven targets on fsdp=4,tp=2 (run for
# LONG steps: the base's bit-identity and the compiled-step checks read it).
RUNS = [("dp=8", QV), ("fsdp=8", QV), ("fsdp=4,tp=2", QV), ("pp=2,dp=2,tp=2", QV), ("fsdp=4,tp=2", ALL)]


def _data(step: int):
    """The global batch of a step: the same on every layout."""
    return jax.random.randint(jax.random.key(100 + step), (BATCH, SEQ + 1), 0, CONFIG.vocab_size)


def _plain(model):
    """A sharded GPT as a one-device GPT of plain (unplaced) arrays."""
    model = es.unbox(to_single_device(es.gather(model)))
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if eqx.is_array(x) else x, model)


def _named(model) -> dict[str, np.ndarray]:
    """`{path: host array}` of a model's arrays (boxes looked through)."""
    leaves = jax.tree_util.tree_leaves_with_path(es.unbox(model))
    return {es.sharding.path_str(p): np.asarray(x) for p, x in leaves if eqx.is_array(x)}


@functools.cache
def _training(spec: str, lora: LoRA | None):
    layout = es.Layout(spec).resolve()
    return gpt_training(CONFIG, layout, layout.mesh(), OPTIMIZER, lora=lora)


@functools.cache
def run(spec: str, lora: LoRA):
    """`(losses, initial arrays, final state, compiled step)`: LONG steps with the
    all-targets adapters, STEPS otherwise (the step donates the state it is given)."""
    training = _training(spec, lora)
    state = training.init_state(jax.random.key(0))
    initial = _named(state.model)
    plain0 = _plain(state.model)
    compiled = training.step.compile(state, _data(0))
    losses = []
    for s in range(LONG if lora is ALL else STEPS):
        state, metrics = compiled(state, _data(s))
        losses.append(float(metrics["loss"]))
    return np.array(losses), initial, plain0, state, compiled


@functools.cache
def reference(spec: str, lora: LoRA):
    """Plain JAX and optax on one device, from the initial model of `spec`'s run: the
    adapters trained, the rest constants. The losses of STEPS steps."""
    model = run(spec, lora)[2]
    return one_device_training(model, lora_trainable(model), OPTIMIZER, [_data(s) for s in range(STEPS)])[0]


def _b_factors(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {p: x for p, x in named.items() if ".lora[" in p and p.endswith(".b")}


@pytest.mark.parametrize("spec, lora", RUNS, ids=[f"{s}-{len(l.targets)}" for s, l in RUNS])
def test_lora_follows_the_one_device_curve(spec, lora):
    # The reference starts from dp=8's initial model (q, v) or the layout's own (all
    # seven): initialisation is mesh-invariant up to the compiler's rounding.
    ref = reference("dp=8" if lora is QV else spec, lora)
    losses, initial, _, state, _ = run(spec, lora)
    worst = np.max(np.abs(losses[:STEPS] - ref) / np.abs(ref))
    assert worst <= 1e-5, (spec, worst, losses[:STEPS], ref)
    # The adapters move the loss: B starts at zero (the adapted model is its base) and is
    # non-zero after training; the loss falls.
    b_then, b_now = _b_factors(initial), _b_factors(_named(state.model))
    assert b_then and all(not x.any() for x in b_then.values())
    assert all(np.abs(x).min() > 0 for x in b_now.values())
    assert losses[STEPS - 1] < losses[0] - 0.05, losses  # (each step on another batch)


def test_base_is_bit_identical_after_50_steps():
    _, initial, _, state, _ = run("fsdp=4,tp=2", ALL)
    final = _named(state.model)
    frozen = [p for p in initial if ".lora[" not in p]
    assert len(frozen) == len(initial) - 2 * len(ALL.targets)  # A and B, stacked over the layers
    for p in frozen:
        assert np.array_equal(final[p], initial[p]), p
    assert int(state.step) == LONG


def _tp_local_matrices(model, tp: int) -> set[str]:
    """The shapes `f32[out, in]` of one layer's frozen matrices as the step computes with
    them: split over tp only (FSDP gathers the rest); both orientations. The layers are
    stacked for their scan: a matrix is `[layers, out, in]`."""
    shapes = set()
    for path, box in jax.tree_util.tree_leaves_with_path(model, is_leaf=es.is_sharded):
        p = es.sharding.path_str(path)
        if not es.is_sharded(box) or ".lora[" in p or box.value.ndim < 3 or not p.startswith("units"):
            continue
        dims = [n // (tp if "tp" in (e if isinstance(e, tuple) else (e,)) else 1) for n, e in zip(box.value.shape[-2:], tuple(box.spec)[-2:])]
        shapes |= {f"f32[{dims[0]},{dims[1]}]", f"f32[{dims[1]},{dims[0]}]"}
    return shapes


def _device_bytes(tree) -> int:
    """The bytes of one device's blocks of the arrays of `tree` (the first device's)."""
    arrays = [x for x in jax.tree.leaves(es.unbox(tree)) if eqx.is_array(x)]
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in arrays)


def test_compiled_step_holds_adapter_state_only_and_no_frozen_weight_gradient():
    _, _, _, state, compiled = run("fsdp=4,tp=2", ALL)
    training = _training("fsdp=4,tp=2", None)  # full fine-tuning of the same base
    full_state = training.init_state(jax.random.key(0))
    full = training.step.compile(full_state, _data(0))
    adapters = eqx.filter(state.model, lora_trainable(state.model))
    # AdamW: two moments per adapter array, plus its step count (a scalar).
    scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if eqx.is_array(x) and x.ndim == 0)
    assert tree_bytes(state.opt_state) == 2 * tree_bytes(adapters) + scalars == 2 * 233_472 + 4
    assert tree_bytes(full_state.opt_state) == 2 * tree_bytes(full_state.model) + scalars
    memory, full_memory = compiled.compiled.memory_analysis(), full.compiled.memory_analysis()
    # Per device, the arguments are the state's blocks: they shrink by the base's two
    # moments' blocks, less the adapters and their moments.
    saved = full_memory.argument_size_in_bytes - memory.argument_size_in_bytes
    assert saved == _device_bytes(full_state) - _device_bytes(state), saved
    # and the temporaries by the base's gradients.
    assert memory.temp_size_in_bytes < full_memory.temp_size_in_bytes
    # No dot has a frozen matrix's [out, in] block (under tp=2: q, k, v f32[96, 192], o
    # f32[192, 96], gate, up f32[256, 192], down f32[192, 256]) as its result: no
    # weight-gradient product for any of the seven adapted projections (0 of the LoRA
    # step's 82 dots); the full step has them (7 of its 37 dots).
    frozen_shapes = _tp_local_matrices(state.model, tp=2)
    dots, full_dots = dot_result_shapes(compiled.compiled.as_text()), dot_result_shapes(full.compiled.as_text())
    assert not frozen_shapes & set(dots), frozen_shapes & set(dots)
    assert frozen_shapes <= set(full_dots), frozen_shapes - set(full_dots)
    assert sum(s in frozen_shapes for s in full_dots) == 7
    # The adapters' own gradients are there: A's [r, in] blocks.
    assert "f32[4,192]" in dots


def test_adapter_checkpoint_is_refused_on_another_base(tmp_path):
    _, _, _, state, compiled = run("fsdp=4,tp=2", ALL)
    trainable = adapters_trainable()
    with Checkpointer(tmp_path / "adapters", path_map=canonical_path) as ckpt:
        assert ckpt.save(LONG, state, trainable=trainable, base_source="random:0")
    with Checkpointer(tmp_path / "full", path_map=canonical_path) as ckpt:
        assert ckpt.save(LONG, state)
    sizes = {n: sum(f.stat().st_size for f in (tmp_path / n).rglob("*") if f.is_file()) for n in ("adapters", "full")}
    assert sizes["adapters"] < 0.15 * sizes["full"], sizes  # the small GPT's base is 18x its adapters
    like = eqx.filter_eval_shape(lambda: state)
    restored = Checkpointer(tmp_path / "adapters", path_map=canonical_path).restore(like, mesh=compiled.mesh, base=state.model)
    assert all(np.array_equal(a, b) for a, b in zip(_named(restored.model).values(), _named(state.model).values()))
    fingerprint = base_fingerprint(state.model, trainable, path_map=canonical_path)
    other = eqx.tree_at(lambda m: m.norm.weight.value, state.model, state.model.norm.weight.value * 2)
    with pytest.raises(CheckpointError, match=rf"trained on another base: .*{fingerprint} \(from random:0\).* has [0-9a-f]{{32}} \(from hf:other\)"):
        Checkpointer(tmp_path / "adapters", path_map=canonical_path).restore(like, mesh=compiled.mesh, base=other, base_source="hf:other")


# ----------------------------------------------------------------- instruction tuning

TUNE = GPTConfig(vocab_size=320, d_model=32, n_heads=4, n_layers=2, d_ff=64)
TUNE_SEQ = 24


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> TokenFiles:
    """Prompt/completion records tokenized by `equishard tokenize` (a BPE trained on them)."""
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while the cat sleeps".split()
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(60):
            prompt = "Q: " + " ".join(rng.choice(words, 4)) + "? A:"
            f.write(json.dumps({"prompt": prompt, "completion": " " + " ".join(rng.choice(words, 5))}) + "\n")
    tokenize([root / "chat.jsonl"], root / "tokens", train_bpe_vocab=300, workers=1, progress=False)
    return TokenFiles(root / "tokens", TUNE_SEQ)


@functools.cache
def _tuning():
    layout = es.Layout("dp=8").resolve()
    lora = LoRA(4, targets=("q", "v", "up"))
    training = gpt_training(TUNE, layout, layout.mesh(), optax.sgd(0.1), lora=lora)
    return training, layout


def _nonzero_b(model):
    """`model` with every adapter's B set to small values (so that A gets gradients too)."""
    return jax.tree.map(
        lambda x: eqx.tree_at(lambda a: a.b.value, x, x.b.value + 0.01) if isinstance(x, es.nn.LoRAAdapter) else x,
        model, is_leaf=lambda x: isinstance(x, es.nn.LoRAAdapter),
    )  # fmt: skip


def test_instruction_tuning_learns_from_completions_only(chat):
    training, layout = _tuning()
    rows = np.arange(8)
    batch = chat.read(rows)
    # The files' loss mask: the prompt's tokens are never predicted.
    t1 = TUNE_SEQ + 1
    read = [chat.read_range(0, r * TUNE_SEQ, r * TUNE_SEQ + t1) for r in range(len(rows))]
    windows, masks = np.stack([w for w, _ in read]).astype(np.int64), np.stack([m for _, m in read])
    assert 0 < (masks == 0).mean() < 1
    labelled = batch["labels"] != IGNORE_LABEL
    assert not (labelled & (masks[:, 1:] == 0)).any()  # no prompt token is a label
    # Labels that differ at the prompt's tokens alone (the inputs unchanged), and at one
    # completion token.
    changed = np.where(masks == 0, (windows + 7) % 300, windows)
    assert not ((changed != windows) & np.isin(changed, [t for t in (chat.eot, chat.bos) if t is not None])).any()
    prompt_changed = {**batch, "labels": pack_windows(changed, eot=chat.eot, bos=chat.bos, loss_mask=masks)["labels"]}
    assert np.array_equal(prompt_changed["labels"], batch["labels"])
    unmasked = {**batch, "labels": pack_windows(changed, eot=chat.eot, bos=chat.bos)["labels"]}
    row, col = np.argwhere(labelled)[0]
    completion_changed = {**batch, "labels": batch["labels"].copy()}
    completion_changed["labels"][row, col] = (batch["labels"][row, col] + 1) % 300

    state0 = training.init_state(jax.random.key(0))
    state0 = eqx.tree_at(lambda s: s.model, state0, _nonzero_b(state0.model))
    compiled = training.step.compile(state0, batch)

    def update(b):
        """One step from the same state: its adapters and loss."""
        fresh = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, state0)  # the step donates it
        state, metrics = compiled(fresh, b)
        return _b_and_a(state.model), float(metrics["loss"])

    base, loss = update(batch)
    same, loss_same = update(prompt_changed)
    assert loss_same == loss and all(np.array_equal(x, y) for x, y in zip(base, same))
    for other in (completion_changed, unmasked):
        moved, _ = update(other)
        assert any(not np.array_equal(x, y) for x, y in zip(base, moved))
    # The loss is the mean cross-entropy over the completion tokens alone.
    model = _plain(state0.model)
    h = model.hidden(jnp.asarray(batch["inputs"]), jnp.asarray(batch["document_positions"]), jnp.asarray(batch["segment_ids"]))[0]
    logits = np.asarray(model.logits(h), np.float64)  # [B, T, V]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.where(labelled, batch["labels"], 0)[..., None], axis=-1)[..., 0]
    expected = -picked[labelled].mean()
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)
    del layout


def _b_and_a(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, lora_trainable(model)))]
