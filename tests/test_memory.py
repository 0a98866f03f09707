"""Memory: every parameter of the reference GPT sharded under FSDP."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard._errors import LayerConfigError
from equishard.models import GPT, GPTConfig, abstract_train_step, gpt_report
from equishard.models._gpt import to_single_device
from equishard.nn import remat_policy
from equishard.sharding import Layout, param_table
from equishard.train import init_train_state, make_train_step

from .helpers import assert_tree_allclose

SMALL = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128)
BATCH, SEQ = 8, 32


def _abstract_gpt(config: GPTConfig, layout: Layout):
    par = layout.resolve()
    mesh = jax.sharding.AbstractMesh(par.sizes, par.axes)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(lambda: GPT(config, par, key=jax.random.key(0)))


@pytest.mark.parametrize("spec", ["fsdp=8", "fsdp=4,tp=2"])
def test_fsdp_splits_the_embedding_and_the_head(spec):
    model = _abstract_gpt(SMALL, Layout(spec))
    tp = "tp" if "tp" in spec else None
    # Vocabulary-parallel over tp, fsdp on the other dimension.
    assert model.embed.weight.spec == P(tp, "fsdp")
    assert model.head.weight.spec == P(tp, "fsdp")
    mesh = Layout(spec).mesh()
    for row in param_table(model, mesh):
        if math.prod(row.shape) // (row.shape[0] if row.path.startswith("units") else 1) >= 2**10:
            assert "fsdp" in str(row.spec), row


def test_small_arrays_follow_fsdp_min_weight_size():
    default = _abstract_gpt(SMALL, Layout("fsdp=8"))
    assert default.norm.weight.spec == P(None)  # 64 elements < 2**10
    everything = _abstract_gpt(SMALL, Layout("fsdp=8", fsdp_min_weight_size=0))
    assert everything.norm.weight.spec == P("fsdp")


@functools.cache
def _fsdp8_report():
    return gpt_report(abstract_train_step(
        SMALL, Layout("fsdp=8"), batch_size=BATCH, seq_len=SEQ, optimizer=optax.adamw(1e-3),
        clip_norm=1.0,
    ))  # fmt: skip


def test_fsdp8_holds_an_eighth_of_the_parameters_and_optimizer_state():
    r, _ = _fsdp8_report()
    step = abstract_train_step(
        SMALL, Layout("dp=1"), batch_size=BATCH, seq_len=SEQ, optimizer=optax.adamw(1e-3),
        devices=jax.devices()[:1],
    )  # fmt: skip
    # Parameters and both AdamW moments, whole (one device).
    whole = sum(r.total_bytes for r in param_table((step.state.model, step.state.opt_state), step.mesh))
    assert r.memory is not None
    assert r.memory.argument_bytes <= 1.05 * whole / 8, (r.memory.argument_bytes, whole / 8)
    # The embedding's and head's gathers and reduce-scatters send no more than the
    # all-reduce of their replicated gradients did, and exactly the minimum.
    assert r.ratio == pytest.approx(1.0, rel=1e-6), str(r)


def test_fully_split_gpt_trains_as_on_one_device():
    """fsdp_min_weight_size=0: every array split (the final norm too), tied table."""
    config = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, tied=True)
    batch = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, 256)
    results = []
    for layout in (Layout("dp=1"), Layout("dp=2,fsdp=4", fsdp_min_weight_size=0)):
        par = layout.resolve()
        mesh = par.mesh()  # its own devices: the first 1 or 8
        sgd = optax.sgd(0.5)
        state = init_train_state(lambda k: GPT(config, par, key=k), sgd, jax.random.key(0), mesh=mesh)
        step = make_train_step(lambda m, b, k: m.loss(b, k), sgd, mesh=mesh, batch_spec=par.batch_spec)
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        results.append((jnp.stack(losses), es.gather(state.model).norm.weight.value))
    assert_tree_allclose(results[1], results[0])


# ---------------------------------------------------------------------------
# Rematerialisation policies by name.

REMAT_LAYOUT = Layout("fsdp=2,tp=2", sequence_parallel=True)


@functools.cache
def _remat_losses(remat: str) -> tuple[float, ...]:
    config = dataclasses.replace(SMALL, remat=remat)
    mesh = REMAT_LAYOUT.mesh(jax.devices()[:4])
    adamw = optax.adamw(3e-3)
    state = init_train_state(
        lambda k: GPT(config, REMAT_LAYOUT.resolve(4), key=k), adamw, jax.random.key(0), mesh=mesh
    )
    step = make_train_step(
        lambda m, b, k: m.loss(b, k), adamw, mesh=mesh, batch_spec=REMAT_LAYOUT.resolve(4).batch_spec
    )
    losses = []
    for i in range(5):
        batch = jax.random.randint(jax.random.key(i), (BATCH, SEQ + 1), 0, SMALL.vocab_size)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return tuple(losses)


@pytest.mark.parametrize("remat", ["full", "dots", "minimal", "minimal_with_context"])
def test_each_remat_policy_gives_the_losses_of_none(remat):
    reference = _remat_losses("none")
    assert reference[-1] < reference[0]
    for a, b in zip(_remat_losses(remat), reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (remat, a, b)


def test_remat_policies_refuse_what_they_cannot_do():
    with pytest.raises(LayerConfigError, match="remat='some'.*minimal_with_context"):
        remat_policy("some")
    with pytest.raises(LayerConfigError, match="only the named policies"):
        remat_policy("full", offload=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(LayerConfigError, match="not on the CPU"):
            GPT(dataclasses.replace(SMALL, remat="minimal", remat_offload=True), key=jax.random.key(0))



# ---------------------------------------------------------------------------
# The blocks run on pieces of the batch (`batch_chunks`).

CHUNKS_LAYOUT = Layout("dp=2,tp=4", sequence_parallel=True)


def _chunked_run(batch_chunks: int, optimizer, steps: int):
    config = dataclasses.replace(SMALL, remat="minimal_with_context", batch_chunks=batch_chunks)
    mesh = CHUNKS_LAYOUT.mesh(jax.devices()[:8])
    state = init_train_state(
        lambda k: GPT(config, CHUNKS_LAYOUT.resolve(8), key=k), optimizer, jax.random.key(0), mesh=mesh
    )
    step = make_train_step(
        lambda m, b, k: m.loss(b, k), optimizer, mesh=mesh, batch_spec=CHUNKS_LAYOUT.resolve(8).batch_spec
    )
    # The parameters, whole (the models differ in their static config only).
    params = lambda m: es.unbox(es.gather((m.embed, m.units, m.norm, m.head)))  # noqa: E731
    before = params(state.model)
    losses = []
    for i in range(steps):
        batch = jax.random.randint(jax.random.key(i), (BATCH, SEQ + 1), 0, SMALL.vocab_size)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return before, params(state.model), losses


def test_batch_chunks_give_the_losses_and_gradients_of_one_piece():
    clip_adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    _, _, reference = _chunked_run(1, clip_adamw, 3)
    _, _, losses = _chunked_run(2, clip_adamw, 3)
    assert reference[-1] < reference[0]
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    # The gradients: one SGD step of rate 1 moves each parameter by minus its gradient.
    # (Not AdamW's parameters: its first steps move a parameter by about the rate times
    # the sign of its gradient, and a gradient at roundoff level may change sign.)
    sgd = optax.sgd(1.0)
    grads = {}
    for chunks in (1, 2):
        before, after, _ = _chunked_run(chunks, sgd, 1)
        grads[chunks] = jax.tree.map(jnp.subtract, before, after)
    assert_tree_allclose(grads[2], grads[1])


def test_batch_chunks_send_the_same_bytes_and_hold_fewer_temporaries_on_tp():
    from equishard.report import collective_bytes, memory_stats, read_collectives

    layout = Layout("tp=8", sequence_parallel=True)
    measured = {}
    for chunks in (1, 2):
        config = dataclasses.replace(MEASURED, n_heads=8, remat="minimal_with_context", batch_chunks=chunks)
        step = abstract_train_step(
            config, layout, batch_size=8, seq_len=128, optimizer=optax.adamw(1e-3), clip_norm=1.0
        )
        compiled = step.lowered.compile()
        memory = memory_stats(compiled)
        assert memory is not None
        measured[chunks] = (memory.argument_bytes, memory.temp_bytes, collective_bytes(read_collectives(compiled)))
    (args1, temps1, sent1), (args2, temps2, sent2) = measured[1], measured[2]
    assert args2 == args1 and sent2 == sent1, measured
    assert temps2 < temps1, measured


def test_batch_chunks_refuse_what_they_cannot_do():
    with pytest.raises(LayerConfigError, match="batch_chunks=0 must be at least 1"):
        GPT(dataclasses.replace(SMALL, batch_chunks=0), key=jax.random.key(0))
    with pytest.raises(LayerConfigError, match="batch_chunks=2 with MoE layers"):
        GPT(dataclasses.replace(SMALL, batch_chunks=2, moe_every=2, num_experts=4), key=jax.random.key(0))
    with pytest.raises(LayerConfigError, match="batch_chunks=2 with a pipeline axis"):
        _abstract_gpt(dataclasses.replace(SMALL, batch_chunks=2), Layout("pp=2"))
    model = GPT(dataclasses.replace(SMALL, batch_chunks=3), key=jax.random.key(0))
    with pytest.raises(LayerConfigError, match="4 examples does not split into batch_chunks=3"):
        model.loss(jnp.zeros((4, SEQ + 1), jnp.int32))
    # The one-device copy (export, sampling) runs any batch: one example too.
    single = to_single_device(model)
    assert single.config.batch_chunks == 1
    assert single(jnp.zeros((1, SEQ), jnp.int32)).shape == (1, SEQ, SMALL.vocab_size)


# ---------------------------------------------------------------------------
# The analytical memory report beside the compiler's.

MEASURED = GPTConfig(vocab_size=1024, d_model=128, n_heads=4, n_layers=4, d_ff=512)


@functools.cache
def _memory_report(remat: str, n_layers: int):
    r, _ = gpt_report(abstract_train_step(
        dataclasses.replace(MEASURED, remat=remat, n_layers=n_layers), Layout("dp=2,tp=4"), batch_size=8,
        seq_len=128, optimizer=optax.adamw(1e-3), clip_norm=1.0,
    ))  # fmt: skip
    assert r.memory is not None and r.estimate is not None
    return r.memory, r.estimate


def _saved_beyond_full(remat: str, n_layers: int) -> tuple[int, int]:
    """(compiled, analytical) bytes the policy keeps beyond `full` at this depth."""
    full, _ = _memory_report("full", n_layers)
    memory, estimate = _memory_report(remat, n_layers)
    return memory.temp_bytes - full.temp_bytes, estimate.saved_activations[remat]


@pytest.mark.parametrize("remat", ["minimal", "minimal_with_context"])
def test_analytical_memory_is_near_the_compilers(remat):
    # What the policy saves, measured as what two more layers cost the compiled step
    # beyond `full`: the working set of the layer being recomputed is the same at every
    # depth and cancels, where a single depth's difference would count how the policy's
    # schedule of that one layer differs from `full`'s (RMSNorm's own backward pass
    # shrinks `full`'s by one activation, not the others'). XLA 0.10 and 0.12 both hold
    # exactly the analytical saved sets (1.875 MiB for `minimal`, 2 MiB with context, per
    # two layers); the analytical figure is the upper bound.
    deep, shallow = MEASURED.n_layers, MEASURED.n_layers - 2
    (measured_deep, analytical_deep), (measured_shallow, analytical_shallow) = (
        _saved_beyond_full(remat, deep), _saved_beyond_full(remat, shallow)
    )
    measured, analytical = measured_deep - measured_shallow, analytical_deep - analytical_shallow
    assert 0 < measured <= 1.05 * analytical, (analytical, measured)
    memory, estimate = _memory_report(remat, MEASURED.n_layers)
    total = memory.argument_bytes + memory.temp_bytes
    assert abs(estimate.total - total) <= 0.20 * total, (estimate.total, total)
    assert abs(estimate.arguments - memory.argument_bytes) <= 0.01 * memory.argument_bytes
    # AdamW: two moments like the parameters, and a step count.
    assert estimate.gradients == estimate.parameters
    assert 0 <= estimate.optimizer_state - 2 * estimate.parameters <= 16
