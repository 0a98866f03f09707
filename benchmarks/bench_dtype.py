"""Train-step speed of the reference GPT in float32 and bfloat16 compute, same run.

    python benchmarks/bench_dtype.py            # on whatever devices JAX sees
    python benchmarks/bench_dtype.py --layout dp=8 --d-model 192 --layers 4   # CPU-sized

Master weights stay float32; `--dtype bfloat16` casts them to bfloat16 at the start of
the loss (the gathers and matrix products then run in bfloat16). Prints tokens/s of each
and the ratio. On the CPU XLA emulates bfloat16 arithmetic, so the ratio there says
nothing about accelerators; the script runs unchanged on a GPU.
"""

from __future__ import annotations

import argparse

from _common import median_time, use_simulated_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default=None, help="default: dp=<all devices>")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from equishard.models import GPT, GPTConfig, cast_floating, count_parameters
    from equishard.sharding import Layout
    from equishard.train import init_train_state, make_train_step

    layout = Layout(args.layout or f"dp={jax.device_count()}")
    mesh = layout.mesh()
    config = GPTConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
        n_layers=args.layers, d_ff=args.d_ff,
    )  # fmt: skip
    par = layout.resolve()
    optimizer = optax.adamw(1e-4)
    batch = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    tokens = args.batch * args.seq
    print(
        f"GPT d_model={args.d_model} layers={args.layers} d_ff={args.d_ff}, batch "
        f"{args.batch} x {args.seq}, layout {layout.spec} on {mesh.devices.size} "
        f"{jax.devices()[0].device_kind}"
    )
    results = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        state = init_train_state(lambda k: GPT(config, par, key=k), optimizer, jax.random.key(0), mesh=mesh)

        def loss_fn(model, b, key, dtype=dtype):
            return cast_floating(model, dtype).loss(b, key)

        step = make_train_step(loss_fn, optimizer, mesh=mesh, batch_spec=layout.resolve().batch_spec, donate=True)
        holder = {"state": state}

        def run():
            holder["state"], metrics = step(holder["state"], batch)
            return metrics["loss"]

        seconds = median_time(run, repeats=10, warmup=2)
        results[name] = tokens / seconds
        print(f"{name:>9}: {seconds * 1e3:8.2f} ms/step, {tokens / seconds:12,.0f} tokens/s, loss {float(run()):.4f}")
    print(f"parameters: {count_parameters(state.model) / 1e6:.1f} M; bfloat16 / float32 speed: {results['bfloat16'] / results['float32']:.2f}x")


if __name__ == "__main__":
    main()
