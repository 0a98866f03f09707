"""FSDP-8 train step: equishard vs plain `jax.jit` + NamedSharding (GSPMD), side by side.

For one train step of an MLP whose matrices are all split over "fsdp" (8 devices):
collective bytes per device read from each compiled program by the HLO reader, against
the analytical minimum 3(N-1)/N·P_sharded + 2(N-1)/N·P_replicated (two all-gathers —
forward, and again in backward — and one reduce-scatter per matrix; an all-reduce of
the replicated arrays' gradients); compile time, median step time and temporary memory.

    python benchmarks/bench_fsdp.py

On the CPU XLA runs collectives synchronously, so step times show overhead, not
overlap; the bytes are what they would be on any backend. The default batch (2048
examples) is FSDP's regime, activations larger than a layer's weights; with a small
batch (`--batch 64`) GSPMD instead keeps the weights split and gathers activations,
which moves fewer bytes there — FSDP is the wrong layout for that step.
"""

from __future__ import annotations

import argparse

from _common import median_time, timed, use_simulated_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2048)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import equishard as es
    from equishard.nn import FSDP
    from equishard.report import collective_bytes, count_collectives, read_collectives

    class Layer(eqx.Module):
        w1: jax.Array
        b1: jax.Array
        w2: jax.Array
        b2: jax.Array

        def __init__(self, *, key):
            k1, k2 = jax.random.split(key)
            self.w1 = jax.random.normal(k1, (args.width, args.hidden)) / args.width**0.5
            self.b1 = jnp.zeros(args.hidden)
            self.w2 = jax.random.normal(k2, (args.hidden, args.width)) / args.hidden**0.5
            self.b2 = jnp.zeros(args.width)

        def __call__(self, x):
            return x + jax.nn.gelu(x @ self.w1 + self.b1[None]) @ self.w2 + self.b2[None]

    n = 8
    min_size = args.width * args.hidden  # every matrix split, vectors replicated
    optimizer = optax.sgd(1e-2)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.width))
    t = jax.random.normal(jax.random.key(2), (args.batch, args.width))

    def loss_of(layers, x, t):
        for layer in layers:
            x = layer(x)
        return jnp.mean((x - t) ** 2)

    # ---- equishard: the whole step inside one filter_shard_map (local view)
    mesh = es.make_mesh("fsdp=8")

    def make(key):
        return [FSDP(Layer(key=k), "fsdp", min_weight_size=min_size) for k in jax.random.split(key, args.depth)]

    model = es.sharded_init(make, jax.random.key(0), mesh=mesh)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def es_step(model, opt_state, x, t):
        @es.filter_shard_map(mesh=mesh, in_specs=(None, None, P("fsdp"), P("fsdp")), out_specs=(None, None, P()))
        def step(model, opt_state, x, t):
            def loss(model):
                return jax.lax.pmean(loss_of(model, x, t), "fsdp")

            value, grads = eqx.filter_value_and_grad(loss)(model)
            updates, opt_state = optimizer.update(grads, opt_state)
            return eqx.apply_updates(model, updates), opt_state, value

        return step(model, opt_state, x, t)

    # ---- GSPMD: the same parameters, plain jit + NamedSharding on Auto axes
    auto = es.make_mesh("fsdp=8", axis_types=AxisType.Auto)
    plain = es.unbox(es.gather(model))
    shardings = jax.tree.map(
        lambda s: None if s is None else NamedSharding(auto, s),
        es.specs_of(model),
        is_leaf=lambda s: s is None or isinstance(s, P),
    )
    plain_layers = [layer.module for layer in plain]
    layer_shardings = [layer.module for layer in shardings]
    g_params = jax.device_put(eqx.filter(plain_layers, eqx.is_array), layer_shardings)
    g_opt = optimizer.init(g_params)
    data_sharding = NamedSharding(auto, P("fsdp"))

    @jax.jit
    def gspmd_step(params, opt_state, x, t):
        value, grads = jax.value_and_grad(loss_of)(params, x, t)
        updates, opt_state = optimizer.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        params = jax.lax.with_sharding_constraint(params, layer_shardings)
        return params, opt_state, value

    xs, ts = jax.device_put(x, data_sharding), jax.device_put(t, data_sharding)

    es_compiled, es_compile_s = timed(lambda: es_step.lower(model, opt_state, x, t).compile())
    g_compiled, g_compile_s = timed(lambda: gspmd_step.lower(g_params, g_opt, xs, ts).compile())

    es_loss = float(es_step(model, opt_state, x, t)[2])
    g_loss = float(gspmd_step(g_params, g_opt, xs, ts)[2])

    es_ops, g_ops = read_collectives(es_compiled), read_collectives(g_compiled)
    rows = es.param_table(model, mesh)
    sharded = sum(r.total_bytes for r in rows if "fsdp" in str(r.spec))
    replicated = sum(r.total_bytes for r in rows) - sharded
    minimum = 3 * (n - 1) / n * sharded + 2 * (n - 1) / n * replicated

    es_time = median_time(lambda: es_step(model, opt_state, x, t))
    g_time = median_time(lambda: gspmd_step(g_params, g_opt, xs, ts))
    es_mem = es_compiled.compiled.memory_analysis()
    g_mem = g_compiled.memory_analysis()

    print(f"FSDP-8 train step, MLP {args.depth} x ({args.width} -> {args.hidden} -> {args.width}), batch {args.batch}")
    print(f"parameters: {sharded / 2**20:.2f} MiB split over fsdp, {replicated / 2**10:.1f} KiB replicated")
    print(f"loss (same step, same parameters): equishard {es_loss:.6f}, GSPMD {g_loss:.6f}")
    print(f"{'':28}{'equishard':>14}{'GSPMD':>14}{'ratio':>10}")
    b_es, b_g = collective_bytes(es_ops), collective_bytes(g_ops)
    print(f"{'collective bytes/device':28}{b_es / 2**20:>13.3f}M{b_g / 2**20:>13.3f}M{b_g / b_es:>10.2f}")
    print(f"{'  over the minimum':28}{b_es / minimum:>14.3f}{b_g / minimum:>14.3f}")
    print(f"{'median step time':28}{es_time * 1e3:>12.2f}ms{g_time * 1e3:>12.2f}ms{g_time / es_time:>10.2f}")
    print(f"{'compile time':28}{es_compile_s:>13.2f}s{g_compile_s:>13.2f}s")
    print(f"{'temporary memory/device':28}{es_mem.temp_size_in_bytes / 2**20:>13.3f}M{g_mem.temp_size_in_bytes / 2**20:>13.3f}M")
    print(f"analytical minimum: {minimum / 2**20:.3f} MiB per device")
    print(f"equishard collectives: {count_collectives(es_ops)}")
    print(f"GSPMD collectives:     {count_collectives(g_ops)}")


if __name__ == "__main__":
    main()
