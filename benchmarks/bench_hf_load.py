"""Loading a Hugging Face checkpoint by slice: bytes read, peak memory and time.

A synthetic `LlamaForCausalLM` checkpoint of 1.3 GiB (float32, several safetensors files
with their index) is written once; then

    python benchmarks/bench_hf_load.py make DIR     # write the checkpoint (if absent)
    python benchmarks/bench_hf_load.py one DIR      # one process, fsdp=8: time and peak RSS
    equishard launch -n 2 --devices 8 -- python benchmarks/bench_hf_load.py reads DIR

`one` evicts the files from the page cache (`posix_fadvise(DONTNEED)`), times
`safetensors.numpy.load_file` of every file, evicts them again, and times
`equishard.models.load_hf` onto fsdp=8, with the peak RSS (`ru_maxrss`) before and after.
`reads` (each process of a 2-process run, 4 devices each) evicts the files, loads onto
fsdp=8, and reports the bytes this process made the kernel fetch from the disk
(`read_bytes` of `/proc/self/io`, an instrument the loader does not control) against the
bytes of its devices' distinct blocks; twice, the second load's count free of what the
runtime itself fetches the first time.

All three take under a minute on 2 CPU cores (make 7 s, one about 10 s, reads about 15 s).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_hidden_layers": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "vocab_size": 32768, "tie_word_embeddings": False, "dtype": "float32",
}  # fmt: skip


def make(folder: str) -> None:
    from equishard.models._hf import _tensor_shapes, gpt_config_from_hf
    from equishard.train import OutTensor, write_safetensors

    if os.path.exists(os.path.join(folder, "config.json")):
        return
    os.makedirs(folder, exist_ok=True)
    shapes = _tensor_shapes(gpt_config_from_hf(CONFIG), CONFIG)
    rng = np.random.default_rng(0)
    out = [
        OutTensor(n, s, np.float32, lambda s=s: rng.standard_normal(s, dtype=np.float32))
        for n, s in sorted(shapes.items())
        if not n.endswith("_proj.bias")
    ]
    write_safetensors(folder, out, max_shard_bytes=300 * 2**20)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    os.sync()  # on disk: dirty pages cannot be evicted, and a cold load must find none


def _evict(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def one(folder: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import equishard as es
    from equishard.models import count_parameters, load_hf

    layout = es.Layout("fsdp=8")
    mesh, par = layout.mesh(), layout.resolve()
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    from safetensors.numpy import load_file

    # The load first, in a process whose peak RSS is the runtime's alone so far.
    _evict(folder)
    before = _rss_gib()
    t0 = time.perf_counter()
    model = load_hf(folder, par, mesh)
    jax.block_until_ready(jax.tree.leaves(model))
    t_load = time.perf_counter() - t0
    after = _rss_gib()
    _evict(folder)
    t0 = time.perf_counter()
    total = 0
    for f in files:
        total += sum(a.nbytes for a in load_file(os.path.join(folder, f)).values())  # freed at once
    t_file = time.perf_counter() - t0
    model_gib = count_parameters(model) * 4 / 2**30
    print(f"checkpoint {total / 2**30:.2f} GiB in {len(files)} files; model {model_gib:.2f} GiB")
    print(f"load_file, every file once (cold): {t_file:.2f} s")
    print(f"load_hf onto fsdp=8 (cold):        {t_load:.2f} s  ({t_load / t_file:.2f}x)")
    print(f"peak RSS {before:.2f} -> {after:.2f} GiB: +{after - before:.2f} GiB ({(after - before) / model_gib:.2f}x the model)")


def reads(folder: str) -> None:
    from equishard.distributed import initialize

    initialize()  # join the other process, before any JAX computation
    import jax

    import equishard as es
    from equishard.models import load_hf

    layout = es.Layout("fsdp=8")
    mesh, par = layout.mesh(), layout.resolve()
    from jax.experimental import multihost_utils

    # Twice, each load cold for the checkpoint's files (both processes evict them): the
    # second's count holds the files' pages alone, the first's also what the runtime
    # faulted in for its first resharding (its code pages, when evicted by other work).
    for attempt in ("first", "second"):
        _evict(folder)
        multihost_utils.sync_global_devices(f"evicted {attempt}")
        start = _read_bytes()
        model = load_hf(folder, par, mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read = _read_bytes() - start
        multihost_utils.sync_global_devices(f"loaded {attempt}")
        # The distinct blocks this process's devices hold (a block on several devices once).
        held = sum(
            sum({tuple((i.start, i.stop) for i in s.index): s.data.nbytes for s in x.addressable_shards}.values())
            for x in jax.tree.leaves(model)
        )
        del model
        print(
            f"process {jax.process_index()}, {attempt} load: read {read / 2**20:.1f} MiB from disk for "
            f"blocks of {held / 2**20:.1f} MiB ({read / held:.3f}x)"
        )


if __name__ == "__main__":
    what, folder = sys.argv[1], sys.argv[2]
    {"make": make, "one": one, "reads": reads}[what](folder)
