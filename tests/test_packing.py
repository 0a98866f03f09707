"""Packed documents through the reference GPT: document masking on every layout, the
flag that turns it off, and the data sources' order and per-process reading."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.models import GPT, GPTConfig
from equishard.models._gpt import _attach_tokens, _detach_tokens
from equishard.models._internal import to_single_device
from equishard.train import IGNORE_LABEL, pack_windows

from .helpers import assert_tree_allclose

EOT = 0
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64)
BATCH, SEQ = 4, 16


@functools.cache
def _windows() -> np.ndarray:
    """int32[B, SEQ + 1]: token ids in [1, 64) with end-of-text tokens between documents
    of 1 to 9 tokens (and one row that is a single document)."""
    rng = np.random.default_rng(0)
    w = rng.integers(1, CONFIG.vocab_size, size=(BATCH, SEQ + 1))
    for row in range(BATCH - 1):
        w[row, rng.choice(SEQ, size=3, replace=False)] = EOT
    return w.astype(np.int32)


def _per_document_loss(model: GPT, batch: dict[str, np.ndarray]) -> float:
    """The token-weighted mean cross-entropy of the batch's documents, each run alone
    through the one-device model: at the start of a row of its own (from position 0),
    padded after its end, which a causal model's earlier tokens do not see."""
    docs, labels = [], []
    for ids, lab, segments in zip(batch["inputs"], batch["labels"], batch["segment_ids"]):
        for s in np.unique(segments):
            n = int((segments == s).sum())
            docs.append(np.pad(ids[segments == s], (0, SEQ - n)))
            labels.append(np.pad(lab[segments == s], (0, SEQ - n), constant_values=IGNORE_LABEL))
    logits = eqx.filter_jit(lambda m, x: m.logits(m.hidden(x)[0]))(model, jnp.asarray(np.stack(docs)))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # f32[docs, SEQ, V]
    lab = np.stack(labels)
    keep = lab != IGNORE_LABEL
    picked = jnp.take_along_axis(logp, jnp.asarray(np.where(keep, lab, 0))[..., None], axis=-1)[..., 0]
    return float(-jnp.sum(jnp.where(jnp.asarray(keep), picked, 0.0)) / keep.sum())


@functools.cache
def _reference() -> tuple[GPT, float]:
    model = GPT(CONFIG, key=jax.random.key(0))
    return model, _per_document_loss(model, pack_windows(_windows(), eot=EOT))


def _loss_and_grads(spec: str, config: GPTConfig = CONFIG, **layout_kw):
    layout = es.Layout(spec, **layout_kw)
    mesh, par = layout.mesh(), layout.resolve()
    model = es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(0), mesh=mesh)
    batch = pack_windows(_windows(), eot=EOT, cp=par.size(par.context))

    def body(model, batch):
        return eqx.filter_value_and_grad(lambda m: m.loss(batch)[0])(model)

    step = es.filter_shard_map(body, mesh=mesh, in_specs=(None, layout.resolve().batch_spec), out_specs=(P(), None))
    loss, grads = eqx.filter_jit(step)(model, batch)
    return float(loss), grads


def test_pack_windows_boundaries():
    w = np.array([[5, 6, EOT, 7, 8, 9, EOT, 3, 4]])
    b = pack_windows(w, eot=EOT)
    assert b["labels"].tolist() == [[6, EOT, IGNORE_LABEL, 8, 9, EOT, IGNORE_LABEL, 4]]
    assert b["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert b["document_positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # A beginning-of-text token starts a document too; a loss mask hides prompt tokens.
    b = pack_windows(np.array([[1, 5, 6, 1, 7]]), eot=EOT, bos=1, loss_mask=np.array([[0, 0, 1, 0, 1]]))
    assert b["segment_ids"].tolist() == [[0, 0, 0, 1]]
    assert b["labels"].tolist() == [[IGNORE_LABEL, 6, IGNORE_LABEL, 7]]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64])
def test_pack_windows_takes_the_token_files_dtypes(dtype):
    # Token files hold uint16 or uint32 ids; the ignored labels must not wrap round to 65535.
    w = np.array([[5, 6, EOT, 7, 8, 9, EOT, 3, 4]])
    want = pack_windows(w.astype(np.int32), eot=EOT)
    got = pack_windows(w.astype(dtype), eot=EOT)
    assert {k: v.dtype for k, v in got.items()} == {k: np.dtype(np.int32) for k in want}
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert (got["labels"] == IGNORE_LABEL).sum() == 2


def test_packed_loss_is_the_per_document_loss_on_one_device():
    model, per_doc = _reference()
    packed = pack_windows(_windows(), eot=EOT)
    loss = float(eqx.filter_jit(lambda m, b: m.loss(b)[0])(model, packed))
    assert abs(loss - per_doc) <= 1e-5 * abs(per_doc)
    # The blocks run on the batch in two pieces: each piece's segment ids go with it.
    chunked = GPT(dataclasses.replace(CONFIG, batch_chunks=2), key=jax.random.key(0))
    loss = float(eqx.filter_jit(lambda m, b: m.loss(b)[0])(chunked, packed))
    assert abs(loss - per_doc) <= 1e-5 * abs(per_doc)


def test_document_masking_flag_turns_off_attention_across_boundaries():
    model, per_doc = _reference()
    packed = pack_windows(_windows(), eot=EOT)
    off = GPT(dataclasses.replace(CONFIG, document_masking=False), key=jax.random.key(0))
    loss_off = float(eqx.filter_jit(lambda m, b: m.loss(b)[0])(off, packed))
    # Off: the packed rows are attended to as one text (the plain causal model on the
    # inputs, global positions), with the same masked labels.
    logits = model.logits(model.hidden(jnp.asarray(packed["inputs"]))[0])
    logp = jax.nn.log_softmax(logits, axis=-1)
    keep = packed["labels"] != IGNORE_LABEL
    picked = jnp.take_along_axis(logp, jnp.asarray(np.where(keep, packed["labels"], 0))[..., None], axis=-1)[..., 0]
    plain = float(-jnp.sum(jnp.where(jnp.asarray(keep), picked, 0.0)) / keep.sum())
    assert abs(loss_off - plain) <= 1e-5 * abs(plain)
    assert abs(loss_off - per_doc) > 1e-3 * abs(per_doc)


@pytest.mark.parametrize(
    "spec, layout_kw",
    [
        ("dp=2", {}),
        ("tp=2", {"sequence_parallel": True}),
        ("dp=2,cp=2", {"cp_impl": "ring"}),
        ("cp=2", {"cp_impl": "alltoall"}),
        ("fsdp=2,tp=2", {}),
        ("pp=2", {}),
        ("dp=2,pp=2", {"pipeline_schedule": "1f1b"}),
    ],
)
def test_packed_loss_on_layouts(spec, layout_kw):
    model, per_doc = _reference()
    loss, grads = _loss_and_grads(spec, **layout_kw)
    assert abs(loss - per_doc) <= 1e-5 * abs(per_doc), (loss, per_doc)
    ref_grads = _one_device_grads()
    # The same global arrays (the models differ only in their static layout).
    leaves = lambda g: jax.tree.leaves(eqx.filter(es.unbox(es.gather(g)), eqx.is_array))  # noqa: E731
    assert_tree_allclose(leaves(to_single_device(es.gather(grads))), leaves(ref_grads))


@functools.cache
def _one_device_grads():
    model, _ = _reference()
    packed = pack_windows(_windows(), eot=EOT)
    return eqx.filter_jit(eqx.filter_grad(lambda m, b: m.loss(b)[0]))(model, packed)


def test_pipeline_carries_positions_and_segments_exactly_in_any_float_dtype():
    rng = np.random.default_rng(0)
    pos, seg = (jnp.asarray(rng.integers(0, 2**24, (2, 16)), jnp.int32) for _ in range(2))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        carried = _attach_tokens(jnp.ones((2, 4, 8), dtype), pos, seg)[..., 8:]  # t = T / 4 (sp)
        back = _detach_tokens(carried)
        assert carried.dtype == dtype and all(bool((a == b).all()) for a, b in zip(back, (pos, seg)))
