"""The commands around a run, from the command line: `tokenize`, `generate`, `eval` and
`export`, on one small run shared by the tests (in-process: the tests' 8 devices)."""

from __future__ import annotations

import json
import pathlib

import pytest

from equishard._cli import main

TRAIN = ["train", "--model", "tiny", "--steps", "4", "--batch-size", "8", "--seq-len", "32",
         "--layout", "dp=2,tp=4", "--checkpoint-every", "2", "--eval-every", "2", "--eval-batches", "2",
         "--sample-bytes", "0", "--no-progress", "--no-plot", "--no-tensorboard"]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    run = tmp_path_factory.mktemp("run")
    assert main([*TRAIN, "--run-dir", str(run)]) == 0
    return run


def _out(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_eval_reports_the_runs_last_validation_row(run_dir, capsys):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    out = json.loads(_out(["eval", "--run-dir", str(run_dir), "--json"], capsys))
    assert out["step"] == last["step"] == 4
    assert abs(out["loss"] - last["val_loss"]) <= 1e-6 * abs(last["val_loss"])
    other = json.loads(_out(["eval", "--run-dir", str(run_dir), "--layout", "fsdp=4,tp=2", "--json"], capsys))
    assert abs(other["loss"] - out["loss"]) <= 1e-5 * abs(out["loss"])


def test_generate_streams_a_prompt_and_prints_a_batch_as_json(run_dir, capsys):
    streamed = _out(["generate", "--run-dir", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8"], capsys)
    assert streamed.startswith("def ")
    argv = ["generate", "--run-dir", str(run_dir), "--prompt", "def ", "--prompt", "import",
            "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--json"]  # fmt: skip
    batch = json.loads(_out(argv, capsys))
    assert batch["prompts"] == ["def ", "import"] and len(batch["tokens"]) == 2
    alone = json.loads(_out([*argv[:5], *argv[7:], "--layout", "fsdp=4,tp=2"], capsys))
    assert alone["tokens"][0] == batch["tokens"][0]  # the same row alone, on another layout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--temperature", "-1"], "temperature=-1.0 must be at least 0"),
        (["--max-len", "8", "--prompt", "x" * 20], "longer"),
    ],
)
def test_generate_names_a_bad_option(run_dir, capsys, argv, message):
    full = ["generate", "--run-dir", str(run_dir), "--max-new-tokens", "4", *argv]
    if "--prompt" not in argv:
        full += ["--prompt", "a"]
    assert main(full) == 2
    assert message in capsys.readouterr().err


def test_generate_and_eval_refuse_a_directory_without_a_verified_checkpoint(tmp_path, capsys):
    assert main(["eval", "--run-dir", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "a"]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_export_writes_a_hugging_face_folder_and_refuses_a_full_target(run_dir, tmp_path, capsys):
    to = tmp_path / "hf"
    _out(["export", "--run-dir", str(run_dir), "--to", str(to)], capsys)
    config = json.loads((to / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (to / "model.safetensors").is_file()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thesis.tex").write_text("mine")
    assert main(["export", "--run-dir", str(run_dir), "--to", str(tmp_path / "full")]) == 2
    assert (tmp_path / "full" / "thesis.tex").read_text() == "mine"


def test_tokenize_writes_token_files_with_a_manifest(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy dog." for i in range(40)))
    out = _out(["tokenize", str(text), "--out", str(tmp_path / "tokens"), "--train-bpe", "300", "--val-every", "10"], capsys)
    assert "wrote" in out and (tmp_path / "tokens" / "manifest.json").is_file()
    assert main(["tokenize", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "t2"), "--train-bpe", "300"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tokenize", str(text), "--stdlib", "--out", str(tmp_path / "t3"), "--train-bpe", "300"]) == 2
    assert "or --stdlib; one of the two" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["tokenize", str(text), "--out", str(tmp_path / "mine"), "--train-bpe", "300"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine" and len(list((tmp_path / "mine").iterdir())) == 1


FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "llama3"
CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n_'0123456789ABCDEFGHIJKLMNO"
"""Ids 3 to 63 (after <unk>, <s>, </s>)."""


def _char_tokenizer(folder: pathlib.Path) -> None:
    """A character tokenizer of the fixture's 64 ids into `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = CHARS
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))


def test_train_init_from_a_hugging_face_folder_on_its_tokens_and_export_it_back(tmp_path, capsys):
    """tokenize with the folder's tokenizer, train --init-from (lr 1e-30: the weights stay the
    source's), export: the tensors are the source's, bit for bit; the source's config
    and tokenizer are recorded in the run directory."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURE, hf)
    _char_tokenizer(hf)
    text = tmp_path / "text"
    text.mkdir()
    for d in range(40):  # a file a document, one in 20 held out
        (text / f"{d}.txt").write_text("".join(f"def f{i}(x):\n    return x + {d * i}\n" for i in range(8)))
    _out(["tokenize", str(text), "--out", str(tmp_path / "tok"), "--tokenizer", str(hf)], capsys)
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(hf), "--data", str(tmp_path / "tok"), "--steps", "1", "--lr", "1e-30", "--weight-decay", "0",
            "--batch-size", "8", "--seq-len", "16", "--layout", "dp=2,fsdp=2,tp=2", "--eval-every", "1",
            "--eval-batches", "1", "--sample-bytes", "4", "--no-progress", "--no-plot", "--no-tensorboard",
            "--run-dir", str(run)]  # fmt: skip
    out = _out(argv, capsys)
    assert "nats per byte" in out and (run / "hf-source" / "tokenizer.json").is_file()
    _out(["export", "--run-dir", str(run), "--to", str(tmp_path / "out")], capsys)
    source = {k: v for f in sorted(FIXTURE.glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(source)
    assert all(np.array_equal(exported[k], source[k]) for k in source)
    assert main([*argv[:3], "--steps", "1", "--run-dir", str(tmp_path / "r2")]) == 2
    assert "give --data DIR" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2"])
def test_generate_from_a_hugging_face_folder_continues_as_transformers(tmp_path, capsys, family):
    """`generate --hf`: the fixture's recorded prompt (as text of the folder's tokenizer)
    continues greedily with the tokens transformers recorded, on dp=2,tp=4 (2 key/value
    heads: replicated) — Llama 3.1's rotary scaling and Qwen2's q/k/v biases included."""
    import shutil

    import numpy as np

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURE.parent / family, hf)
    _char_tokenizer(hf)
    recorded = np.load(hf / "expected.npz")
    prompt = "".join(CHARS[i - 3] for i in recorded["prompt"])
    argv = ["generate", "--hf", str(hf), "--prompt", prompt, "--max-new-tokens", str(len(recorded["greedy"])),
            "--layout", "dp=2,tp=4", "--json"]  # fmt: skip
    out = json.loads(_out(argv, capsys))
    assert out["tokens"][0] == recorded["greedy"].tolist()
