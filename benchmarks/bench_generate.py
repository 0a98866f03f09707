"""Generation per token: the key/value cache against recomputing the window.

`python benchmarks/bench_generate.py`: the `small` preset (4 layers, d_model 192, bytes),
float32, one CPU device, a 512-byte prompt:

- cached: `equishard.models.Generator` (prefill once, then one compiled decode step per
  token), per-token time of 32 decode steps at positions 512-543;
- recomputing: the path `sample_text` had before, one full forward pass over the padded
  window (compiled once) per token, at position 512.

Then, on 8 simulated CPU devices under fsdp=4,tp=2, the decode step with the parameters
gathered once against gathered per layer in every step: per-token time and the compiled
step's bytes accessed and collective bytes per device.

Each figure is the best of `REPEATS` timed runs after a compiling one.
"""

from __future__ import annotations

import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import equishard as es  # noqa: E402
from equishard.models import GPT, PRESETS, Generator  # noqa: E402
from equishard.report import collective_bytes, read_collectives  # noqa: E402

PROMPT = 512
NEW = 33
MAX_LEN = PROMPT + 64
REPEATS = int(os.environ.get("REPEATS", "3"))


def _best(fn) -> float:
    fn()  # compile
    return min(_timed(fn) for _ in range(REPEATS))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cached_vs_recomputing() -> tuple[float, float]:
    """Seconds per token at position 512: (cached, recomputing)."""
    config = PRESETS["small"]
    model = GPT(config, key=jax.random.key(0))
    device = jax.devices()[0]
    model = jax.device_put(model, device)
    mesh = jax.sharding.Mesh(np.array([device]), ("dp",))
    prompt = list(np.random.default_rng(0).integers(0, 256, PROMPT))
    generator = Generator(model, mesh, max_len=MAX_LEN)

    def cached() -> float:
        out = generator.generate([prompt], max_new_tokens=NEW)
        return out.decode_seconds / out.decode_steps

    cached()  # compile
    per_token = min(cached() for _ in range(REPEATS))
    forward = eqx.filter_jit(lambda m, ids, last: jnp.argmax(m(ids)[0, last]))
    window = np.zeros((1, MAX_LEN), np.int32)
    window[0, :PROMPT] = prompt
    ids = jax.device_put(jnp.asarray(window), device)

    def recompute() -> None:
        for _ in range(8):
            forward(model, ids, PROMPT - 1).block_until_ready()

    return per_token, _best(recompute) / 8


def gather_modes() -> dict[str, dict[str, float]]:
    """fsdp=4,tp=2: per-token time and bytes of the decode step, per gather mode."""
    config = PRESETS["small"]
    layout = es.Layout("fsdp=4,tp=2").resolve(8)
    mesh = layout.mesh()
    model = es.sharded_init(lambda k: GPT(config, layout, key=k), jax.random.key(0), mesh=mesh)
    prompts = [list(np.random.default_rng(i).integers(0, 256, PROMPT)) for i in range(4)]
    out = {}
    for mode in ("once", "per_layer"):
        generator = Generator(model, mesh, max_len=MAX_LEN, gather=mode)

        def run(generator: Generator = generator) -> float:
            result = generator.generate(prompts, max_new_tokens=NEW)
            return result.decode_seconds / result.decode_steps

        run()
        compiled = generator.compiled_decode(4)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[mode] = {
            "ms_per_token": 1e3 * min(run() for _ in range(REPEATS)),
            "bytes_accessed_mib": cost["bytes accessed"] / 2**20,
            "collective_mib": collective_bytes(read_collectives(compiled.as_text() or "")) / 2**20,
        }
    return out


def main() -> None:
    cached, recomputing = cached_vs_recomputing()
    print(f"small, one CPU device, position {PROMPT}: cached {1e3 * cached:.2f} ms/token, "
          f"recomputing {1e3 * recomputing:.2f} ms/token, {recomputing / cached:.1f}x")  # fmt: skip
    for mode, row in gather_modes().items():
        print(f"fsdp=4,tp=2 gather={mode}: {row['ms_per_token']:.2f} ms/token, bytes accessed "
              f"{row['bytes_accessed_mib']:.2f} MiB, collectives {row['collective_mib']:.2f} MiB per device")  # fmt: skip


if __name__ == "__main__":
    main()
