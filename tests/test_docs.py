"""The documentation site: every guide's code runs, prints what the guide says it prints,
and every public name is in the API reference with a docstring.

Each guide includes its code, section by section, from one script in `docs/examples/`
(`--8<-- "examples/NAME.py:section"`). Each script is run here once, in-process, on
the 8 CPU devices the conftest simulates (one that prints a compiled program's memory in
a process of its own, compiled as users compile), and its printed output is checked two
ways:

- the results each guide is about (losses equal across layouts, gradients equal to the
  single-device ones, bytes per device, ...) are parsed and asserted;
- every line of every `text title="Output"` block of the guide must be a line the
  script printed, shown whole: no output block cuts a number or a line with "…".

`docs/examples/distill.py` has its own test, `tests/test_distill.py`. The site itself is
built with `mkdocs build --strict` by `scripts/test.sh`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import pathlib
import re
import runpy
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
GUIDES = DOCS / "guides"

# guide page -> the example scripts whose output its "Output" blocks show
PAGES = {
    "meshes-and-specs.md": ("meshes_and_specs.py",),
    "collectives.md": ("collectives.py",),
    "layouts.md": ("layouts.py",),
    "moe.md": ("moe.py",),
    "pipeline.md": ("pipeline.py",),
    "training.md": ("training.py", "multihost.py"),
    "coming-from.md": ("coming_from.py",),
    "inspect-and-plan.md": ("inspect_and_plan.py",),
    "train-output.md": ("train_output.py",),
    "long-sequences.md": ("long_sequences.py",),
    "generating.md": ("generating.py",),
    "your-own-model.md": ("your_own_model.py", "your_own_cnn_and_vit.py", "your_own_conv_and_scan.py"),
    "hugging-face.md": ("hugging_face.py",),
    "your-data.md": ("your_data.py",),
}
LAUNCHED = {"multihost.py"}  # also run as 2 processes by `equishard launch`
TESTED_ELSEWHERE = {"distill.py"}  # tests/test_distill.py

INCLUDE = re.compile(r'^\s*--8<--\s+"examples/([\w.]+?)(?::([\w-]+))?"\s*$', re.M)
# An output block titled "Output (Python 3.11)" is checked on that Python only (the
# training corpus is the running interpreter's standard library).
# An output block titled "Output (numbers vary)" shows a run's timings, or losses and
# relative errors whose last digits move with the order XLA sums in (which changes with
# the processor and the JAX version): its lines are compared with every number, as
# printed, standing for any number; the page's own test checks those numbers' tolerances.
OUTPUT_BLOCK = re.compile(
    r'^```text title="Output(?: \((?:Python (3\.\d+)|(numbers vary))\))?"\n(.*?)^```', re.M | re.S
)
NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"


# Examples that print a compiled program's memory (`equishard inspect`): run in a process
# of their own with the XLA flags a user's program gets (the conftest's
# TESTS_USERS_XLA_FLAGS: without JAX 0.10's older fusion emitters, which fuse a few
# buffers differently).
AS_USERS = {"inspect_and_plan.py"}


@functools.cache
@functools.cache
def run_example(name: str) -> str:
    """Run `docs/examples/<name>` as `__main__`; return what it printed (once per process:
    a page's output test and the example's own test read the same run)."""
    if name in AS_USERS:
        env = dict(os.environ, XLA_FLAGS=os.environ["TESTS_USERS_XLA_FLAGS"])
        argv = [sys.executable, str(EXAMPLES / name)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return out.getvalue()


@functools.cache
def launch_example(name: str, processes: int = 2) -> str:
    """Run `equishard launch -n <processes> -- python docs/examples/<name>`; its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQUISHARD_")}
    argv = [sys.executable, "-m", "equishard", "launch", "-n", str(processes), "--devices", "8",
            "--", sys.executable, str(EXAMPLES / name)]  # fmt: skip
    done = subprocess.run(
        argv, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def lines_after(output: str, prefix: str) -> list[str]:
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def floats(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+(?:e[-+]?\d+)?", text)]


# --------------------------------------------------------------------- the pages


def test_every_guide_is_checked_and_every_example_is_run():
    guides = {p.name for p in GUIDES.glob("*.md")}
    included = {m.group(1) for p in GUIDES.glob("*.md") for m in INCLUDE.finditer(p.read_text())}
    examples = {p.name for p in EXAMPLES.glob("*.py")}
    assert included <= examples, f"pages include missing scripts: {included - examples}"
    assert examples <= included, f"scripts no page includes: {examples - included}"
    assert {n for names in PAGES.values() for n in names} | TESTED_ELSEWHERE == examples
    assert {p for p in guides if INCLUDE.search((GUIDES / p).read_text())} == (
        set(PAGES) | {"distillation.md"}
    )


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.rglob("*.md")))
def test_includes_name_sections_that_exist(page):
    text = next(DOCS.rglob(page)).read_text()
    for match in INCLUDE.finditer(text):
        script, section = match.groups()
        source = (EXAMPLES / script).read_text()
        if section is not None:
            assert f"# --8<-- [start:{section}]" in source, (page, script, section)
            assert f"# --8<-- [end:{section}]" in source, (page, script, section)


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_output_blocks_show_real_numbers(page):
    """An output block shows what the code prints, whole: never a number or a line cut
    with "…" (a value that differs between Python or JAX versions gets one block per
    version; timings get an "Output (numbers vary)" block showing a real run's numbers)."""
    for _, _, block in OUTPUT_BLOCK.findall((DOCS / page).read_text()):
        assert "…" not in block, f"{page} cuts an output with '…':\n{block}"


def _piece(text: str, numbers_vary: bool) -> str:
    if not numbers_vary:
        return re.escape(text)
    out, last = [], 0
    for match in re.finditer(NUMBER, text):
        out += [re.escape(text[last : match.start()]), NUMBER]
        last = match.end()
    # tqdm says "s/step" below one step a second, "step/s" above.
    return re.sub(r"s/step|step/s", "(?:s/step|step/s)", "".join([*out, re.escape(text[last:])]))


def _shown_line_matches(shown: str, printed: list[str], numbers_vary: bool = False) -> bool:
    pattern = _piece(shown, numbers_vary)
    return any(re.fullmatch(pattern, line.rstrip()) for line in printed)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_output_blocks_are_what_the_code_prints(page):
    text = (GUIDES / page).read_text()
    blocks = OUTPUT_BLOCK.findall(text)
    assert blocks, f"{page} shows no output"
    printed = [line for name in PAGES[page] for line in run_example(name).splitlines()]
    printed += [
        line for name in PAGES[page] if name in LAUNCHED for line in launch_example(name).splitlines()
    ]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    for only_on, numbers_vary, block in blocks:
        if only_on and only_on != python:
            continue
        for shown in block.splitlines():
            if shown.strip():
                assert _shown_line_matches(shown.rstrip(), printed, bool(numbers_vary)), (
                    f"{page} shows a line its code does not print:\n{shown}\n"
                    f"--- printed:\n" + "\n".join(printed)
                )


# ------------------------------------------------------------ the guides' results


def test_meshes_and_specs():
    out = run_example("meshes_and_specs.py")
    assert "8 devices" in out
    [sharded, single] = floats(lines_after(out, "loss sharded")[0])
    assert abs(sharded - single) <= 1e-5 * abs(single)
    errors = [floats(line)[0] for line in lines_after(out, "grad ") if "relative error" in line]
    assert len(errors) == 2 and all(e <= 1e-5 for e in errors)
    [global_view, single] = floats(lines_after(out, "global view")[0])
    assert abs(global_view - single) <= 1e-5 * abs(single)
    assert "gather(shard(x)) == x: True" in out
    assert "SpecError: parameter `['blocks'][0]` (shape (6, 64))" in out


def test_collectives():
    out = run_example("collectives.py")
    assert lines_after(out, "ring_shift")[0].split() == ["[7,", "0,", "1,", "2,", "3,", "4,", "5,", "6]"]
    sent = {line.split()[0]: float(line.split()[2]) for line in out.splitlines() if " sends " in line}
    n = 8
    assert sent == pytest.approx(
        {
            "all-gather": n - 1,  # (n - 1)/n of a result of n blocks
            "reduce-scatter": n - 1,  # (n - 1)/n of an operand of n blocks
            "all-reduce": 2 * (n - 1) / n,
            "all-to-all": (n - 1) / n,
            "collective-permute": 1.0,
        }
    )
    assert out.count(": True") == 4 and ": False" not in out
    assert out.count("{'collective-permute': 7}") == 3


def test_layouts_train_to_the_same_losses():
    out = run_example("layouts.py")
    rows = [line for line in out.splitlines() if " losses " in line]
    assert len(rows) == 7
    losses = {line[:17].strip(): floats(line.split(" losses ")[1].split("params")[0]) for line in rows}
    reference = losses["one device"]
    assert len(reference) == 3 and reference[-1] < reference[0]  # it learns
    for name, values in losses.items():
        for a, b in zip(values, reference, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, values, reference)
    kinds = {line[:17].strip(): line.rsplit("(", 1)[1].rstrip(")") for line in rows}
    assert kinds["one device"] == "none"
    assert kinds["data parallel"] == "all-reduce"
    assert kinds["tensor parallel"] == "all-reduce"
    for name in ("FSDP", "sequence parallel", "FSDP + TP", "DP + FSDP + TP"):
        assert {"all-gather", "reduce-scatter"} <= set(kinds[name].split(", ")), name
    params = {line[:17].strip(): floats(line.split("params")[1])[0] for line in rows}
    assert params["FSDP"] < params["data parallel"] / 7  # 1/8 of the split arrays


def test_moe():
    out = run_example("moe.py")
    assert "capacity_factor 1.25: 5 slots per expert" in out
    assert "kept (capacity 3):    [0, 1, 1, 0, 1, 0]" in out
    single = lines_after(out, "one device:")[0]
    match = re.search(r"dropped (\d+)", single)
    assert match, single
    dropped = int(match[1])
    assert dropped > 0
    # the auxiliary loss is over the whole batch, as on one device
    [balance] = floats(single.split("load-balancing loss")[1])
    for dispatch in ("dense ", "ragged"):
        line = lines_after(out, f"dp=2,ep=4 {dispatch}:")[0]
        assert f"dropped {dropped}," in line and line.endswith("output equal to one device: True")
        assert f"load-balancing loss {balance:.5f}," in line
    assert "all-to-alls: {'all-to-all': 2} 9.0 KiB per device" in out  # 2 x 3/4 x 6 KiB


def test_pipeline():
    out = run_example("pipeline.py")
    assert "gpipe: S=4 M=8 R=1 steps=22 bubble=0.273 peak in flight=[8, 8, 8, 8]" in out
    assert "circular: S=4 M=8 R=2 steps=38 bubble=0.158" in out
    assert "1f1b: S=4 M=8 R=1 steps=22 bubble=0.273 peak in flight=[4, 3, 2, 1]" in out
    assert "interleaved-1f1b: S=4 M=8 R=2 steps=38 bubble=0.158" in out
    assert "zb-h1: S=4 M=8 R=1 steps=29 bubble=0.172 peak in flight=[4, 4, 4, 4]" in out
    assert "  step  7:  B0  F3  B1  F2" in out
    [reference] = floats(lines_after(out, "sequential loss")[0])
    runs = [line for line in out.splitlines() if "repeats=" in line]
    assert len(runs) == 3
    for line in runs:
        loss = floats(line.split("loss")[1])[0]
        assert abs(loss - reference) <= 1e-4 * abs(reference), line
        assert "gradients equal: True" in line
        assert "all-gather" not in line and "all-to-all" not in line
    assert "{'collective-permute': 20, " in runs[0]  # 2 (M + S - 2)
    assert "{'collective-permute': 36, " in runs[1]  # 2 (R M + S - 2)
    explicit = [line for line in out.splitlines() if "micro-batches held per device" in line]
    assert len(explicit) == 3
    for line in explicit:
        loss = floats(line.split("loss")[1])[0]
        assert abs(loss - reference) <= 1e-4 * abs(reference), line
        assert "gradients equal: True" in line
    assert explicit[0].endswith("[4, 3, 2, 1]") and explicit[2].endswith("[4, 4, 4, 4]")


def test_training_resumes_on_another_layout():
    out = run_example("training.py")
    full = floats(lines_after(out, "fsdp=8, steps 1-6:")[0])
    resumed = floats(lines_after(out, "dp=2,tp=4, steps 4-6:")[0])
    assert len(full) == 6 and full[-1] < full[0]
    for a, b in zip(resumed, full[3:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert "resumed losses equal the uninterrupted run: True" in out
    assert "restored at step 3 on {'dp': 2, 'tp': 4}" in out
    assert "logits (2, 32, 256)" in out
    zero = floats(lines_after(out, "dp=8 --zero, steps 1-3:")[0])
    for a, b in zip(zero, full[:3], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert "ZeRO losses equal the fsdp=8 run: True" in out
    assert "first moment P('dp', None) block (32, 64)" in out
    frozen_line = lines_after(out, "optimizer state: ")[0]
    held, whole = (int(v.replace(",", "")) for v in re.findall(r"[\d,]+", frozen_line)[:2])
    assert held < 0.3 * whole  # the attention's moments only
    assert "frozen arrays bit-identical after 3 steps: True" in out
    assert "restored onto the base at step 3" in out


def test_multihost_equals_one_process():
    one = [floats(line)[0] for line in lines_after(run_example("multihost.py"), "step ")]
    launched = launch_example("multihost.py")
    two = [floats(line)[0] for line in lines_after(launched, "[0] step ")]
    assert len(one) == 5 and one[-1] < one[0]
    assert len(two) == len(one)
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-5 * abs(b), (two, one)
    assert "[1] process 1 of 2: 4 local devices, 8 in all" in launched
    assert not lines_after(launched, "[1] step ")  # only process 0 prints


def test_long_sequences():
    out = run_example("long_sequences.py")
    errors = [floats(line)[-1] for line in out.splitlines() if "relative error" in line]
    assert len(errors) == 4 and all(e <= 1e-5 for e in errors)
    rows = {int(line.split()[1]): floats(line) for line in out.splitlines() if line.startswith("S=")}
    assert rows[8192][1] <= 2.2 * rows[4096][1] and rows[8192][0] >= 3.5 * rows[4096][0]
    zigzag = lines_after(out, "zigzag     block pairs per device ")[0]
    assert "max/min 1.00" in zigzag


def test_generating():
    out = run_example("generating.py")
    assert "compilations {'prefill': 1, 'decode': 1}" in out
    assert out.count("the same tokens: True") == 2
    assert "alone on another layout: True" in out


def test_hugging_face():
    out = run_example("hugging_face.py")
    errors = [floats(line)[-1] for line in lines_after(out, "") if "max |logits - transformers'|" in line]
    assert len(errors) == 4 and all(e <= 1e-5 for e in errors)
    losses = [floats(line)[0] for line in lines_after(out, "step ")]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]
    assert floats(lines_after(out, "exported and reloaded under tp=4: ")[0])[-1] <= 1e-5
    assert "checkpoint tensor lm_head.weight (64, 32)" in out
    # LoRA: the adapters learn from the base's loss (B = 0 at step 0: the base's own loss,
    # the plain fine-tuning's first); a checkpoint of the adapters is smaller than the
    # whole state's, refused on another base, restored onto its own; PEFT and the merged
    # export give the adapted model's logits.
    lora = [floats(line)[0] for line in lines_after(out, "LoRA step ")]
    assert len(lora) == 5 and lora[0] == losses[0] and all(a > b for a, b in zip(lora, lora[1:]))
    adapters, whole = (int(v.replace(",", "")) for v in re.findall(r"[\d,]{4,}", lines_after(out, "adapter checkpoint ")[0]))
    assert adapters < whole
    assert "refused: trained on another base: its frozen arrays had the fingerprint <hash> (from SOURCE)" in out
    assert "restored onto the base at step 5" in out
    assert "['adapter_config.json', 'adapter_model.safetensors']" in out
    assert floats(lines_after(out, "PEFT adapters loaded onto the base: ")[0])[-1] <= 1e-5
    assert floats(lines_after(out, "merged, exported, loaded under tp=4: ")[0])[-1] <= 1e-5


def test_your_data():
    out = run_example("your_data.py")
    assert "-1" in lines_after(out, "labels ")[0]  # the label after an end-of-text token
    masked, unmasked = (floats(line)[0] for line in out.splitlines() if line.startswith("document_masking="))
    assert abs(masked - unmasked) > 1e-3  # attention across the boundary is what the flag turns off
    worst = [floats(line)[-1] for line in out.splitlines() if "max relative difference" in line]
    assert len(worst) == 2 and all(w <= 1e-4 for w in worst)


def test_inspect_and_plan():
    out = run_example("inspect_and_plan.py")
    ratios = [float(r) for r in re.findall(r"^measured .* = (\d+\.\d+)", out, re.M)]
    assert ratios == [1.0, 1.0]  # inspect and plan: the compiled steps send the minimum
    assert "by axes: fsdp " in out and "fsdp=16, tp=4" in out
    assert re.search(r"peak per device .* of 16\.00 GiB: fits", out)
    [own] = lines_after(out, "measured ")[-1:]
    assert own.endswith("ratio 1.000")  # the FSDP formula, on an unmodified eqx.nn.MLP


def test_your_own_model_trains_as_on_one_device():
    out = run_example("your_own_model.py")
    rows = {line[:12].strip(): floats(line.split(" losses ")[1]) for line in out.splitlines() if " losses " in line}
    assert set(rows) == {
        "one device", "dp=8", "fsdp=8", "dp=2,fsdp=4", "dp=4,tp=2", "fsdp=4,tp=2", "global view", "fused loss",
    }  # fmt: skip
    reference = rows["one device"]
    assert len(reference) == 4 and reference[-1] < reference[0]  # it learns
    for name, losses in rows.items():
        for a, b in zip(losses, reference, strict=True):
            tolerance = 1e-5 if "tp" in name or name in ("global view", "fused loss") else 1e-6  # printed to 1e-6
            assert abs(a - b) <= tolerance * abs(b) + 1e-6, (name, losses, reference)
    # A checkpoint written on fsdp=4,tp=2 continues on dp=8 as it would have there;
    # the plain model comes back as the classes it was written with.
    assert "plain model back: Embedding Linear" in out
    [restored] = floats(lines_after(out, "step 5 on dp=8 after restore")[0])
    [continued] = floats(lines_after(out, "step 5 on fsdp=4,tp=2")[0])
    assert abs(restored - continued) <= 1e-5 * abs(continued)


def test_your_own_cnn_with_batch_norm_and_vit_under_a_plan():
    out = run_example("your_own_cnn_and_vit.py")
    rows = {line[:12].strip(): line for line in out.splitlines() if " losses " in line}
    cnn = {name: floats(line.split(" losses ")[1].split(" running")[0]) for name, line in rows.items() if "running" in line}
    assert set(cnn) == {"dp=1", "dp=8", "fsdp=8", "dp=4,fsdp=2"}
    for name, losses in cnn.items():  # the batch statistics of the global batch on every layout
        for a, b in zip(losses, cnn["dp=1"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b) + 1e-6, (name, losses)
        [running] = floats(rows[name].split("running mean ")[1])
        assert running <= 1e-5
    per_device = floats(lines_after(out, "dp=8 per-device statistics: losses")[0])
    assert abs(per_device[0] - cnn["dp=1"][0]) > 1e-4  # other statistics, other losses
    assert "inference on one device: (16, 10)" in out
    assert "the eqx.nn.Dropout at `blocks[0].mlp.drop1` acts on an activation split over 'tp'" in out
    vit_one, vit_tp = floats(rows["one device"].split(" losses ")[1]), floats(rows["dp=4,tp=2"].split(" losses ")[1])
    for a, b in zip(vit_tp, vit_one, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, (vit_tp, vit_one)


def test_your_own_conv_net_and_scan_model_by_path_rules():
    out = run_example("your_own_conv_and_scan.py")
    rows = {line[:21].strip(): floats(line.split(" losses ")[1].split(" max")[0]) for line in out.splitlines() if " losses " in line}
    layouts = ("one device", "dp=8", "fsdp=8", "fsdp=4,tp=2")
    assert set(rows) == {f"{model:8} {layout}" for model in ("conv net", "mamba") for layout in layouts}
    for name, losses in rows.items():  # dp, fsdp and tp by path rules: the one-device losses
        reference = rows[name[:8] + " one device"]
        for a, b in zip(losses, reference, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, (name, losses, reference)
    assert "conv.weight      (64, 1, 4) P('tp', None, None) per device (32, 1, 4)" in out
    assert "parallelize has no style for a convolution: split its channels by path rules" in out
    assert "The plan leaves the convolution(s) `blocks[0].conv` (Conv1d, 64 channels, groups=64)" in out


def test_coming_from():
    out = run_example("coming_from.py")
    assert out.count(": True") == 4 and ": False" not in out


# ------------------------------------------------------------------ the reference

NAMESPACES = [
    "equishard",
    "equishard.sharding",
    "equishard.core",
    "equishard.nn",
    "equishard.models",
    "equishard.train",
    "equishard.distributed",
    "equishard.report",
]


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


def documented() -> set[str]:
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)\s*$", text, re.M))


@pytest.mark.parametrize("module_name", NAMESPACES)
def test_every_public_name_is_in_the_api_reference(module_name):
    have = documented()
    top, module = importlib.import_module("equishard"), importlib.import_module(module_name)
    missing = []
    for name in public_names(module_name):
        if module is not top and getattr(top, name, None) is getattr(module, name):
            continue  # a re-export of a top-level name, documented under that name
        if f"{module_name}.{name}" not in have:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"not in docs/api/*.md: {missing}"


def test_every_public_name_has_a_docstring():
    griffe = pytest.importorskip("griffe")  # installed with the docs extra
    package = griffe.load("equishard", search_paths=[str(ROOT)])
    undocumented = []
    for path in sorted(documented()):
        obj = package
        for part in path.split(".")[1:]:
            obj = obj[part]
        target = obj.final_target if obj.is_alias else obj
        docstring = target.docstring.value.strip() if target.docstring else ""
        if not docstring:
            undocumented.append(path)
    assert not undocumented, f"public names without a docstring: {undocumented}"
