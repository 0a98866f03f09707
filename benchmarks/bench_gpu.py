"""equishard against plain `jax.jit` and PyTorch on one GPU: tokens/s, MFU, memory, profile.

One command, on a machine with one NVIDIA GPU (JAX with CUDA; PyTorch optional), measures
side by side in one run:

- equishard: the reference GPT's train step through `make_train_step` on a one-device
  mesh (bf16 compute, float32 master weights and AdamW state, clipping at 1.0, the
  non-finite guard, the state donated);
- plain: the same network as a one-device Equinox model under `jax.jit` with the same
  update, timed interleaved with equishard's step (the overhead ratio);
- PyTorch (when `torch` imports): the same network as its users write it
  (`torch.compile`, bf16 autocast, `scaled_dot_product_attention`, fused AdamW, clipping,
  float32 logits for the loss): the same parameter count and FLOP formula;
- a user's plain-Equinox Llama-style model (`--configs llama-1k`) under equishard and
  under its own `jax.jit` loop.

Each measurement runs in a fresh process (its own allocator peak; XLA flags per variant),
prints one JSON row, and the parent writes `gpu.json` and a Markdown table. Tokens/s are
medians of `--steps` steps after compilation and 3 warm-up steps; MFU = tokens/s x
(6 N + 12 L d T) / 989.4 TFLOP/s (H100/H200 SXM dense bf16, attention not halved); peak
memory is the allocator's (`memory_stats()["peak_bytes_in_use"]`, torch's
`max_memory_allocated()`), read before the plain baseline is built. `--profile` adds a
kernel-time breakdown of the first row's step from a `jax.profiler` trace read with
`jax.profiler.ProfileData` (matrix products, attention, elementwise, reductions, copies;
the top kernels).

Variants (`--variants`, each a change to measure against `base` on the first config) are
listed by `--list`; `--best` then measures the combination of those that beat `base` by
more than 1 % on every remaining config. Without a GPU it says so and exits 0;
`--cpu` runs the whole path on the CPU with the `tiny` config (the test suite does).

    python benchmarks/bench_gpu.py [--configs 124m-1k,124m-2k,1.3b-2k] [--variants ...]
        [--best] [--steps 20] [--budget-s 480] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import accelerator_present

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16, SXM

_124M = dict(vocab_size=50304, d_model=768, n_heads=12, n_layers=12, d_ff=2048, tied=True)
# name: (GPTConfig fields, batch, sequence length)
CONFIGS: dict[str, tuple[dict[str, Any], int, int]] = {
    "tiny": (dict(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128, tied=True), 4, 64),
    "124m-1k": (_124M, 16, 1024),
    "124m-2k": (_124M, 8, 2048),
    "350m-2k": (dict(_124M, d_model=1024, n_heads=16, n_layers=24, d_ff=2816), 8, 2048),
    "1.3b-2k": (dict(_124M, d_model=2048, n_heads=16, n_layers=24, d_ff=5504), 4, 2048),
    # A user's plain Equinox model (Llama-style: GQA, SwiGLU, RMSNorm, untied head).
    "llama-1k": (dict(vocab_size=32000, d_model=768, n_heads=12, n_layers=12, d_ff=2048), 16, 1024),
    "llama-tiny": (dict(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128), 4, 64),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A change to measure: GPT config fields and XLA flags, with what we expect of it."""

    gpt: dict[str, Any] = dataclasses.field(default_factory=dict)
    xla_flags: str = ""
    prediction: str = ""
    patches: tuple[str, ...] = ()  # names in PATCHES, applied in the worker before building


VARIANTS: dict[str, Variant] = {
    "base": Variant(prediction="the defaults"),
    "scan-loop": Variant(
        gpt={"scan_unroll": 1},
        prediction="the layer stack as a loop (the default before scan_unroll): -25 % (measured once)",
    ),
    "unroll2": Variant(gpt={"scan_unroll": 2}, prediction="a loop of two layers an iteration"),
    "unfused-ce": Variant(
        gpt={"fused_loss": False},
        prediction="logits [tokens, V] formed whole in float32: +3-4 GiB, a few % slower",
    ),
    "ce-chunk-1k": Variant(
        gpt={"loss_chunk_size": 1024}, prediction="16 loss chunks of 1024 tokens: fewer iterations, +0.2 GiB"
    ),
    "ce-chunk-2k": Variant(
        gpt={"loss_chunk_size": 2048},
        prediction="8 loss chunks of 2048 tokens (B*T*V/8 at 16x1024): -0.4 GiB, within 2 % of 4096",
    ),
    "ce-chunk-4k": Variant(
        gpt={"loss_chunk_size": 4096}, prediction="4 loss chunks of 4096 tokens: fewer iterations, +0.8 GiB"
    ),
    "remat-dots": Variant(
        gpt={"remat": "dots"}, prediction="less memory, elementwise work recomputed: -5-10 % speed"
    ),
    "no-triton-gemm": Variant(
        xla_flags="--xla_gpu_enable_triton_gemm=false",
        prediction="cuBLAS for every product, no Triton GEMM fusions: +6 % (measured once)",
    ),
    "one-product": Variant(
        patches=("one_product",),
        prediction="the SwiGLU's gate/up and the attention's q/k/v by one product split (before "
        "`ColumnParallelLinear.split`): -3 % (measured +3.2 % the other way on an H200)",
    ),
    "rmsnorm-autodiff": Variant(
        patches=("rmsnorm_autodiff",),
        prediction="RMSNorm differentiated by JAX (before its own backward pass): no change on a "
        "GPU (measured once: XLA:GPU fuses the upcasts into their consumers)",
    ),
    "no-dot-merger": Variant(
        xla_flags="--xla_disable_hlo_passes=dot-merger",
        prediction="XLA does not merge the q, k, v weight-gradient products (which share the "
        "layer's input) into one over their concatenated gradients: +1 % if the concatenation "
        "left (1.4 % of the 124 M step) is worth more than the merged product",
    ),
    "no-command-buffer": Variant(
        xla_flags="--xla_gpu_enable_command_buffer=",
        prediction="no CUDA graphs: launch overhead shows: -1-3 %",
    ),
}


def combine(names: list[str]) -> Variant:
    """One variant doing all of `names` (their config fields merged, flags and patches joined)."""
    gpt: dict[str, Any] = {}
    flags, patches = [], []
    for name in names:
        gpt.update(VARIANTS[name].gpt)
        flags.append(VARIANTS[name].xla_flags)
        patches += VARIANTS[name].patches
    return Variant(gpt, " ".join(f for f in flags if f), "+".join(names), tuple(patches))


def _one_product() -> None:
    """Patch the GPT's layers to form the SwiGLU's gate and up (and the attention's q, k,
    v) by one product split in parts, as the library did before `ColumnParallelLinear.split`:
    the split's transpose concatenates the parts' gradients into one `[tokens, parts *
    width]` buffer before the input's gradient product."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from equishard.nn import _transformer as t

    mlp_call, qkv_heads = t.ParallelMLP.__call__, t.ParallelAttention.qkv_heads

    def mlp(self: Any, x: Any, *, key: Any = None, lora_dropout: Any = None) -> Any:
        if not self.swiglu or self.lora is not None:  # adapters: the library's own way
            return mlp_call(self, x, key=key, lora_dropout=lora_dropout)
        gate, up = jnp.split(checkpoint_name(self.up(x), t.MLP_IN), 2, axis=-1)
        return checkpoint_name(self.down(gate * jax.lax.logistic(gate) * up), t.MLP_OUT)

    def heads(self: Any, x: Any, lora_dropout: Any = None) -> Any:
        if self.qkv is None or self.lora is not None:
            return qkv_heads(self, x, lora_dropout)
        n = t.axis_size(self.axis_name)
        qkv = checkpoint_name(self.qkv(x), t.QKV_PROJ)
        qkv = qkv.reshape(*qkv.shape[:-1], 3, self.n_heads // n, self.d_model // self.n_heads)
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]

    t.ParallelMLP.__call__, t.ParallelAttention.qkv_heads = mlp, heads


def _rmsnorm_autodiff() -> None:
    """Patch RMSNorm to be differentiated by JAX (as before its own backward pass), which
    saves a float32 copy of the input, the normalised values and the broadcast weight."""
    import jax
    import jax.numpy as jnp

    from equishard.nn import _transformer as t

    def call(self: Any, x: Any, *, key: Any = None) -> Any:
        h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            weight = t.cast_varying(t.value_of(self.weight).astype(h.dtype), t.varying_axes(h))
            h = h * jnp.broadcast_to(weight, h.shape)
        return h.astype(x.dtype)

    t.RMSNorm.__call__ = call


PATCHES = {"one_product": _one_product, "rmsnorm_autodiff": _rmsnorm_autodiff}


# ---------------------------------------------------------------------------
# The worker: one configuration and variant, in its own process


def _gpt_config(config: str, variant: Variant) -> Any:
    from equishard.models import GPTConfig

    kw = dict(CONFIGS[config][0], **variant.gpt)
    if "scan_unroll" in kw:
        kw["scan_unroll"] = min(kw["scan_unroll"], kw["n_layers"])
    return GPTConfig(**kw)


def _optimizer() -> Any:
    import optax

    return optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def _equishard_step(make_model: Any, loss: Any, device: Any) -> tuple[Any, Any, Any]:
    """`(compiled, arrays, static)`: equishard's donated step on a one-device mesh."""
    import equinox as eqx
    import jax

    from equishard.sharding import Layout
    from equishard.train import MixedPrecision, init_train_state, make_train_step

    layout = Layout("dp=1")
    mesh = layout.mesh([device])
    opt = _optimizer()
    state = init_train_state(make_model, opt, jax.random.key(0), mesh=mesh)
    step = make_train_step(
        loss, opt, mesh=mesh, batch_spec=layout.resolve(1).batch_spec, clip_norm=1.0, donate=True,
        precision=MixedPrecision(jax.numpy.bfloat16),
    )
    arrays, static = eqx.partition(state, eqx.is_array)

    def run(arrays: Any, batch: Any) -> Any:
        new, metrics = step(eqx.combine(arrays, static), batch)
        return eqx.filter(new, eqx.is_array), metrics["loss"]

    return jax.jit(run, donate_argnums=0), arrays, static


def _plain_step(model: Any, loss: Any) -> tuple[Any, Any]:
    """`(jitted, carry)`: the same network and update under plain `jax.jit`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    opt = _optimizer()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    carry = (params, opt.init(params))

    def step(carry: Any, batch: Any) -> Any:
        params, opt_state = carry
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, static), batch))(params)
        norm = optax.tree.norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
        updates, new_opt = opt.update(grads, opt_state, params)
        ok = jnp.isfinite(value) & jnp.isfinite(norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        return (keep(optax.apply_updates(params, updates), params), keep(new_opt, opt_state)), value

    return jax.jit(step, donate_argnums=0), carry


def _timer(fn: Any, carry: dict[str, Any], batch: Any) -> Any:
    import jax

    def one() -> float:
        start = time.perf_counter()
        carry["c"], loss = fn(carry["c"], batch)
        jax.block_until_ready(loss)
        return time.perf_counter() - start

    return one


def _gpt_parts(config: str, variant: Variant) -> tuple[Any, Any, Any, Any]:
    """The reference GPT: `(make_model, es_loss, plain_model_of, plain_loss)`."""
    import jax
    import jax.numpy as jnp

    from equishard.models import GPT, cast_floating
    from equishard.models._gpt import to_single_device
    from equishard.sharding import Layout

    cfg = _gpt_config(config, variant)
    par = Layout("dp=1").resolve(1)
    make = lambda key: GPT(cfg, par, key=key)  # noqa: E731
    es_loss = lambda model, batch, key: model.loss(batch, key)  # noqa: E731  (bf16: compute_dtype)
    plain_of = lambda model: to_single_device(jax.device_get(model))  # noqa: E731
    plain_loss = lambda model, batch: cast_floating(model, jnp.bfloat16).loss(batch)[0]  # noqa: E731
    return make, es_loss, plain_of, plain_loss


def _flops_per_token(config: str, params: int) -> int:
    kw, _, seq = CONFIGS[config]
    return 6 * params + 12 * kw["n_layers"] * kw["d_model"] * seq


def measure(config: str, variant: Variant, *, steps: int, plain: bool, profile: str = "") -> dict[str, Any]:
    """One row: equishard's step (and the plain one, interleaved) for `config` and `variant`."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    device = jax.devices()[0]
    kw, batch_size, seq = CONFIGS[config]
    parts = _llama_parts(config) if config.startswith("llama") else _gpt_parts(config, variant)
    make, es_loss, plain_of, plain_loss = parts
    row: dict[str, Any] = {"config": config, "batch": batch_size, "seq": seq, "device": device.device_kind}
    row["versions"] = f"jax {jax.__version__}, equinox {eqx.__version__}, optax {optax.__version__}"
    start = time.perf_counter()
    es_fn, arrays, static = _equishard_step(make, es_loss, device)
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(eqx.combine(arrays, static).model, eqx.is_array)))
    row.update(params=params, flops_per_token=_flops_per_token(config, params))
    tokens = np.random.default_rng(0).integers(0, kw["vocab_size"], (batch_size, seq + 1), dtype=np.int32)
    batch = jax.device_put(tokens, device)
    compiled = es_fn.lower(arrays, batch).compile()
    row["es_compile_s"] = time.perf_counter() - start
    row.update(_compiled_facts(compiled))
    es = {"c": arrays}
    es_one = _timer(compiled, es, batch)
    for _ in range(3):
        es_one()
    row["es_peak_GiB"] = _peak_bytes(device) / 2**30
    plain_one = None
    if plain:
        model = plain_of(eqx.combine(es["c"], static).model)
        start = time.perf_counter()
        plain_fn, carry = _plain_step(jax.device_put(model, device), plain_loss)
        plain_compiled = plain_fn.lower(carry, batch).compile()
        row["plain_compile_s"] = time.perf_counter() - start
        pc = {"c": carry}
        plain_one = _timer(plain_compiled, pc, batch)
        for _ in range(3):
            plain_one()
    es_times, plain_times = [], []
    for i in range(steps):  # interleaved, alternating which goes first
        pair = [(es_times, es_one)] + ([(plain_times, plain_one)] if plain_one else [])
        for times, one in pair[:: 1 if i % 2 == 0 else -1]:
            times.append(one())
    row.update(_rates("es", es_times, batch_size * seq, row["flops_per_token"], device))
    if plain_times:
        row.update(_rates("plain", plain_times, batch_size * seq, row["flops_per_token"], device))
        row["es_over_plain_time"] = row["es_step_ms"] / row["plain_step_ms"]
    if profile:
        row["profile"] = kernel_profile(es_one, profile)
        text = compiled.as_text()
        row["profile"]["sources"] = kernel_sources(text, [k for k, _ in row["profile"]["top"]])
        with gzip.open(os.path.join(profile, f"step-{config}.hlo.gz"), "wt") as f:
            f.write(text)  # the compiled step, to read what a kernel is
    return row


def _compiled_facts(compiled: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    text = compiled.as_text()
    facts["cudnn_attention"] = "cudnn$fmha" in text or "__cudnn" in text
    try:
        memory = compiled.memory_analysis()
        facts["es_temp_GiB"] = memory.temp_size_in_bytes / 2**30
        facts["es_args_GiB"] = memory.argument_size_in_bytes / 2**30
    except Exception:  # some backends have no memory analysis
        pass
    return facts


def _peak_bytes(device: Any) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", 0))


def _rates(name: str, times: list[float], tokens: int, flops_per_token: int, device: Any) -> dict[str, Any]:
    step = statistics.median(times)
    out = {f"{name}_step_ms": step * 1e3, f"{name}_tokens_s": tokens / step}
    out[f"{name}_tflops"] = tokens / step * flops_per_token / 1e12
    peak = next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)
    if peak:
        out[f"{name}_mfu"] = tokens / step * flops_per_token / peak
    return out


# ---------------------------------------------------------------------------
# Kernel-time profile


def _category(kernel: str) -> str:
    name = kernel.lower()
    if any(s in name for s in ("fmha", "flash", "cudnn", "attention")):
        return "attention (cuDNN)"
    if any(s in name for s in ("gemm", "cublas", "nvjet", "xmma", "cutlass", "sm90_", "matmul", "dot")):
        return "matrix products"
    if "reduce" in name:
        return "reductions"
    if any(s in name for s in ("copy", "memcpy", "memset")):
        return "copies / memset"
    if any(s in name for s in ("fusion", "loop_", "input_", "convert", "concatenate")):
        return "elementwise"
    return "other"


def kernel_profile(one: Any, out_dir: str, steps: int = 5) -> dict[str, Any]:
    """Kernel time per step by category and the top kernels, from a `jax.profiler` trace."""
    import jax
    from jax.profiler import ProfileData

    trace_dir = os.path.join(out_dir, f"trace-{time.time_ns()}")
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    for _ in range(steps):
        one()
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    by_category: collections.Counter[str] = collections.Counter()
    by_kernel: collections.Counter[str] = collections.Counter()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" not in line.name.lower() or "memcpy" in line.name.lower():
                    continue
                for event in line.events:
                    by_category[_category(event.name)] += event.duration_ns
                    by_kernel[event.name[:80]] += event.duration_ns
    total = sum(by_category.values()) or 1
    return {
        "wall_ms": wall / steps * 1e3,
        "kernel_ms": total / steps / 1e6,
        "categories": {k: [v / total, v / steps / 1e6] for k, v in by_category.most_common()},
        "top": [[k, v / total] for k, v in by_kernel.most_common(20)],
    }


def kernel_sources(hlo: str, kernels: list[str]) -> dict[str, str]:
    """For each kernel named like an HLO instruction of the compiled `hlo` text (XLA:GPU
    names a fusion's kernel after it): its shape and the JAX operation it came from (the
    `op_name` of the fused computation's root), e.g. which split's transpose a
    concatenation is."""
    from equishard.report._hlo import _parse_module

    module = _parse_module(hlo)
    by_name = {i.name: i for instructions in module.computations.values() for i in instructions}
    out = {}
    for kernel in kernels:
        # A kernel `loop_add_fusion_9` is the instruction `loop_add_fusion.9`.
        instr = by_name.get(kernel) or by_name.get(re.sub(r"_(\d+)$", r".\1", kernel))
        if instr is None:
            continue
        # A fusion's metadata is its root's: the last instruction of the computation it calls.
        fused = [module.computations[c] for attr, c in instr.callees if attr == "calls" and module.computations.get(c)]
        op = re.search(r'op_name="([^"]*)"', (fused[0][-1] if fused else instr).attrs)
        out[kernel] = f"{instr.shape} {op.group(1) if op else ''}"[:300]
    return out


# ---------------------------------------------------------------------------
# A user's own plain Equinox model (written without equishard)


def _llama_parts(config: str) -> tuple[Any, Any, Any, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    kw = CONFIGS[config][0]

    class Block(eqx.Module):
        norm1: eqx.nn.RMSNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        norm2: eqx.nn.RMSNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        heads: int = eqx.field(static=True)

        def __init__(self, key: Any) -> None:
            d, ff, self.heads = kw["d_model"], kw["d_ff"], kw["n_heads"]
            k = jax.random.split(key, 4)
            self.norm1, self.norm2 = eqx.nn.RMSNorm(d), eqx.nn.RMSNorm(d)
            self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=k[0])
            self.out = eqx.nn.Linear(d, d, use_bias=False, key=k[1])
            self.up = eqx.nn.Linear(d, 2 * ff, use_bias=False, key=k[2])
            self.down = eqx.nn.Linear(ff, d, use_bias=False, key=k[3])

        def __call__(self, x: Any) -> Any:  # f32[T, D], one example
            seq, d = x.shape
            q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm1)(x)), 3, axis=-1)
            heads = lambda a: a.reshape(seq, self.heads, d // self.heads)  # noqa: E731
            o = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            x = x + jax.vmap(self.out)(o.reshape(seq, d))
            gate, up = jnp.split(jax.vmap(self.up)(jax.vmap(self.norm2)(x)), 2, axis=-1)
            return x + jax.vmap(self.down)(jax.nn.silu(gate) * up)

    class Llama(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        norm: eqx.nn.RMSNorm
        head: eqx.nn.Linear

        def __init__(self, key: Any) -> None:
            ke, kb, kh = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(kw["vocab_size"], kw["d_model"], key=ke)
            self.blocks = [Block(k) for k in jax.random.split(kb, kw["n_layers"])]
            self.norm = eqx.nn.RMSNorm(kw["d_model"])
            self.head = eqx.nn.Linear(kw["d_model"], kw["vocab_size"], use_bias=False, key=kh)

        def __call__(self, tokens: Any) -> Any:  # int[T] -> f32[T, V]
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x)).astype(jnp.float32)

    def plain_loss(model: Any, batch: Any) -> Any:
        model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
        logits = jax.vmap(model)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    # equishard's step differentiates the global loss: the mean over the data axis.
    es_loss = lambda model, batch, key: (jax.lax.pmean(plain_loss(model, batch), "dp"), {})  # noqa: E731
    return Llama, es_loss, jax.device_get, plain_loss


# ---------------------------------------------------------------------------
# PyTorch: the same network as its users run it


def torch_rows(configs: list[str], steps: int) -> list[dict[str, Any]]:
    """Rows for the GPT configs, in PyTorch (`torch.compile`, autocast, SDPA, fused AdamW)."""
    import torch

    rows = []
    for config in configs:
        if config.startswith("llama") or config == "tiny":
            continue
        row: dict[str, Any] = {"config": config, "framework": "torch " + torch.__version__}
        try:
            row.update(_torch_measure(config, steps))
        except Exception as error:  # report and go on: one shape failing is a result
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def _torch_measure(config: str, steps: int) -> dict[str, Any]:
    import torch

    kw, batch_size, seq = CONFIGS[config]
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = _torch_gpt(kw, seq).cuda()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, kw["vocab_size"], (batch_size, seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    row: dict[str, Any] = {"params": params, "compile_s": time.perf_counter() - start}
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    flops = 6 * params + 12 * kw["n_layers"] * kw["d_model"] * seq
    row.update(step_ms=t * 1e3, tokens_s=batch_size * seq / t, tflops=batch_size * seq / t * flops / 1e12)
    row["mfu"] = row["tflops"] * 1e12 / PEAK_FLOPS["H100"]
    row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _torch_gpt(kw: dict[str, Any], seq: int) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    V, D, L, H, FF = kw["vocab_size"], kw["d_model"], kw["n_layers"], kw["n_heads"], kw["d_ff"]

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))

        def forward(self, x: Any) -> Any:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight

    def rotate(x: Any, cos: Any, sin: Any) -> Any:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.up, self.down = nn.Linear(D, 2 * FF, bias=False), nn.Linear(FF, D, bias=False)

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            B, T, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D // H).unbind(2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            y = F.scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
            gate, up = self.up(self.n2(x)).chunk(2, -1)
            return x + self.down(F.silu(gate) * up)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(V, D)
            self.blocks = nn.ModuleList([Block() for _ in range(L)])
            self.norm = RMSNorm()
            inv = 1.0 / (10000 ** (torch.arange(0, D // H, 2).float() / (D // H)))
            angles = torch.outer(torch.arange(seq).float(), inv)
            self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
            self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, ids: Any, labels: Any) -> Any:
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            logits = F.linear(self.norm(x), self.embed.weight)
            return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))

    return GPT()


# ---------------------------------------------------------------------------
# The parent: one process per measurement, within a time budget


def _spawn(args: list[str], xla_flags: str, timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    command = [sys.executable, __file__, *args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:.0f} s"}]
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        rows = [{"error": f"exit {done.returncode}: " + " | ".join(tail)[:400]}]
    return rows


class Runner:
    """Runs measurements in child processes until the budget is spent; keeps the rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.budget_s
        self.rows: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def jax(self, config: str, names: list[str], *, plain: bool, profile: bool = False) -> dict[str, Any]:
        variant = combine(names)
        row: dict[str, Any] = {"config": config, "variant": variant.prediction, "framework": "jax"}
        if self.left() < 20:
            row["error"] = "not measured: the time budget was spent"
        else:
            spec = {"config": config, "names": names, "steps": self.args.steps, "plain": plain}
            if profile:
                spec["profile"] = self.args.out
            row.update(_spawn(["--worker", json.dumps(spec)], variant.xla_flags, self.left())[0])
        self._show(row)
        return row

    def torch(self, configs: list[str]) -> None:
        if self.args.torch_configs is not None:
            configs = [c for c in configs if c in self.args.torch_configs.split(",")]
        if self.args.no_torch or not configs or self.left() < 30:
            return
        if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
            print("torch is not importable: the PyTorch side is skipped", flush=True)
            return
        spec = {"configs": configs, "steps": self.args.steps}
        for row in _spawn(["--torch-worker", json.dumps(spec)], "", self.left()):
            self._show({"config": ",".join(configs), **row, "variant": "torch.compile"})

    def _show(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if "profile" in row:
            print(format_profile(row["profile"]), flush=True)


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The plan: the first config's base (with plain, profile) and variants; then the rest."""
    runner = Runner(args)
    configs = args.configs.split(",")
    first, rest = configs[0], configs[1:]
    base = runner.jax(first, [], plain=not args.no_plain, profile=args.profile)
    runner.torch([first])
    winners = []
    for name in [v for v in args.variants.split(",") if v and v != "base"]:
        row = runner.jax(first, [name], plain=False)
        if row.get("es_tokens_s", 0) > 1.01 * base.get("es_tokens_s", float("inf")):
            winners.append(name)
    chosen = winners if args.best and winners else []
    if chosen:
        best = runner.jax(first, chosen, plain=not args.no_plain, profile=args.profile)
        if best.get("es_tokens_s", 0) <= base.get("es_tokens_s", 0):
            chosen = []
    for config in rest:
        runner.jax(config, chosen, plain=not args.no_plain and not config.startswith("1.3b"))
    runner.torch([c for c in rest if not c.startswith("llama")])
    return runner.rows


def format_profile(profile: dict[str, Any]) -> str:
    lines = [
        f"  profile: wall {profile['wall_ms']:.1f} ms/step, kernels {profile['kernel_ms']:.1f} ms/step"
    ]
    for name, (share, ms) in profile["categories"].items():
        lines.append(f"    {name:20} {share * 100:5.1f} %  {ms:7.2f} ms")
    sources = profile.get("sources", {})
    lines += [f"      {share * 100:5.1f} %  {kernel}  {sources.get(kernel, '')}" for kernel, share in profile["top"]]
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of `rows` (one line a measurement)."""
    out = [
        "| config | framework / variant | tokens/s | MFU | step ms | peak GiB | compile s | plain tokens/s | equishard / plain time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = f"{r.get('framework', '')} {r.get('variant', '')}".strip()
        if "error" in r:
            out.append(f"| {r['config']} | {name} | {r['error'][:80]} | | | | | | |")
            continue
        es = r.get("framework") == "jax"
        pre = "es_" if es else ""
        cells = [
            f"{r[pre + 'tokens_s']:,.0f}",
            f"{r.get(pre + 'mfu', 0) * 100:.1f} %",
            f"{r[pre + 'step_ms']:.1f}",
            f"{r.get('es_peak_GiB' if es else 'peak_GiB', 0):.1f}",
            f"{r.get('es_compile_s' if es else 'compile_s', 0):.0f}",
            f"{r['plain_tokens_s']:,.0f}" if "plain_tokens_s" in r else "—",
            f"{r['es_over_plain_time']:.3f}" if "es_over_plain_time" in r else "—",
        ]
        out.append(f"| {r['config']} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="124m-1k,124m-2k,350m-2k,1.3b-2k,llama-1k")
    parser.add_argument(
        "--variants", default="scan-loop,unfused-ce,ce-chunk-1k,ce-chunk-4k,no-triton-gemm"
    )
    parser.add_argument("--best", action="store_true", help="measure the rest with the winning variants")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--no-plain", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-configs", help="the configs PyTorch runs (default: every GPT config)")
    parser.add_argument("--profile", action="store_true", help="a kernel-time profile of the first config")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with the tiny configs (a check)")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker or args.torch_worker:
        return _work(args)
    if args.list:
        for name, v in VARIANTS.items():
            print(f"{name:18} {v.gpt or ''} {v.xla_flags} -- {v.prediction}")
        return 0
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.configs, args.no_torch, args.steps = "tiny,llama-tiny", True, 2
    elif not accelerator_present():
        print("bench_gpu: no GPU here (JAX would run on the CPU): nothing measured.")
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = run_all(args)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(format_table(rows))
    return 0


def _work(args: argparse.Namespace) -> int:
    """A child process: one JAX measurement, or the PyTorch rows; prints `ROW {json}` lines."""
    if args.torch_worker:
        spec = json.loads(args.torch_worker)
        rows = torch_rows(spec["configs"], spec["steps"])
    else:
        spec = json.loads(args.worker)
        variant = combine(spec["names"])
        for patch in variant.patches:
            PATCHES[patch]()
        rows = [measure(spec["config"], variant, steps=spec["steps"], plain=spec["plain"],
                        profile=spec.get("profile", ""))]
    for row in rows:
        print("ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
