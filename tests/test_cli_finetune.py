"""LoRA fine-tuning from the command line: `train --init-from DIR --data TOKENS --lora-rank
R` on instruction pairs, adapter-only checkpoints resumed (and refused on another base
or rank), `export` of the adapters (PEFT) and of the merged model, `--init-adapters`."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import equishard as es
from equishard._cli import main
from equishard.models import load_hf, load_peft

from .test_cli_text import FIXTURE, _char_tokenizer, _out
from .test_hf_llama import _forward

LAYOUT = "dp=2,fsdp=2,tp=2"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict[str, pathlib.Path]:
    """A LoRA run of 3 steps (checkpoints at 2 and 3) on instruction pairs tokenized with
    the fixture's tokenizer, and the folders it came from."""
    tmp = tmp_path_factory.mktemp("lora")
    hf = tmp / "hf"
    shutil.copytree(FIXTURE, hf)
    _char_tokenizer(hf)
    pairs = tmp / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(400):  # one in 20 held out for validation
            f.write(
                json.dumps({"prompt": f"q: {i} plus {i}. a:", "completion": f" {2 * i}\n"}) + "\n"
            )
    assert main(["tokenize", str(pairs), "--out", str(tmp / "tok"), "--tokenizer", str(hf)]) == 0
    run = tmp / "run"
    argv = ["train", "--init-from", str(hf), "--data", str(tmp / "tok"), "--lora-rank", "4",
            "--lora-targets", "q,v,down", "--lora-dropout", "0.1", "--grad-accum", "2", "--lr", "1e-2",
            "--batch-size", "8", "--seq-len", "16",
            "--layout", LAYOUT, "--checkpoint-every", "2", "--eval-every", "3", "--eval-batches", "1",
            "--sample-bytes", "0", "--no-progress", "--no-plot", "--no-tensorboard", "--run-dir", str(run)]  # fmt: skip
    assert main([*argv, "--steps", "3"]) == 0
    return {"tmp": tmp, "hf": hf, "run": run, "argv": argv}  # type: ignore[dict-item]


def _checkpoint_meta(run: pathlib.Path, step: int) -> dict:
    from equishard.train import Checkpointer

    with Checkpointer(run / "checkpoints") as ckpt:
        return ckpt.read_metadata(step)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_on_its_base_only(lora_run, capsys):
    run, argv = lora_run["run"], lora_run["argv"]
    capsys.readouterr()
    meta = _checkpoint_meta(run, 3)
    stored = {record["path"] for record in meta["arrays"]}
    assert (
        meta["base"]["source"] == f"--init-from {lora_run['hf']}"
        and len(meta["base"]["fingerprint"]) == 32
    )
    assert all(".lora[" in p for p in stored if p.startswith("model.")) and any(
        ".lora[" in p for p in stored
    )
    assert not any("embed" in p or ".qkv." in p for p in stored)  # the base is not stored
    # A resume may not change what is trained.
    assert main([*argv, "--steps", "4", "--resume", "--lora-rank", "8"]) == 2
    assert (
        "--lora-rank is 8, but the run was started with 4: it decides what is trained"
        in capsys.readouterr().err
    )
    # Nor train the adapters on another base: the fingerprint names both.
    other = lora_run["tmp"] / "other-base"
    shutil.copytree(lora_run["hf"], other)
    from safetensors.numpy import load_file, save_file

    for f in sorted(other.glob("*.safetensors")):
        tensors = load_file(f)
        tensors = {k: (v * 2 if "layers.0.mlp.up_proj" in k else v) for k, v in tensors.items()}
        save_file(tensors, f, metadata={"format": "pt"})
    bad = [*argv, "--steps", "4", "--resume"]
    bad[bad.index(str(lora_run["hf"]))] = str(other)
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert (
        "was trained on another base" in err
        and meta["base"]["fingerprint"] in err
        and str(other) in err
    )
    # On its own base it goes on.
    out = _out([*argv, "--steps", "4", "--resume"], capsys)
    assert "resumed from step 3" in out and _checkpoint_meta(run, 4)["base"] == meta["base"]


def test_export_writes_the_adapters_or_the_merged_model_and_init_adapters_reads_them(
    lora_run, capsys
):
    tmp, hf, run = lora_run["tmp"], lora_run["hf"], lora_run["run"]
    out = _out(["export", "--run-dir", str(run), "--to", str(tmp / "peft")], capsys)
    assert "the LoRA adapters, a PEFT folder" in out
    config = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 4
        and config["base_model_name_or_path"] == str(hf)
    )
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    out = _out(["export", "--run-dir", str(run), "--to", str(tmp / "merged"), "--merged"], capsys)
    assert "merged" in out
    # The merged folder computes what the base with the exported adapters computes.
    mesh, par, _, forward = _forward("fsdp=4,tp=2")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 16)), jnp.int32)
    base = load_hf(str(hf), par, mesh)
    want = np.asarray(forward(load_peft(base, str(tmp / "peft")), ids))
    got = np.asarray(forward(load_hf(str(tmp / "merged"), par, mesh), ids))
    assert (
        np.abs(got - want).max() <= 1e-5
        and np.abs(want - np.asarray(forward(base, ids))).max() > 1e-3
    )
    assert (
        main(["export", "--run-dir", str(run), "--to", str(tmp / "x"), "--merged", "--adapters"])
        == 2
    )
    assert "exclude each other" in capsys.readouterr().err
    # --init-adapters: a new run's adapters start as the PEFT folder's.
    from equishard._app._config import TrainConfig
    from equishard._app._run import Run

    r = Run(TrainConfig(init_from=str(hf), data=str(tmp / "tok"), init_adapters=str(tmp / "peft"),
                        batch_size=8, seq_len=16, layout="tp=4,dp=2"))  # fmt: skip
    mesh, par, _, forward = _forward("tp=4,dp=2")
    assert np.abs(np.asarray(forward(r.init_state().model, ids)) - want).max() <= 1e-5
    with pytest.raises(
        es.LayerConfigError, match=r"--lora-rank 8 contradicts the adapters of --init-adapters"
    ):
        Run(TrainConfig(init_from=str(hf), data=str(tmp / "tok"), init_adapters=str(tmp / "peft"), lora_rank=8,
                        batch_size=8, seq_len=16))  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "0"], "--lora-rank must be at least 1, got 0"),
        (["--lora-rank", "4", "--lora-targets", "q,gate_proj"], "--lora-targets 'q,gate_proj': 'gate_proj' is not a projection"),
        (["--lora-alpha", "16"], "--lora-alpha applies to LoRA adapters: give --lora-rank R"),
        (["--freeze", "embed("], "--freeze 'embed(' is not a regular expression"),
        (["--init-adapters", "somewhere"], "--init-adapters somewhere: a PEFT folder adapts the model it was made for"),
        (["--freeze", "."], "leaves nothing trainable"),
        (["--lora-rank", "1000"], "LoRA: rank 1000 on q is above the layer's width (in 64, out 64)"),
    ],
)  # fmt: skip
def test_bad_fine_tuning_options_are_named(tmp_path, capsys, flags, message):
    argv = ["train", "--model", "tiny", "--steps", "1", "--batch-size", "8", "--seq-len", "16",
            "--sample-bytes", "0", "--no-progress", "--no-plot", "--no-tensorboard", "--run-dir", str(tmp_path / "r")]  # fmt: skip
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
