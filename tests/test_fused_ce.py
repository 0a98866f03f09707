"""The fused linear cross-entropy (`equishard.core.fused_linear_cross_entropy`,
`equishard.nn.fused_cross_entropy`): values and gradients against the plain cross-entropy
of the full logits on tp = 1, 2, 4 (with its options: ignore_index, z-loss, label
smoothing, soft-capping; bf16), the argmax accuracy, the global view, the reference GPT
(FSDP, sequence parallelism, the pipeline's last stage) against its unfused loss on one
device, and the compiled program: no array larger than one chunk's logits."""

from __future__ import annotations

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import fused_linear_cross_entropy
from equishard.models import GPT, GPTConfig
from equishard.nn import ColumnParallelLinear, fused_cross_entropy
from equishard.sharding import Layout

from .helpers import BF16_RTOL, FP32_RTOL, assert_tree_allclose, check_against_single_device

B, T, D, V, CHUNK, IGNORE = 2, 20, 16, 64, 8, -100
OPTIONS = {
    "plain": {},
    "ignore": {"ignore_index": IGNORE},
    "z_loss": {"z_loss": 1e-2},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 2.0},
}


def problem(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 3)
    head = ColumnParallelLinear(D, V, bias=False, gather_output=False, key=k[0])
    head = eqx.tree_at(lambda m: m.weight.value, head, jnp.asarray(head.weight.value).astype(dtype))
    h = jax.random.normal(k[1], (B, T, D), dtype)
    labels = jax.random.randint(k[2], (B, T), 0, V)
    # Some ignored tokens, one whole row among them on the last example.
    labels = labels.at[0, :3].set(IGNORE).at[B - 1, T // 2].set(IGNORE)
    return head, h, labels


def plain_sums(z, labels, ignore_index=None, z_loss=0.0, label_smoothing=0.0, softcap=None):
    """The per-row loss sums of the full logits `z` `[..., T, V]` (the oracle)."""
    z = z.astype(jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    valid = labels != IGNORE if ignore_index is not None else jnp.ones(labels.shape, bool)
    safe = jnp.where(valid, labels, 0)
    lse = jax.nn.logsumexp(z, axis=-1)
    ce = lse - jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    loss = (1 - label_smoothing) * ce + label_smoothing * (lse - jnp.mean(z, axis=-1)) + z_loss * lse**2
    return jnp.sum(jnp.where(valid, loss, 0.0), axis=-1)


def fused_sums(head, h, labels, axis_name="tp", **options):
    """Per-row loss sums of the fused loss, one call per local row."""
    rows = [
        fused_cross_entropy(h[i], head.weight, labels[i], axis_name, chunk_size=CHUNK, **options).loss
        for i in range(h.shape[0])
    ]
    return jnp.stack(rows)


def apply(head, inputs):
    h, labels = inputs["h"], jnp.where(inputs["labels"] == IGNORE, 0, inputs["labels"])
    out = {n: fused_sums(head, h, labels, **o) for n, o in OPTIONS.items() if n != "ignore"}
    return {**out, "ignore": fused_sums(head, h, inputs["labels"], ignore_index=IGNORE)}


def reference(head, inputs):
    h, labels = inputs["h"], inputs["labels"]
    z = jnp.einsum("btd,vd->btv", h, es.unbox(head.weight))
    safe = jnp.where(labels == IGNORE, 0, labels)
    out = {n: plain_sums(z, safe, **o) for n, o in OPTIONS.items() if n != "ignore"}
    return {**out, "ignore": plain_sums(z, labels, ignore_index=IGNORE)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_cross_entropy_equals_the_plain_one(dtype):
    """Values and gradients (of the hidden states and the split weight) on tp = 1, 2, 4
    (with data parallelism), every option, fp32 ≤ 1e-5 and bf16 ≤ 1e-2."""
    head, h, labels = problem(dtype)
    inputs = {"h": es.Sharded(h, P("dp")), "labels": es.Sharded(labels, P("dp"))}
    fp32 = dtype == jnp.float32
    layouts = ["dp=1,tp=1", "dp=2,tp=2", "dp=2,tp=4"] if fp32 else ["dp=2,tp=4"]
    # The sums are float32 either way; in bf16 their logits are rounded to bf16.
    check_against_single_device(
        head, apply, inputs, layouts, out_specs={n: P("dp") for n in OPTIONS}, reference=reference,
        rtol=FP32_RTOL if fp32 else BF16_RTOL,
    )  # fmt: skip


def test_tokens_and_accuracy_count_as_the_plain_argmax():
    """`tokens` skips the ignored labels; `correct` is the argmax's, on tp = 4 as on one device."""
    head, h, labels = problem()
    weight = es.unbox(head.weight)
    z = jnp.einsum("btd,vd->btv", h, weight)
    # Half the labels the argmax, so that `correct` counts something.
    labels = jnp.where(jnp.arange(T) % 2 == 0, jnp.argmax(z, axis=-1), labels)
    labels = labels.at[0, :3].set(IGNORE)
    valid = labels != IGNORE
    expect_correct = int(jnp.sum((jnp.argmax(z, axis=-1) == labels) & valid))
    mesh = es.make_mesh("tp=4")

    def body(h, weight, labels):
        return fused_linear_cross_entropy(h, weight, labels, "tp", chunk_size=CHUNK, ignore_index=IGNORE)

    sums = jax.jit(es.filter_shard_map(body, mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=P()))(
        h, weight, labels
    )
    assert int(sums.tokens) == int(valid.sum())
    assert int(sums.correct) == expect_correct > 0
    assert_tree_allclose(sums.cross_entropy, jnp.sum(plain_sums(z, labels, ignore_index=IGNORE)))


def test_global_view_keeps_the_vocabulary_split():
    """`fused_cross_entropy(..., mesh=...)` in a plain jit program: the mean and its gradients
    equal one device's, and the compiled program gathers no weight rows over tp."""
    head, h, labels = problem()
    weight = es.unbox(head.weight)
    mesh = es.make_mesh("dp=2,tp=4")

    def mean(h, weight, mesh=None):
        sums = fused_cross_entropy(h, weight, labels, "tp", mesh=mesh, chunk_size=CHUNK, ignore_index=IGNORE)
        return sums.loss / sums.tokens

    fn = jax.jit(jax.value_and_grad(functools.partial(mean, mesh=mesh), argnums=(0, 1)))
    got = fn(h, weight)
    want = jax.value_and_grad(lambda h, w: jnp.sum(plain_sums(jnp.einsum("btd,vd->btv", h, w), labels, IGNORE)) / jnp.sum(labels != IGNORE), argnums=(0, 1))(h, weight)  # noqa: E501
    assert_tree_allclose(got, want)
    text = fn.lower(h, weight).compile().as_text()
    assert text is not None
    # No all-gather produces the whole f32[V, D] weight.
    assert not re.search(rf"f32\[{V},{D}\]\S* all-gather", text)


def _largest_array(text: str) -> int:
    """The most elements any instruction of a compiled HLO text produces."""
    sizes = [int(np.prod([int(x) for x in m.group(1).split(",") if x]))
             for m in re.finditer(r"= \w+\[([0-9,]*)\]", text)]  # fmt: skip
    return max(sizes)


def test_no_array_larger_than_one_chunk_of_logits():
    """The compiled value and gradient hold no array bigger than chunk × V/n (nor the
    inputs): tp = 1 and tp = 2, many chunks."""
    n, d, vocab, chunk = 512, 8, 256, 16
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(k[0], (n, d))
    weight = jax.random.normal(k[1], (vocab, d))
    labels = jax.random.randint(k[2], (n,), 0, vocab)
    for tp in (1, 2):
        mesh = es.make_mesh(f"tp={tp}")

        def body(h, weight, labels):
            def loss(h, weight):
                return fused_linear_cross_entropy(h, weight, labels, "tp", chunk_size=chunk).loss

            return jax.value_and_grad(loss, argnums=(0, 1))(h, weight)

        fn = es.filter_shard_map(body, mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=(P(), (P(), P("tp"))))
        text = jax.jit(fn).lower(h, weight, labels).compile().as_text()
        assert text is not None
        assert _largest_array(text) <= max(chunk * vocab // tp, n * d, vocab * d), tp
        assert n * vocab // tp > 4 * chunk * vocab // tp  # the whole logits would be far larger


# The reference GPT: its fused loss against its unfused loss on one device.
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, loss_chunk_size=16)


@functools.cache
def _single(tied: bool):
    config = dataclasses.replace(CONFIG, tied=tied, fused_loss=False)
    model = GPT(config, key=jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG.vocab_size)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: m.loss(batch)[0]))(model)
    return batch, loss, grads


def _tail(grads):
    """The gradients every layout's GPT shares the structure of: embedding, norm, head."""
    return jax.tree.leaves(es.unbox(es.gather((grads.embed, grads.norm, grads.head))))


@pytest.mark.parametrize(
    "spec, tied, kw",
    [
        ("fsdp=2,tp=4", True, {}),
        ("dp=2,tp=4", False, {"sequence_parallel": True}),
        ("pp=2,tp=2,dp=2", True, {"pipeline_schedule": "1f1b"}),
    ],
)
def test_gpt_fused_loss_equals_the_unfused_one(spec, tied, kw):
    """The GPT's loss and the gradients of its embedding, norm and head under FSDP, with
    sequence parallelism and on the pipeline's last stage (1F1B) equal the unfused loss's
    on one device."""
    batch, loss, grads = _single(tied)
    layout = Layout(spec, **kw)
    mesh = layout.mesh()
    config = dataclasses.replace(CONFIG, tied=tied)
    model = es.sharded_init(lambda k: GPT(config, layout.resolve(), key=k), jax.random.key(0), mesh=mesh)

    def body(model, batch):
        return eqx.filter_value_and_grad(lambda m: m.loss(batch)[0])(model)

    fn = es.filter_shard_map(body, mesh=mesh, in_specs=(None, layout.resolve().batch_spec), out_specs=(P(), None))
    got_loss, got_grads = eqx.filter_jit(fn)(model, batch)
    assert_tree_allclose(got_loss, loss)
    assert_tree_allclose(_tail(got_grads), _tail(grads))
