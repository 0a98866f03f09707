"""Build the Hugging Face fixtures of the tests: tiny random models of the Llama family,
saved by `transformers`, with their float32 logits, loss and greedy continuation.

Run by hand, in a virtual environment with the `hf-oracle` extra (torch, transformers;
never needed to install, run or test equishard):

    python3 -m venv /tmp/hf-venv && /tmp/hf-venv/bin/pip install torch transformers peft safetensors numpy
    /tmp/hf-venv/bin/python scripts/make_hf_fixtures.py tests/fixtures/hf

Each family gets a folder `<family>/` (config.json, safetensors, generation_config.json,
a tokenizer_config.json to show that tokenizer files travel with the weights) and
`<family>/expected.npz`: `ids` (int32[8, 16]), `logits` (float32[8, 16, V], computed in
float32 even for the bf16 checkpoint), `loss` (the mean next-token cross-entropy of
`ids`), `prompt` (int32[4]) and `greedy` (int32[8], the greedy continuation of `prompt`).

With `peft` installed too, `llama3_lora/` holds a PEFT LoRA adapter of the `llama3`
fixture (r=4, lora_alpha=8, on q, k, v, o, gate, up and down, both factors random and
non-zero), saved by `peft` (`adapter_config.json`, `adapter_model.safetensors`), and its
`expected.npz`: `ids` and the adapted model's float32 `logits`. Only that one:

    /tmp/hf-venv/bin/python scripts/make_hf_fixtures.py tests/fixtures/hf peft
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers

COMMON = dict(
    hidden_size=32, num_attention_heads=4, num_hidden_layers=4, intermediate_size=48,
    max_position_embeddings=64, hidden_act="silu",
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    # Llama 3.1: grouped-query attention (2 key/value heads), llama3 rotary scaling,
    # saved in two files with an index.
    "llama3": ("LlamaForCausalLM", dict(
        vocab_size=64, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=False,
    ), {"max_shard_size": "60KB"}),
    # Llama 3.2: tied embeddings, a vocabulary no tensor axis divides, saved in bf16.
    "llama32_bf16": ("LlamaForCausalLM", dict(
        vocab_size=61, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True,
    ), {"dtype": torch.bfloat16}),
    # Mistral: multi-head attention, no sliding window.
    "mistral": ("MistralForCausalLM", dict(
        vocab_size=64, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        sliding_window=None, tie_word_embeddings=False,
    ), {}),
    # Qwen2: biases on the query, key and value projections.
    "qwen2": ("Qwen2ForCausalLM", dict(
        vocab_size=64, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, tie_word_embeddings=False,
    ), {}),
}  # fmt: skip


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: norms around 1 (not all ones), biases non-zero, attention far
    from uniform."""
    g = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif name == "lm_head.weight" or (name == "model.embed_tokens.weight" and tied):
                # Logits of order 1 (max about 2): float32 rounding in another summation
                # order (a tensor axis splitting a sum) stays well below 1e-5 absolute.
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def make(family: str, out: str) -> None:
    arch, options, save = FAMILIES[family]
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_class(**COMMON, **options)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    _randomise(model, seed=sum(map(ord, family)))
    dtype = save.get("dtype", torch.float32)
    with torch.no_grad():
        # The oracle runs in float32 on the weights as saved (bf16-rounded for a bf16
        # checkpoint; the rotary frequencies stay float32, as transformers computes them
        # when it loads a bf16 checkpoint into float32).
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config.vocab_size, size=(8, 16)).astype(np.int32)
    with torch.no_grad():
        result = model(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long))
        prompt = ids[0, :4]
        greedy = model.generate(
            torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=8, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )[0, 4:].numpy().astype(np.int32)  # fmt: skip
    folder = os.path.join(out, family)
    os.makedirs(folder, exist_ok=True)
    model.to(dtype).save_pretrained(folder, max_shard_size=save.get("max_shard_size", "50MB"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}, f)
    np.savez(
        os.path.join(folder, "expected.npz"), ids=ids, logits=result.logits.numpy().astype(np.float32),
        loss=np.float32(result.loss.item()), prompt=prompt, greedy=greedy,
    )  # fmt: skip
    print(family, arch, sorted(os.listdir(folder)))


PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft(out: str) -> None:
    """A random LoRA adapter of the `llama3` fixture, saved by `peft`, and its logits."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "llama3"), dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_TARGETS, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, config).eval()
    g = torch.Generator().manual_seed(52)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B too: the adapted model differs from its base
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float32))
    ids = np.load(os.path.join(out, "llama3", "expected.npz"))["ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids, dtype=torch.long)).logits.numpy().astype(np.float32)
    folder = os.path.join(out, "llama3_lora")
    model.save_pretrained(folder)
    os.remove(os.path.join(folder, "README.md"))  # peft's model card template
    np.savez(os.path.join(folder, "expected.npz"), ids=ids, logits=logits)
    print("llama3_lora", sorted(os.listdir(folder)))


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf"
    if sys.argv[2:] != ["peft"]:
        for family in FAMILIES:
            make(family, out)
    make_peft(out)


if __name__ == "__main__":
    main()
