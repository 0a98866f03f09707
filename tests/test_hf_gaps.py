"""What issue 49 left open: a pipeline-of-FSDP checkpoint restoring under another layout,
training on a padded vocabulary, the end-of-run model written one array at a time, and
each process of a 2-process load reading only its own share of the files."""

import dataclasses
import pathlib
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.models import GPT, GPTConfig, export_hf, load_hf
from equishard.models._internal import canonical_path, to_single_device
from equishard.train import Checkpointer

from .helpers import rel_err

SMALL = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=48)


def _gpt(layout: str, config: GPTConfig = SMALL, seed: int = 0, **layout_kw):
    resolved = es.Layout(layout, **layout_kw).resolve()
    mesh, par = resolved.mesh(), resolved
    return es.sharded_init(lambda k: GPT(config, par, key=k), jax.random.key(seed), mesh=mesh), mesh


class Held(eqx.Module):
    """The model where a run's train state holds it (its paths `model.units...`)."""

    model: GPT


def _single(model):
    return [np.asarray(x) for x in jax.tree.leaves(to_single_device(es.gather(model)))]


def test_a_pipeline_of_fsdp_checkpoint_restores_under_dp(tmp_path):
    model, _ = _gpt("pp=2,fsdp=2,tp=2")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert any(".units.layers.unit.module." in p for p in paths)  # a pipeline of FSDP units
    assert not any(".units.module." in canonical_path(p) or ".layers.unit." in canonical_path(p) for p in paths)
    with Checkpointer(tmp_path / "ckpt", path_map=canonical_path) as ckpt:
        ckpt.save(1, Held(model))
    like, mesh = _gpt("dp=8", seed=1)
    with Checkpointer(tmp_path / "ckpt", path_map=canonical_path) as ckpt:
        restored = ckpt.restore(eqx.filter_eval_shape(lambda: Held(like)), mesh=mesh).model
    want, got = _single(model), _single(restored)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


PAGES_CHILD = '''
import json, os, sys
from equishard.distributed import initialize
initialize()  # join the other process, before any JAX computation
import jax, numpy as np
import equishard as es
from equishard.train import _safetensors

pages, through_preadv, returned = set(), [0], [0]
real_preadv, make_reader = os.preadv, _safetensors._reader
def preadv(fd, buffers, offset):
    got = real_preadv(fd, buffers, offset)
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    pages.update((name, p) for p in range(offset // 4096, (offset + got + 4095) // 4096))
    through_preadv[0] += got
    return got
os.preadv = preadv
def counting(infos):
    read = make_reader(infos)
    def wrapped(name, index):
        out = read(name, index)
        returned[0] += out.nbytes
        return out
    return wrapped
_safetensors._reader = counting

from equishard.models import load_hf
layout = es.Layout("fsdp=8")
model = load_hf(sys.argv[2], layout.resolve(), layout.mesh())
held = 0
for leaf in jax.tree.leaves(model):
    held += sum({tuple((i.start, i.stop) for i in s.index): s.data.nbytes for s in leaf.addressable_shards}.values())
mine = {f"{p}:{n}": float(np.asarray(s.data).sum()) for p, leaf in enumerate(jax.tree.leaves(model)) for s in leaf.addressable_shards for n in [str(s.index)]}
print("RESULT", json.dumps({"process": jax.process_index(), "pages": sorted(map(list, pages)), "held": held,
                            "preadv": through_preadv[0], "returned": returned[0], "sums": mine}))
'''


def test_two_processes_read_disjoint_pages_of_column_split_weights(tmp_path):
    """fsdp=8 over 2 processes splits every weight over its columns (half of each row to
    each process): the pages each process reads (`os.preadv`, wrapped) are its own
    share of the files, at most 1.05x its blocks' bytes, barely any page read by both."""
    from .test_hf_llama import _launch_two

    config = GPTConfig(vocab_size=1024, d_model=256, n_heads=4, n_kv_heads=4, n_layers=2, d_ff=512, norm_eps=1e-5)
    model, mesh = _gpt("dp=8", config)
    export_hf(model, str(tmp_path / "hf"), max_shard_bytes=2 * 2**20)  # several files
    results = sorted(_launch_two(tmp_path, PAGES_CHILD, str(tmp_path / "hf")), key=lambda r: r["process"])
    page_sets = [{tuple(p) for p in r["pages"]} for r in results]
    for r, pages in zip(results, page_sets):
        assert r["preadv"] == r["returned"], r["preadv"]  # every byte read by position
        assert len(pages) * 4096 <= 1.05 * r["held"], (len(pages) * 4096, r["held"])
    # Shared: the pages at the ends of each process's share of a tensor, and tensors
    # smaller than a page (the norms).
    assert len(page_sets[0] & page_sets[1]) * 4096 <= 0.05 * results[0]["held"]
    # The blocks are the model's.
    layout = es.Layout("fsdp=8")
    again = load_hf(str(tmp_path / "hf"), layout.resolve(), layout.mesh())
    want = {f"{p}:{s.index}": float(np.asarray(s.data).sum()) for p, leaf in enumerate(jax.tree.leaves(again)) for s in leaf.addressable_shards}
    for r in results:
        for key, value in r["sums"].items():
            assert abs(value - want[key]) <= 1e-5 * max(1.0, abs(want[key])), key


def test_positional_reads_cut_any_block(tmp_path):
    from equishard.train import OutTensor, checkpoint_tensors, write_safetensors
    from equishard.train._safetensors import _pread_block

    x = np.arange(4 * 5 * 6 * 7, dtype=np.float32).reshape(4, 5, 6, 7)
    write_safetensors(str(tmp_path), [OutTensor("x", x.shape, np.float32, lambda: x)])
    info = checkpoint_tensors(str(tmp_path))["x"]
    for index in [(slice(0, 4), slice(0, 5), slice(0, 6), slice(0, 7)), (slice(1, 3), slice(0, 5), slice(0, 6), slice(0, 7)),
                  (slice(1, 3), slice(2, 4), slice(0, 6), slice(0, 7)), (slice(0, 4), slice(1, 5), slice(2, 3), slice(0, 7)),
                  (slice(3, 4), slice(4, 5), slice(5, 6), slice(6, 7)), (slice(0, 4), slice(0, 5), slice(0, 6), slice(2, 5)),
                  (slice(2, 2), slice(0, 5), slice(0, 6), slice(0, 7))]:  # fmt: skip
        np.testing.assert_array_equal(_pread_block(info, index), x[index])


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


def test_the_fused_loss_leaves_the_padding_ids_out():
    from equishard.core import fused_linear_cross_entropy

    key = jax.random.key(3)
    h = jax.random.normal(key, (2, 5, 8))
    w = jax.random.normal(jax.random.fold_in(key, 1), (12, 8))  # 9 real ids, 3 padding rows
    labels = jax.random.randint(jax.random.fold_in(key, 2), (2, 5), 0, 9)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, chunk_size=4)

    def loss(h, w, **kw):
        return fused_linear_cross_entropy(h, w, labels, **opts, **kw).loss

    value, (dh, dw) = jax.value_and_grad(lambda h, w: loss(h, w, vocab_size=9), argnums=(0, 1))(h, w)
    want, (want_dh, want_dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w[:9])
    assert rel_err(value, want) <= 1e-6 and rel_err(dh, want_dh) <= 1e-5
    assert rel_err(dw[:9], want_dw) <= 1e-5 and not np.asarray(dw[9:]).any()
    with pytest.raises(es.LayerConfigError, match="vocab_size=13 must be a number of ids from 1 to the weight's 12 rows"):
        loss(h, w, vocab_size=13)


def _gpt_loss_and_grads(model, mesh, batch_spec, batch):
    def body(model, batch):
        return eqx.filter_value_and_grad(lambda m: m.loss(batch)[0])(model)

    step = es.filter_shard_map(body, mesh=mesh, in_specs=(None, batch_spec), out_specs=(P(), None))
    return eqx.filter_jit(step)(model, batch)


def test_training_on_a_vocabulary_tp_does_not_divide():
    """The Llama 3.2 fixture's 61 ids padded to 62 (tp=2) and 64 (fsdp=4,tp=2): the loss
    and gradients of the unpadded one-device model, the padding rows untouched."""
    folder = str(FIXTURES / "llama32_bf16")
    flat = es.Layout("dp=8").resolve()
    one = to_single_device(es.gather(load_hf(folder, flat, flat.mesh())))
    assert one.config.vocab_size == 61 and one.config.real_vocab_size is None
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 61, (8, 17)), jnp.int32)
    want, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, b: m.loss(b)[0]))(one, batch)
    want_grads = jax.tree.leaves(eqx.filter(want_grads, eqx.is_array))
    for spec, fused in [("tp=2", True), ("tp=2", False), ("fsdp=4,tp=2", True)]:
        layout = es.Layout(spec).resolve()
        model = load_hf(folder, layout, layout.mesh())
        if not fused:  # the same arrays in a GPT whose loss forms the logits
            config = dataclasses.replace(model.config, fused_loss=False)
            with jax.sharding.use_abstract_mesh(layout.mesh().abstract_mesh):
                shape = eqx.filter_eval_shape(lambda: GPT(config, layout, key=jax.random.key(0)))
            model = jax.tree.unflatten(jax.tree.structure(shape), jax.tree.leaves(model))
        assert model.config.real_vocab_size == 61 and model.config.vocab_size in (62, 64)
        loss, grads = _gpt_loss_and_grads(model, layout.mesh(), layout.batch_spec, batch)
        assert rel_err(loss, want) <= 1e-5, (spec, float(loss), float(want))
        got = jax.tree.leaves(eqx.filter(to_single_device(es.gather(grads)), eqx.is_array))
        for g, w in zip(got, want_grads, strict=True):
            g = np.asarray(g)
            if g.shape != w.shape:  # the tied embedding [V, D]: its padding rows get nothing
                assert not g[61:].any(), spec
                g = g[:61]
            assert rel_err(g, w) <= 1e-5, (spec, fused, g.shape)


@pytest.mark.parametrize("layout, repeats", [("fsdp=4,tp=2", 1), ("pp=2,fsdp=2,tp=2", 2)])
def test_the_model_file_is_written_one_array_at_a_time(tmp_path, monkeypatch, layout, repeats):
    """`export_model` of a model split over fsdp=4,tp=2 or a circular pipeline writes the
    bytes the gathered model's `eqx.tree_serialise_leaves` writes, never gathering it,
    and holds one array on the host at a time."""
    from equishard.train import _export, export_model

    model, _ = _gpt(layout, pipeline_repeats=repeats)
    plain = to_single_device(model)
    if repeats > 1:  # the stacked layers stay split over the stages (none holds them all)
        assert all(x.sharding.spec[0] == "pp" for x in jax.tree.leaves(plain) if x.shape[0] == SMALL.n_layers)
    with open(tmp_path / "old.eqx", "wb") as f:  # the route before: gathered, then written
        eqx.tree_serialise_leaves(f, es.unbox(es.gather(plain)))
    alive, host_array = [], _export.host_array

    def one_at_a_time(x):
        assert all(ref() is None for ref in alive), "an earlier array is still held"
        out = host_array(x)
        alive.append(weakref.ref(out))
        return out

    def never(*args, **kwargs):
        raise AssertionError("gathered")

    monkeypatch.setattr(_export, "host_array", one_at_a_time)
    monkeypatch.setattr(_export, "gather", never)
    export_model(plain, tmp_path / "new.eqx")
    assert len(alive) == len(jax.tree.leaves(plain)) == 10
    assert (tmp_path / "new.eqx").read_bytes() == (tmp_path / "old.eqx").read_bytes()


def test_the_end_of_run_sample_is_skipped_for_a_model_too_large_for_one_device(monkeypatch):
    """The sample gathers the model onto one device: above half of its memory it is
    skipped, and the message says so (and where to sample instead)."""
    from equishard._app import _run

    model = {"w": jnp.zeros((200,), jnp.float32)}  # 800 bytes
    monkeypatch.setattr(_run, "device_memory_stat", lambda devices, stat: [])
    monkeypatch.setattr(_run, "machine_memory", lambda devices: (2000, "RAM"))
    assert _run._too_large_for_one_device(model, jax.devices()) == ""
    monkeypatch.setattr(_run, "machine_memory", lambda devices: (1000, "RAM"))
    assert _run._too_large_for_one_device(model, jax.devices()) == (
        "the model's 800 B would be gathered onto one device of 1000 B"
    )
