"""Time to a compiled first step: `init_train_state` + the step's compile, against the
plain Equinox loop's init + compile of the same loss and update, on one CPU device.

The model is the ViT of the "Your own model" guide at width 48, depth 3 (83 k
parameters). Each measurement runs in a fresh process (nothing cached); the median of
`--repeats` processes is reported:

    python benchmarks/bench_first_step.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(route: str) -> dict[str, float]:
    """In this process: the seconds of init and of compile by `route` (`plain`, `equishard`),
    and of JAX's phases over both (tracing, lowering, XLA's compile: `jax.monitoring`)."""
    t0 = time.perf_counter()
    import jax

    phases: dict[str, float] = {}

    def record(event: str, seconds: float, **_: object) -> None:
        if event.startswith("/jax/core/compile/"):
            name = event.removeprefix("/jax/core/compile/")
            phases[name] = phases.get(name, 0.0) + seconds

    jax.monitoring.register_event_duration_secs_listener(record)
    import numpy as np
    import optax

    sys.path.insert(0, os.path.join(ROOT, "docs", "examples"))
    import equinox as eqx
    from jax.sharding import PartitionSpec as P

    import equishard as es
    from equishard.core import example_keys
    from equishard.train import init_train_state, make_train_step

    source = open(os.path.join(ROOT, "docs", "examples", "your_own_cnn_and_vit.py")).read()
    model_code = source.split("# --8<-- [start:vit-model]")[1].split("# --8<-- [end:vit-model]")[0]
    scope = {"jax": jax, "jnp": jax.numpy, "eqx": eqx, "optax": optax, "example_keys": example_keys}
    exec(model_code, scope)  # the guide's ViT, as written there
    ViT = scope["ViT"]
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32))
    optimizer = optax.adamw(3e-3)
    imported = time.perf_counter()
    key = jax.random.key(0)
    if route == "plain":
        model = ViT(dim=48, depth=3, key=jax.random.fold_in(key, 0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        jax.block_until_ready(eqx.filter(model, eqx.is_array))
        initialised = time.perf_counter()
        loss_fn = scope["vit_loss"](())

        @eqx.filter_jit
        def step(model, opt_state, batch, key):
            index = jax.numpy.arange(batch[0].shape[0])
            (loss, _), grads = eqx.filter_value_and_grad(lambda m: loss_fn(m, batch, key, index=index), has_aux=True)(model)
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        step.lower(model, opt_state, batch, key).compile()
    else:
        mesh = es.make_mesh("dp=1")
        state = init_train_state(lambda k: ViT(dim=48, depth=3, key=k), optimizer, key, mesh=mesh)
        jax.block_until_ready(eqx.filter(state, eqx.is_array))
        initialised = time.perf_counter()
        make_train_step(scope["vit_loss"](("dp",)), optimizer, mesh=mesh, batch_spec=P("dp")).compile(state, batch)
    compiled = time.perf_counter()
    return {"import": imported - t0, "init": initialised - imported, "compile": compiled - initialised, **phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=["plain", "equishard"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    results: dict[str, list[dict[str, float]]] = {"plain": [], "equishard": []}
    for _ in range(args.repeats):
        for route in results:  # interleaved
            out = subprocess.run([sys.executable, __file__, "--one", route], env=env, check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
            results[route].append(json.loads(out.strip().splitlines()[-1]))
    medians = {}
    for route, runs in results.items():
        medians[route] = {k: statistics.median(r[k] for r in runs) for k in ("init", "compile")}
        total = statistics.median(r["init"] + r["compile"] for r in runs)
        print(f"{route:10} init {medians[route]['init']:.2f} s  compile {medians[route]['compile']:.2f} s  "
              f"init+compile {total:.2f} s  (median of {len(runs)}: "
              + ", ".join(f"{r['init'] + r['compile']:.2f}" for r in runs) + ")")  # fmt: skip
    for route, runs in results.items():
        names = sorted({k for r in runs for k in r} - {"import", "init", "compile"})
        print(f"{route:10} JAX phases (median s):", ", ".join(f"{k} {statistics.median(r.get(k, 0.0) for r in runs):.2f}" for k in names))
    plain = statistics.median(r["init"] + r["compile"] for r in results["plain"])
    ours = statistics.median(r["init"] + r["compile"] for r in results["equishard"])
    print(f"equishard / plain: {ours / plain:.2f}")


if __name__ == "__main__":
    main()
