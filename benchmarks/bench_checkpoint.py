"""Checkpoint checksums: what verifying every array costs on a large checkpoint.

A state of `--gib` GiB of f32 arrays (64 MiB each, half split over "fsdp", half
replicated; like a model plus its Adam moments) is saved three ways and restored two:
the checksums alone (computed on the devices and all-reduced), a synchronous save with
`checksums=False` and with checksums (the default), a restore with and without
verification. Every number is the median of `--repeats` runs after one warm-up.

    python benchmarks/bench_checkpoint.py --gib 1

On the CPU the checksum runs at memory bandwidth divided among the simulated devices;
writing goes at the disk's speed. The ratio is what a user pays for verified restores.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from _common import use_simulated_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import equishard as es
    from equishard.train import Checkpointer
    from equishard.train._format import checksums

    mesh = es.make_mesh(f"fsdp={len(jax.devices())}")
    n = max(1, int(args.gib * 16))  # 64 MiB arrays
    state = {}
    for i in range(n):
        spec = P("fsdp") if i % 2 == 0 else P()
        make = jax.jit(
            lambda k: jax.random.normal(k, (4096, 4096)), out_shardings=NamedSharding(mesh, spec)
        )
        state[f"a{i}"] = es.Sharded(make(jax.random.key(i)), spec)
    jax.block_until_ready(state)
    size = sum(x.value.nbytes for x in state.values())
    plain = {k: v.value for k, v in state.items()}

    def median(fn):
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    root = tempfile.mkdtemp(prefix="bench-ckpt-")
    counter = [0]

    def save(verify: bool) -> None:
        counter[0] += 1
        with Checkpointer(f"{root}/{counter[0]}", async_save=False, checksums=verify) as ckpt:
            ckpt.save(1, state)
        shutil.rmtree(f"{root}/{counter[0]}")

    with Checkpointer(f"{root}/r", async_save=False) as ckpt:
        ckpt.save(1, state)

    def restore(verify: bool) -> None:
        with Checkpointer(f"{root}/r", checksums=verify) as ckpt:
            jax.block_until_ready(ckpt.restore(state))

    t_sum = median(lambda: checksums(plain))
    t_save0, t_save1 = median(lambda: save(False)), median(lambda: save(True))
    t_rest0, t_rest1 = median(lambda: restore(False)), median(lambda: restore(True))
    shutil.rmtree(root)
    gib = size / 2**30
    print(f"state: {gib:.2f} GiB in {n} arrays on {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(f"checksums alone: {t_sum:.3f} s ({gib / t_sum:.1f} GiB/s)")
    print(f"save (sync):     {t_save0:.3f} s without, {t_save1:.3f} s with checksums ({t_save1 / t_save0:.2f}x)")
    print(f"restore:         {t_rest0:.3f} s without, {t_rest1:.3f} s with verification ({t_rest1 / t_rest0:.2f}x)")


if __name__ == "__main__":
    main()
