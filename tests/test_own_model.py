"""A user's own model, written in plain Equinox, trained by equishard unchanged.

The model below is what a researcher writes without equishard: Llama-style blocks
(`eqx.nn.Linear` attention with grouped-query heads, rotary embeddings, SwiGLU,
`eqx.nn.Dropout` on the attention weights and the residual, an untied head). Every
layout must give the one-device losses: data parallel and FSDP, with dropout on and
with micro-batches.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.core import example_keys
from equishard.train import init_train_state, make_train_step

from .helpers import jit_once, rel_err

VOCAB, DIM, HEADS, KV_HEADS, FF, LAYERS = 64, 64, 4, 2, 128, 1
BATCH, SEQ, STEPS = 16, 16, 10


def rope(x):
    """Rotary position embedding of `x: f32[S, H, h]`."""
    seq, _, h = x.shape
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, h, 2) / h))
    angles = jnp.arange(seq)[:, None] * freqs[None, :]  # [S, h/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Attention(eqx.Module):
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, dim, n_heads, n_kv_heads, *, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        head = self.head_dim = dim // n_heads
        self.wq = eqx.nn.Linear(dim, n_heads * head, use_bias=False, key=kq)
        self.wk = eqx.nn.Linear(dim, n_kv_heads * head, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(dim, n_kv_heads * head, use_bias=False, key=kv)
        self.wo = eqx.nn.Linear(n_heads * head, dim, use_bias=False, key=ko)
        self.dropout = eqx.nn.Dropout(0.1)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads

    def __call__(self, x, *, key):  # x: f32[S, D], one example
        seq, head = x.shape[0], self.head_dim
        q = rope(jax.vmap(self.wq)(x).reshape(seq, self.n_heads, head))
        k = rope(jax.vmap(self.wk)(x).reshape(seq, self.n_kv_heads, head))
        v = jax.vmap(self.wv)(x).reshape(seq, self.n_kv_heads, head)
        k = jnp.repeat(k, self.n_heads // self.n_kv_heads, axis=1)
        v = jnp.repeat(v, self.n_heads // self.n_kv_heads, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(head)
        causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
        weights = self.dropout(jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1), key=key)
        return jax.vmap(self.wo)(jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, -1))


class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    attn: Attention
    mlp_norm: eqx.nn.RMSNorm
    w1: eqx.nn.Linear
    w2: eqx.nn.Linear
    w3: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, *, key):
        ka, k1, k2, k3 = jax.random.split(key, 4)
        self.attn_norm, self.mlp_norm = eqx.nn.RMSNorm(DIM), eqx.nn.RMSNorm(DIM)
        self.attn = Attention(DIM, HEADS, KV_HEADS, key=ka)
        self.w1 = eqx.nn.Linear(DIM, FF, use_bias=False, key=k1)
        self.w2 = eqx.nn.Linear(FF, DIM, use_bias=False, key=k2)
        self.w3 = eqx.nn.Linear(DIM, FF, use_bias=False, key=k3)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, *, key):
        ka, kd = jax.random.split(key)
        x = x + self.attn(jax.vmap(self.attn_norm)(x), key=ka)
        h = jax.vmap(self.mlp_norm)(x)
        gated = jax.nn.silu(jax.vmap(self.w1)(h)) * jax.vmap(self.w3)(h)
        return x + self.dropout(jax.vmap(self.w2)(gated), key=kd)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, *, key):
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=ke)
        self.blocks = [Block(key=k) for k in jax.random.split(kb, LAYERS)]
        self.norm = eqx.nn.RMSNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=kh)

    def __call__(self, tokens, *, key):  # int[S] -> f32[S, V]
        x = jax.vmap(self.embed)(tokens)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# ---------------------------------------------------------------------------


def loss_for(data_axes, *, unbox=False):
    """The loss a user writes: per-example keys from the global example indices."""

    def loss_fn(model, batch, key, *, index):
        keys = example_keys(key, index)  # one key per global example
        model = es.unbox(model) if unbox else model  # path-ruled: arrays in boxes
        logits = jax.vmap(model)(batch[:, :-1], key=keys)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return jax.lax.pmean(ce, data_axes), {}

    return loss_fn


def fsdp_policy(path, module):
    """One FSDP unit per block, and the embedding and the head each one too."""
    return isinstance(module, Block) or path in ("embed", "head")


@functools.cache
def _llama():
    """The model `init_train_state(lambda k: Llama(key=k), ..., jax.random.key(0))`
    builds, initialised once in one compiled program (eagerly, op by op, it takes
    longer; optimised, its random-number kernels do); every test starts from it.

    (Its norms' biases start at zero, and LAMB's trust ratio, the ratio of an array's
    norm to its update's, scales a roundoff-sized difference of such an array's first
    steps up: from `jax.random.key(0)` directly, the first norm's bias differs by
    2.5e-5 between one device and fsdp=4,tp=2 after 10 LAMB steps, every loss within
    3.3e-7, every other array within 8.5e-7.)"""
    return jit_once(lambda k: Llama(key=jax.random.fold_in(k, 0)))(jax.random.key(0))


@functools.cache
def _batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]


PLAN = {
    r"embed": "vocab",
    r"blocks\[\d+\]\.attn": es.nn.HeadParallel("n_heads", "n_kv_heads", dropout_dim=0),
    r"blocks\[\d+\]\.(attn\.w[qkv]|w[13])": "column",
    r"blocks\[\d+\]\.(attn\.wo|w2)": "row",
    r"head": es.nn.ColwiseParallel(gather_output=True),
}


def probe(model):
    """The plan's probe forward: one sequence, dropout on."""
    return model(_batches()[0][0, :-1], key=jax.random.key(1))


@functools.cache
def _built(layout):
    """`_llama()` for `layout`, as a fine-tuning run builds it from a checkpoint:
    tensor parallel by `PLAN` on a tp axis (its probe run once per layout). Every
    layout starts from the same arrays, and none compiles its own initialisation (the
    random-number kernels take seconds to compile on XLA:CPU)."""
    mesh = es.make_mesh(layout)
    model = _llama()
    return es.parallelize(model, PLAN, mesh, probe=probe) if "tp" in mesh.axis_names else model


def make_model(layout):
    """`make_model(key)` for `init_train_state` on `layout`: `_built(layout)`, with FSDP
    units on an fsdp axis."""
    built = _built(layout)  # outside the trace of `make`

    def make(key):
        del key  # the arrays are `_llama()`'s
        if "fsdp" in es.parse_layout(layout):
            return es.nn.fsdp_wrap(built, "fsdp", policy=fsdp_policy)
        return built

    return make


# Adam's eps at 1e-6 (LAMB's default): with 1e-8 an element whose gradient is within
# roundoff of zero still moves by a whole +-lr, its sign set by the roundoff, and the
# final parameters differ by up to 1.1e-5 per array (measured on fsdp=4,tp=2, and
# 1.6e-5 between two one-device runs that only sum their micro-batches differently)
# while every loss agrees to 2.2e-7. With 1e-6: 1.1e-6 at most.
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(3e-3, eps=1e-6),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, eps=1e-6)),
    "lamb": lambda: optax.lamb(3e-3),
    "adafactor": lambda: optax.adafactor(3e-3, min_dim_size_to_factor=32),
}
TRANSFORMS = {**OPTIMIZERS, "sgd": lambda: optax.sgd(0.1)}


@functools.cache
def _train(layout, *, grad_accum=1, optimizer="adamw"):
    """Ten steps of `layout` with `TRANSFORMS[optimizer]`: the final state, the losses,
    the gradient norms and the compiled step (cached: tests share each compiled step
    and its run; `.compiled` is the program, for its collectives)."""
    mesh = es.make_mesh(layout)
    axes = tuple(mesh.axis_names)
    transform = TRANSFORMS[optimizer]()
    make = make_model(layout)
    state = init_train_state(make, transform, jax.random.key(0), mesh=mesh)
    data = tuple(a for a in axes if a in ("dp", "fsdp"))
    step = make_train_step(
        loss_for(data),
        transform,
        mesh=mesh,
        batch_spec=P(data),
        grad_accum=grad_accum,
    ).compile(state, _batches()[0])
    losses, norms = [], []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return state, losses, norms, step


def tp_rules(fsdp):
    """Megatron's split by path rules: q, k, v, gate and up by rows (output features),
    o and down by columns; `fsdp` (or `None`) on the other dimension."""
    return [
        (r"attn\.w[qkv]\.weight|\.w[13]\.weight|head\.weight", P("tp", fsdp)),
        (r"attn\.wo\.weight|\.w2\.weight", P(fsdp, "tp")),
        (r"embed\.weight", P(fsdp, None)),
    ]


def _train_global(layout, *, grad_accum=1):
    """Tensor parallelism without editing the model: path rules and the global view."""
    mesh = es.make_mesh(layout)
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    optimizer = OPTIMIZERS["adamw"]()  # the reference run's
    ruled = es.apply_rules(_llama(), tp_rules(fsdp))
    state = init_train_state(lambda k: ruled, optimizer, jax.random.key(0), mesh=mesh)
    data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))
    step = make_train_step(
        loss_for((), unbox=True),
        optimizer,
        mesh=mesh,
        batch_spec=P(data),
        grad_accum=grad_accum,
        view="global",
    )
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _reference():
    return _train("dp=1")[:2]


@pytest.mark.parametrize(
    "layout, tolerance", [("dp=8", 1e-6), ("fsdp=8", 1e-6), ("dp=4,tp=2", 1e-5), ("fsdp=4,tp=2", 1e-5)]
)
def test_a_plain_model_with_dropout_and_micro_batches_trains_as_on_one_device(layout, tolerance):
    """Data parallel, FSDP, and tensor parallel by `parallelize` (the model's code as
    written), all with dropout on and two micro-batches."""
    _, reference = _reference()
    losses = _train(layout, grad_accum=2)[1]
    assert reference[-1] < reference[0]  # it learns
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert rel_err(a, b) <= tolerance, (layout, step, a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optax_transform_trains_a_plain_model_as_on_one_device(name):
    """Global-norm clipping, LAMB's per-array trust ratio and adafactor's factored
    moments read whole arrays; the update runs on the global arrays, so on FSDP and on
    FSDP with tensor parallelism by a plan (dropout on; two micro-batches there) every
    step's loss and the final parameters equal the one-device run's."""
    reference, ref_losses, ref_norms, _ = _train("dp=1", optimizer=name)
    if name == "clip+adamw":
        assert max(ref_norms) > 0.5  # the clipping acts
    theirs = jax.tree.leaves(eqx.filter(es.unbox(reference.model), eqx.is_inexact_array))
    for layout, grad_accum in (("fsdp=8", 1), ("fsdp=4,tp=2", 2)):
        state, losses, _, _ = _train(layout, grad_accum=grad_accum, optimizer=name)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert rel_err(a, b) <= 1e-6, (name, layout, step, a, b)
        # FSDP units and parallel layers change the tree's classes, not its arrays.
        # Parameters: equality per array (1e-5), as test_train's optimizers; measured
        # up to 1.13e-6 on fsdp=4,tp=2 (clip+adamw), the losses within 1e-6 above.
        ours = jax.tree.leaves(eqx.filter(es.unbox(es.gather(state.model)), eqx.is_inexact_array))
        errors = [rel_err(a, b) for a, b in zip(ours, theirs, strict=True)]
        assert max(errors) <= 1e-5, (name, layout, max(errors))


@pytest.mark.parametrize("layout", ["dp=4,tp=2"])  # fsdp=4,tp=2: the guide's example
def test_tensor_parallel_by_path_rules_in_the_global_view(layout):
    _, reference = _reference()
    _, losses = _train_global(layout, grad_accum=2)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert rel_err(a, b) <= 1e-5, (layout, step, a, b)


def test_the_global_view_refuses_explicit_axes():
    mesh = es.make_mesh("dp=4,tp=2", axis_types=jax.sharding.AxisType.Explicit)
    with pytest.raises(es.LayerConfigError, match="needs a mesh of Auto axes"):
        make_train_step(loss_for(()), optax.sgd(0.1), mesh=mesh, batch_spec=P("dp"), view="global")


def test_dropout_keys_belong_to_the_example():
    """The keys of the examples a device holds are the one-device keys of those
    examples: the mask of example 5 is the same on one device and on dp=8."""
    key = jax.random.key(3)
    mesh = es.make_mesh("dp=8")
    local = es.filter_shard_map(
        lambda x: jax.random.key_data(example_keys(key, es.core.global_index(x.shape[0], "dp"))),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P("dp"),
    )(jnp.zeros((16,)))
    one = jax.random.key_data(example_keys(key, jnp.arange(16)))
    np.testing.assert_array_equal(np.asarray(local), np.asarray(one))


def test_fsdp_splits_most_of_a_plain_models_bytes_by_default():
    mesh = es.make_mesh("fsdp=8")
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    plain = _llama()
    with use_mesh(mesh):
        model = es.nn.fsdp_wrap(plain, "fsdp", policy=fsdp_policy)
    split = total = 0
    for leaf in jax.tree.leaves(model, is_leaf=es.is_sharded):
        value = leaf.value if es.is_sharded(leaf) else leaf
        if eqx.is_array(value):
            total += value.nbytes
            split += value.nbytes if es.is_sharded(leaf) and "fsdp" in str(leaf.spec) else 0
    assert split >= 0.9 * total, (split, total)


def test_fsdp_warns_when_it_leaves_most_bytes_replicated():
    mesh = es.make_mesh("fsdp=8")
    with pytest.warns(UserWarning, match="splits 0 of the"):
        es.nn.FSDP(eqx.nn.Linear(4, 4, key=jax.random.key(0)), "fsdp", mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        es.nn.FSDP(eqx.nn.Linear(64, 64, key=jax.random.key(0)), "fsdp", mesh=mesh)


def test_fsdp_wrap_refuses_a_policy_that_selects_nothing():
    with pytest.raises(es.LayerConfigError, match="selects no module"):
        es.nn.fsdp_wrap(_llama(), "fsdp", policy=eqx.nn.Conv1d, mesh=es.make_mesh("fsdp=8"))


def test_a_path_rule_that_matches_nothing_warns_or_raises():
    model = _llama()
    rules = [(r"blocks\[\d+\]\.attn\.wq\.weight", P("tp")), (r"blocks\[\d+\]\.atn\.wo\.weight", P(None, "tp"))]
    with pytest.warns(UserWarning, match=r"atn\\\\.wo"):
        ruled = es.apply_rules(model, rules)
    assert ruled.blocks[0].attn.wq.weight.spec == P("tp", None)
    with pytest.raises(es.SpecError, match="match no array path"):
        es.apply_rules(model, rules, strict=True)


def inspect_factory(layout):
    """What `equishard inspect --model tests.test_own_model:inspect_factory` compiles."""
    data = tuple(a for a in es.parse_layout(layout) if a in ("dp", "fsdp"))
    wrap = (lambda m: es.nn.fsdp_wrap(m, "fsdp", policy=fsdp_policy)) if "fsdp" in data else (lambda m: m)
    return {
        "make_model": lambda k: wrap(Llama(key=k)),
        "loss_fn": loss_for(data),
        "batch": _batches()[0],
        "batch_spec": P(data),
    }


def test_inspect_reports_a_users_own_model(capsys):
    from equishard._cli import main

    assert main(["inspect", "--model", "tests.test_own_model:inspect_factory", "--layout", "fsdp=8"]) == 0
    out = capsys.readouterr().out
    assert "tests.test_own_model:inspect_factory; layout fsdp=8 on 8 CPU devices" in out
    table = out.split("Collectives per step")[1]
    assert re.search(r"all-gather +fsdp +8", table) and re.search(r"reduce-scatter +fsdp +8", table)
    assert "blocks[0].module.attn.wq.weight" in out  # the per-parameter table


def test_unbox_of_gather_gives_back_the_plain_model():
    """An FSDP-wrapped (and a path-ruled) model comes back as the model it was written
    as, callable on one device with the same output."""
    mesh = es.make_mesh("fsdp=8")
    original = _llama()
    wrapped = es.sharded_init(lambda k: es.nn.fsdp_wrap(original, "fsdp", policy=fsdp_policy), jax.random.key(0), mesh=mesh)
    ruled = es.shard(es.apply_rules(original, tp_rules("fsdp")[:1] + [(r"attn\.wo", P("fsdp"))]), es.make_mesh("fsdp=4,tp=2"))
    tokens, key = _batches()[0][0, :-1], jax.random.key(1)
    call = jit_once(lambda m: m(tokens, key=key))
    want = call(original)
    for model in (wrapped, ruled):
        plain = es.unbox(es.gather(model))
        assert jax.tree.structure(plain) == jax.tree.structure(original)
        assert rel_err(call(plain), want) <= 1e-6


def _fsdp8_step_collectives(name):
    """The collectives of the compiled train step of the Llama on fsdp=8 (the one the
    optimizer tests ran), and its state."""
    from equishard.report import read_collectives

    state, _, _, step = _train("fsdp=8", optimizer=name)
    return read_collectives(step.compiled), state


def test_the_adamw_update_sends_nothing():
    """The update runs on the global arrays, laid out as the parameters: an elementwise
    transform adds no collective, so an adamw step sends exactly the bytes of an sgd
    step (the gradient phase's)."""
    from equishard.report import collective_bytes

    adamw, _ = _fsdp8_step_collectives("adamw")
    sgd, _ = _fsdp8_step_collectives("sgd")
    for kind in {op.kind for op in adamw} | {op.kind for op in sgd}:
        assert collective_bytes(op for op in adamw if op.kind == kind) == collective_bytes(
            op for op in sgd if op.kind == kind
        ), kind


def test_vmap_outside_fsdp_units_gathers_once_per_batch():
    """The loss `vmap`s the model over the examples (and the model its embedding and
    head over the positions), outside its FSDP units: each unit's parameters are
    gathered once per step (forward and backward re-gather), and their gradients
    reduce-scattered once, not once per example."""
    from equishard.report import collective_bytes

    ops, state = _fsdp8_step_collectives("sgd")
    split = sum(
        leaf.value.nbytes
        for leaf in jax.tree.leaves(state.model, is_leaf=es.is_sharded)
        if es.is_sharded(leaf) and "fsdp" in str(leaf.spec)
    )
    gathered = collective_bytes(op for op in ops if op.kind == "all-gather")
    scattered = collective_bytes(op for op in ops if op.kind == "reduce-scatter")
    # Forward and backward gather each split array once per step (4.3x that before);
    # each gradient is summed over the examples, then reduce-scattered once: the ring
    # minimum 7/8 of the split bytes (measured 5x that before).
    assert gathered <= 2 * 7 / 8 * split, (gathered, split)
    assert scattered == 7 / 8 * split, (scattered, split)


def test_dropout_on_a_tp_split_activation_draws_the_one_device_mask():
    """`bernoulli_block` on a block of features split over tp is that block of the
    one-device mask."""
    key = jax.random.key(5)
    mesh = es.make_mesh("dp=2,tp=4")
    blocks = es.filter_shard_map(
        lambda x: es.core.bernoulli_block(key, 0.7, x.shape, axis_name="tp", dim=-1),
        mesh=mesh,
        in_specs=P(None, "tp"),
        out_specs=P(None, "tp"),
    )(jnp.zeros((6, 32)))
    np.testing.assert_array_equal(np.asarray(blocks), np.asarray(jax.random.bernoulli(key, 0.7, (6, 32))))


# --- parallelize: the plan's checks and round trips ------------------------------------


class ScaledHeads(eqx.Module):
    """Attention-like scores whose head size comes from `head_from`: a field, a layer's
    global features, or the local array."""

    wq: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)
    head_from: str = eqx.field(static=True)

    def __init__(self, head_from, *, key):
        kq, ko = jax.random.split(key)
        self.wq, self.wo = eqx.nn.Linear(16, 16, key=kq), eqx.nn.Linear(16, 16, key=ko)
        self.n_heads, self.head_from = 4, head_from

    def __call__(self, x):  # f32[S, 16]
        q = jax.vmap(self.wq)(x)
        head = {"field": 4, "layer": int(self.wq.out_features) // self.n_heads, "local": q.shape[-1] // self.n_heads}
        q = q.reshape(x.shape[0], self.n_heads, head[self.head_from])
        q = q / jnp.sqrt(jnp.sum(q * q, axis=-1, keepdims=True) + head[self.head_from])
        return jax.vmap(self.wo)(q.reshape(x.shape[0], -1))


class Holder(eqx.Module):
    attn: eqx.Module


HEADS_PLAN = {r"attn": es.nn.HeadParallel("n_heads"), r"attn\.wq": "column", r"attn\.wo": "row"}


def _probe_x(model):
    return model.attn(jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16))


def test_parallelize_probe_accepts_head_sizes_from_fields_and_local_shapes():
    mesh = es.make_mesh("dp=4,tp=2")
    for head_from in ("field", "local"):
        model = Holder(ScaledHeads(head_from, key=jax.random.key(0)))
        es.parallelize(model, HEADS_PLAN, mesh, probe=_probe_x)


def test_parallelize_probe_refuses_what_the_plan_cannot_fix():
    mesh = es.make_mesh("dp=4,tp=2")
    # A head size from the layer's global features next to the divided head count.
    model = Holder(ScaledHeads("layer", key=jax.random.key(0)))
    with pytest.raises(es.LayerConfigError, match="probe forward of the parallelised model fails"):
        es.parallelize(model, HEADS_PLAN, mesh, probe=_probe_x)
    # The head count not divided: shapes fit, the heads are other heads.
    model = Holder(ScaledHeads("local", key=jax.random.key(0)))
    plan = {r"attn\.wq": "column", r"attn\.wo": "row"}
    with pytest.raises(es.LayerConfigError, match="differs from the one-device model"):
        es.parallelize(model, plan, mesh, probe=_probe_x)


def test_parallelize_checks_its_plan():
    mesh = es.make_mesh("dp=2,tp=4")
    model = _llama()
    with pytest.raises(es.LayerConfigError, match="n_kv_heads = 2, not divisible by the size 4"):
        es.parallelize(model, PLAN, mesh)
    with pytest.raises(es.LayerConfigError, match=r"`embed` \(Embedding\) the style ColwiseParallel"):
        es.parallelize(model, {"embed": "column"}, mesh)
    with pytest.raises(es.LayerConfigError, match="no integer field of that name"):
        es.parallelize(model, {r"blocks\[0\]\.attn": es.nn.HeadParallel("heads")}, mesh)
    typo = {**PLAN, r"blocks\[\d+\]\.atn\.wo": "row"}
    with pytest.warns(UserWarning, match=r"atn\\\\.wo.*match no module path"):
        es.parallelize(model, typo, es.make_mesh("dp=4,tp=2"))
    with pytest.raises(es.SpecError, match="match no module path"):
        es.parallelize(model, typo, es.make_mesh("dp=4,tp=2"), strict=True)


def test_sequence_parallel_styles_refuse_a_model_that_vmaps_over_tokens():
    """Megatron's sequence parallelism gathers the tokens in the column layers and
    scatters them in the row layers; a model that calls its layers one token at a time
    (`jax.vmap(self.wq)(x)`, as `eqx.nn.Linear` needs) hides the token dimension, and a
    layer under that `vmap` cannot change how many tokens it returns. The plan's probe
    says so instead of failing in XLA."""
    sp_plan = {
        r"embed": es.nn.EmbeddingParallel("vocab", sequence_parallel=True),
        r"blocks\[\d+\]\.(attn_norm|mlp_norm)|norm": "sequence_parallel",
        r"blocks\[\d+\]\.attn": es.nn.HeadParallel("n_heads", "n_kv_heads", dropout_dim=0),
        r"blocks\[\d+\]\.(attn\.w[qkv]|w[13])": es.nn.ColwiseParallel(sequence_parallel=True),
        r"blocks\[\d+\]\.(attn\.wo|w2)": es.nn.RowwiseParallel(sequence_parallel=True),
        r"head": es.nn.ColwiseParallel(gather_output=True),
    }
    model = _llama()
    with pytest.raises(es.LayerConfigError, match=r"ParallelEmbedding: sequence_parallel=True needs the token dimension.*shape \(\)"):
        es.parallelize(model, sp_plan, es.make_mesh("dp=4,tp=2"), probe=probe)
    # A column layer called token by token inside shard_map: the same refusal.
    layers = es.parallelize(model, {r"blocks\[0\]\.w1": es.nn.ColwiseParallel(sequence_parallel=True)}, es.make_mesh("dp=4,tp=2"))
    with pytest.raises(es.LayerConfigError, match="ColumnParallelLinear: sequence_parallel=True needs the token dimension"):
        es.filter_shard_map(lambda m, x: jax.vmap(m.blocks[0].w1)(x), mesh=es.make_mesh("dp=4,tp=2"), in_specs=(None, P("tp")), out_specs=P())(layers, jnp.zeros((16, DIM)))


def test_parallelize_a_built_model_inside_init_train_state():
    """A model built beforehand (a checkpoint's arrays) and parallelised inside
    `make_model`, under `init_train_state`'s trace: the probe still runs on the concrete
    arrays (its programs are called, their inputs placed eagerly, not traced)."""
    mesh = es.make_mesh("dp=4,tp=2")
    model = _llama()
    state = init_train_state(lambda k: es.parallelize(model, PLAN, mesh, probe=probe), optax.sgd(0.1), jax.random.key(0), mesh=mesh)
    for a, b in zip(jax.tree.leaves(es.unbox(es.gather(state.model))), jax.tree.leaves(model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_parallelize_keeps_paths_and_unbox_gives_the_original_classes():
    mesh = es.make_mesh("dp=4,tp=2")
    original = _llama()
    model = es.parallelize(original, PLAN, mesh)
    assert isinstance(model.blocks[0].attn.wq, es.nn.ColumnParallelLinear)
    assert isinstance(model.blocks[0].w2, es.nn.RowParallelLinear)
    assert isinstance(model.embed, es.nn.ParallelEmbedding)
    paths = lambda m: [es.sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(m, is_leaf=es.is_sharded)[0]]  # noqa: E731
    assert paths(model) == paths(original)
    placed = es.shard(model, mesh)
    back = es.unbox(es.gather(placed))
    assert jax.tree.structure(back) == jax.tree.structure(original)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(original)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_parallelize_multihead_attention_first_class():
    """`eqx.nn.MultiheadAttention` needs one entry: its projections and head count follow."""
    mesh = es.make_mesh("dp=4,tp=2")
    model = Holder(eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0)))
    x = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
    parallel = es.parallelize(model, {"attn": "heads"}, mesh, probe=lambda m: m.attn(x, x, x))
    assert isinstance(parallel.attn.output_proj, es.nn.RowParallelLinear)
    back = es.unbox(parallel)
    assert type(back.attn) is eqx.nn.MultiheadAttention and back.attn.num_heads == 4
    with pytest.raises(es.LayerConfigError, match="leave dropout_dim out"):
        es.parallelize(model, {"attn": es.nn.HeadParallel(dropout_dim=0)}, mesh)

    class OwnCall(eqx.nn.MultiheadAttention):
        def __call__(self, query, key_, value, mask=None, *, key=None):
            return super().__call__(query, key_, value, mask, key=key)

    # A subclass with its own call splits its key by the local head count: refused.
    own = Holder(OwnCall(4, 16, dropout_p=0.1, key=jax.random.key(0)))  # pyright: ignore[reportCallIssue]
    with pytest.raises(es.LayerConfigError, match="with its own __call__\\) with dropout_p=0.1"):
        es.parallelize(own, {"attn": "heads"}, mesh)


@pytest.mark.parametrize("layout", ["dp=4,tp=2", "dp=2,tp=4"])
def test_multihead_attention_dropout_draws_the_one_device_masks(layout):
    """With `dropout_p > 0` each head draws its one-device mask on every layout (the
    key is split over the global heads, each device takes its heads' keys), and a
    per-head mask `[heads, q, kv]` is sliced the same way: outputs and input gradients
    equal the one-device ones."""
    mesh = es.make_mesh(layout)
    attn = eqx.nn.MultiheadAttention(4, 16, dropout_p=0.3, key=jax.random.key(0))
    model = Holder(attn)
    x = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
    key = jax.random.key(7)
    heads_mask = jax.random.bernoulli(jax.random.key(2), 0.8, (4, 8, 8)).at[:, :, 0].set(True)

    def run(m, x):
        def loss(m, x):
            out = m.attn(x, x, x, key=key) + m.attn(x, x, x, heads_mask, key=jax.random.fold_in(key, 1))
            return jnp.sum(jnp.sin(out)), out

        (_, out), g_x = jax.value_and_grad(loss, argnums=1, has_aux=True)(m, x)
        return out, g_x

    parallel = es.parallelize(model, {"attn": "heads"}, mesh, probe=lambda m: m.attn(x, x, x, key=key))
    want = jit_once(run)(model, x)
    got = jit_once(es.filter_shard_map(run, mesh=mesh, out_specs=P()))(parallel, x)
    assert rel_err(want[0], jit_once(lambda m: m.attn(x, x, x, inference=True))(model)) > 0.1  # dropout is on
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6, layout


def test_unbox_of_gather_gives_plain_one_device_layers():
    """Every equishard layer and wrapper, gathered and unboxed, computes on one device
    what it computes with its boxes; parallel layers made by `parallelize` come back as
    Equinox's own classes, a pipeline as the `eqx.nn.Sequential` of its layers."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (2, 8, 16))
    ids = jnp.arange(16).reshape(2, 8)
    nn = es.nn
    # Initialised in one compiled program (eagerly, op by op, it takes longer).
    built = jit_once(
        lambda key: [
            nn.ColumnParallelLinear(16, 24, stride=3, lora_rank=2, key=key),
            nn.RowParallelLinear(16, 32, key=key),
            nn.ParallelEmbedding(16, 32, partition="vocab", lora_rank=2, padding_idx=0, key=key),
            nn.TransformerBlock(16, 4, 32, key=key),
            nn.MoE(16, 32, 4, 2, group_size=8, key=key),
            nn.ColumnParallelLinear(16, 32, key=key),  # to wrap in FSDP below
        ]
    )(key)
    fsdp = nn.FSDP(built.pop(), "fsdp", mesh=es.make_mesh("fsdp=8"), min_weight_size=1)
    call = jit_once(lambda m, a: m(a))
    for layer, inputs in zip([*built, fsdp], [x, x, ids, x, x, x]):
        plain = es.unbox(es.gather(layer))
        assert not any(es.is_sharded(leaf) for leaf in jax.tree.leaves(plain, is_leaf=es.is_sharded))
        want, got = call(layer, inputs), call(plain, inputs)
        assert rel_err(jax.tree.leaves(got)[0], jax.tree.leaves(want)[0]) <= 1e-6, type(layer).__name__

    # A pipeline over pp=2: its one-device model is its layers in order.
    mesh = es.make_mesh("dp=2,pp=2,tp=2")
    pipe = es.shard(
        jit_once(
            lambda k: nn.PipelineModule(lambda kk: nn.TransformerBlock(16, 4, 32, key=kk), "pp", 2, num_layers=4, num_stages=2, key=k)
        )(key),
        mesh,
    )
    run = es.filter_shard_map(
        lambda p, h: es.core.from_last_stage(p(h), "pp"), mesh=mesh, in_specs=(None, P("dp")), out_specs=P("dp")
    )
    xs = jax.random.normal(key, (8, 4, 16))
    plain = es.unbox(es.gather(pipe))
    assert isinstance(plain, eqx.nn.Sequential) and len(plain.layers) == 4
    assert rel_err(call(plain, xs), jit_once(run)(pipe, xs)) <= 1e-5
