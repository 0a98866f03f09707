"""What issue 49 left open: a pipeline-of-FSDP checkpoint restoring under another layout,
training on a padded vocabulary, the end-of-run model written one array at a time, and
each process of a 2-process load reading only its own share of the files."""

import equinox as eqx
import jax
import numpy as np

import equishard as es
from equishard.models import GPT, GPTConfig
from equishard.models._internal import canonical_path, to_single_device
from equishard.train import Checkpointer

SMALL = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=48)


def _gpt(layout: str, config: GPTConfig = SMALL, seed: int = 0):
    resolved = es.Layout(layout).resolve()
    mesh, par = resolved.mesh(), resolved.parallelism
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
