"""The application's Hugging Face functions: a run's checkpoint exported as a Hugging
Face folder (`export_run`), a run started from one (`init_from_hf`)."""

import json
import os
import pathlib
import socket

import jax
import numpy as np
import pytest

import equishard as es
from equishard._app import Run, TrainConfig
from equishard._app._config import CONFIG_FILE, config_toml
from equishard._app._export import export_run
from equishard._app._hf import HF_SOURCE, init_from_hf, run_model_config
from equishard._app._rundir import LOCK
from equishard.models import GPT, load_hf, read_hf_config
from equishard.models._internal import canonical_path, to_single_device
from equishard.train import Checkpointer

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
CONFIG = TrainConfig(model="tiny", layout="fsdp=2,tp=4", batch_size=8, seq_len=32, progress=False, plot=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with its `config.toml` and one checkpoint (step 0, its initial
    state), as `equishard train` leaves them."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / CONFIG_FILE).write_text(config_toml(CONFIG))
    r = Run(CONFIG)
    state = r.init_state()
    with Checkpointer(run_dir / "checkpoints", path_map=canonical_path) as ckpt:
        ckpt.save(0, state)
    return run_dir, r, state


def test_a_runs_checkpoint_exports_as_llama(run_dir, tmp_path):
    run_dir, r, state = run_dir
    to = tmp_path / "hf"
    export_run(run_dir, to)
    hf = read_hf_config(str(to))
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["num_hidden_layers"] == 2
    # Loaded back under another layout, the same parameters.
    layout = es.Layout("dp=2,tp=2,fsdp=2").resolve()
    again = load_hf(str(to), layout, layout.mesh())
    ref = jax.tree.leaves(to_single_device(es.gather(state.model)))
    back = jax.tree.leaves(to_single_device(es.gather(again)))
    assert len(ref) == len(back) == 9
    for a, b in zip(ref, back):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(again, GPT) and again.config.vocab_size == r.model_config.vocab_size


def test_export_refuses_a_live_run_and_a_full_target(run_dir, tmp_path):
    run_dir, _, _ = run_dir
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(es.CheckpointError, match="exists and is not empty"):
        export_run(run_dir, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "mine"
    lock = run_dir / LOCK
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    try:
        with pytest.raises(es.CheckpointError, match="locked by a live run"):
            export_run(run_dir, tmp_path / "out")
    finally:
        lock.unlink()
    with pytest.raises(es.CheckpointError, match="has no config.toml"):
        export_run(tmp_path, tmp_path / "out")


def test_init_from_records_the_source_beside_the_run(tmp_path):
    # A vocabulary tp does not divide: padded (the loss leaves the padding ids out).
    padded = es.Layout("tp=4").resolve()
    config, _ = init_from_hf(FIXTURES / "llama32_bf16", padded, padded.mesh(), run_dir=tmp_path / "padded")
    assert (config.vocab_size, config.real_vocab_size) == (64, 61)
    layout = es.Layout("fsdp=4,dp=2").resolve()
    config, model = init_from_hf(FIXTURES / "llama32_bf16", layout, layout.mesh(), run_dir=tmp_path)
    assert config.tied and config.vocab_size == 61 and config.real_vocab_size is None
    assert sorted(os.listdir(tmp_path / HF_SOURCE)) == ["config.json", "tokenizer_config.json"]
    assert run_model_config(tmp_path) == config
    assert np.asarray(model.embed.weight.value).dtype == np.float32
    with pytest.raises(es.CheckpointError, match="already records the checkpoint"):
        init_from_hf(FIXTURES / "llama32_bf16", layout, layout.mesh(), run_dir=tmp_path)
