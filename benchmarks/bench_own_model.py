"""A user's own plain-Equinox model with tensor parallelism: explicit layers vs the global view.

The Llama-style model of the "Your own model" guide (GQA, SwiGLU, dropout, untied head;
written without equishard), one train step (adamw, dropout on) on `dp=4,tp=2` and
`fsdp=4,tp=2`, two ways:

- explicit: `equishard.parallelize` (its plan) and `fsdp_wrap`, in the local view —
  every collective is one equishard's layers call;
- global view: the same splits as path rules, `make_train_step(view="global")`, XLA
  (GSPMD) choosing the collectives.

Collective bytes per device per step, by kind, read from each compiled program by the
HLO reader, and the compiler's temporary memory per device.

    python benchmarks/bench_own_model.py [--batch 16] [--seq 16]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from _common import use_simulated_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    use_simulated_cpu_devices(8)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import equishard as es
    from equishard.report import collective_bytes, read_collectives
    from equishard.train import init_train_state, make_train_step
    from tests.test_own_model import SEQ, VOCAB, Llama, loss_for, make_model, tp_rules

    batch = np.random.default_rng(0).integers(0, VOCAB, (args.batch, SEQ + 1), dtype=np.int32)
    optimizer = optax.adamw(3e-3)
    print(f"{'layout':12} {'route':9} {'all-gather':>11} {'reduce-scat':>11} {'all-reduce':>11} {'other':>9} {'total':>11} {'temp':>9}")
    for layout in ("dp=4,tp=2", "fsdp=4,tp=2"):
        mesh = es.make_mesh(layout)
        data = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp"))
        fsdp = "fsdp" if "fsdp" in data else None
        routes = {
            "explicit": (make_model(mesh), loss_for(data), "local"),
            "global": (lambda k: es.apply_rules(Llama(key=k), tp_rules(fsdp)), loss_for((), unbox=True), "global"),
        }
        for route, (make, loss_fn, view) in routes.items():
            state = init_train_state(make, optimizer, jax.random.key(0), mesh=mesh)
            step = make_train_step(loss_fn, optimizer, mesh=mesh, batch_spec=P(data), view=view)
            compiled = step.lower(state, batch).compile()
            ops = read_collectives(compiled)
            kinds = {k: collective_bytes(op for op in ops if op.kind == k) for k in ("all-gather", "reduce-scatter", "all-reduce")}
            other = collective_bytes(op for op in ops if op.kind not in kinds)
            temp = compiled.memory_analysis().temp_size_in_bytes
            row = " ".join(f"{v / 1024:10.1f}K" for v in (*kinds.values(), other)) + f" {sum(kinds.values(), other) / 1024:10.1f}K"
            print(f"{layout:12} {route:9} {row} {temp / 1024:8.0f}K")


if __name__ == "__main__":
    main()
