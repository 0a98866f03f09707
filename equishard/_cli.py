"""The `equishard` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ._cli_base import HelpFormatter, check_platforms, use_cpu_devices

MAX_DEVICES = 65536
"""The most devices a command simulates (`--devices`): a typo must not take the machine's
memory (the simulated devices and the compiled program grow with it)."""


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse device counts below 1 or above `MAX_DEVICES` before any command starts JAX
    or a process."""
    from ._errors import EquishardError

    devices = getattr(args, "devices", None)
    if devices is not None and devices < 1:
        raise EquishardError(f"--devices must be at least 1, got {devices}.")
    if devices is not None and devices > MAX_DEVICES:
        raise EquishardError(f"--devices {devices} is more than the {MAX_DEVICES} devices equishard simulates at most.")


def _demo(args: argparse.Namespace) -> int:
    use_cpu_devices(args.devices)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import equishard as es

    mesh = es.make_mesh(args.layout)
    # An unmodified eqx.nn.MLP, given Megatron-style specs by path rules: the first
    # layer split over its outputs (column parallel), the second over its inputs (row
    # parallel). eqx.nn.Linear stores weight as [out, in].
    rules = [
        (r"layers\[0\]\.weight", P("tp", None)),
        (r"layers\[0\]\.bias", P("tp")),
        (r"layers\[1\]\.weight", P(None, "tp")),
    ]

    def make(key):
        mlp = eqx.nn.MLP(args.width, args.width, 4 * args.width, depth=1, key=key)
        return es.apply_rules(mlp, rules)

    model = es.sharded_init(make, jax.random.key(0), mesh=mesh)
    print(f"eqx.nn.MLP sharded on {len(mesh.devices.flat)} {jax.devices()[0].platform} devices:\n")
    print(es.format_param_table(model, mesh))

    data_axes = tuple(a for a in mesh.axis_names if a != "tp")

    @es.filter_shard_map(mesh=mesh, in_specs=(None, P(data_axes)), out_specs=P(data_axes))
    def forward(model, x):
        first, second = es.unbox(model).layers
        h = jax.nn.relu(x @ first.weight.T + first.bias)  # f32[B/dp, D] @ f32[D, F/tp]
        y = jax.lax.psum(h @ second.weight.T, "tp")  # f32[B/dp, F/tp] @ f32[F/tp, D]
        return y + second.bias

    x = jax.random.normal(jax.random.key(1), (16, args.width))
    sharded = forward(model, x)
    plain = jax.vmap(es.unbox(es.gather(model)))(x)
    err = float(jnp.linalg.norm(es.gather(sharded) - plain) / jnp.linalg.norm(plain))
    print(f"\nsharded forward vs single-device forward: relative error {err:.1e}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .distributed import initialize, is_launched

    if is_launched():  # one of several processes (`equishard launch`): join them first
        initialize()
        check_platforms()
    else:
        use_cpu_devices(args.devices)
    from ._app import TrainConfig, run
    from ._app._internal import from_args

    run(from_args(TrainConfig, args))
    return 0


def _add_train(sub: Any) -> argparse.ArgumentParser:
    """Add `equishard train`, its options generated from `TrainCommand`'s fields."""
    from ._app._internal import TrainCommand, add_options

    p = sub.add_parser(
        "train",
        help="train the reference GPT on bytes of the Python standard library",
        description=(
            "Train the reference GPT (equishard.models.GPT) on the bytes of the running "
            "Python's standard library (a fixed selection of its top-level modules, one "
            "file in 20 held out for validation), under any parallel layout. Writes "
            "<run-dir>/metrics.jsonl, <run-dir>/loss.png and checkpoints."
        ),
        formatter_class=HelpFormatter,
    )
    add_options(p, TrainCommand)
    p.set_defaults(run=_train)
    return p


def _apply_config(train: argparse.ArgumentParser, argv: Sequence[str] | None, args: argparse.Namespace) -> argparse.Namespace:
    """Parse the command line again with `--config`'s values as the defaults: flags win."""
    from ._app._internal import load_config

    train.set_defaults(**load_config(args.config))
    tokens = list(sys.argv[1:] if argv is None else argv)
    return train.parse_args(tokens[tokens.index("train") + 1 :])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `equishard` console script and `python -m equishard`."""
    from ._version import __version__

    parser = argparse.ArgumentParser(prog="equishard", description="equishard: sharded training for Equinox models.")
    parser.add_argument("--version", action="version", version=f"equishard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = _add_train(sub)
    from ._cli_report import add_report_parsers

    add_report_parsers(sub)
    from ._cli_text import add_text_parsers

    add_text_parsers(sub)
    from ._launch import add_launch_parser

    add_launch_parser(sub)
    demo = sub.add_parser(
        "demo",
        help="shard an eqx.nn.MLP over simulated CPU devices and print its sharding table",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--layout", default="dp=2,tp=4", help="mesh layout, e.g. dp=2,tp=4")
    demo.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    demo.add_argument("--width", type=int, default=256, help="the MLP's input/output width")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    if args.command is None:  # bare `equishard`: what it can do
        parser.print_help()
        return 0
    from ._errors import EquishardError

    try:
        from ._env import check_jax_environment

        check_jax_environment()  # again: the variable may have changed since the import
        if args.command == "train" and args.config is not None:
            args = _apply_config(train, argv, args)
            args.command = "train"
        _check_counts(args)
        return args.run(args)
    except EquishardError as err:
        # A clear one-paragraph message, no traceback from inside JAX.
        print(f"equishard {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"equishard {args.command}: error: interrupted (Ctrl-C){_last_step(args)}.", file=sys.stderr)
        return 2


def _last_step(args: argparse.Namespace) -> str:
    """Where an interrupted `train` can resume from: its last complete checkpoint."""
    import pathlib

    if args.command != "train":
        return ""
    from .train._internal import committed_steps

    directory = pathlib.Path(args.checkpoint_dir or pathlib.Path(args.run_dir) / "checkpoints")
    steps = committed_steps(directory)
    if not steps:
        return f"; no complete checkpoint in {directory}"
    return f"; the last complete checkpoint is step {steps[-1]} in {directory} (--resume continues from it)"


if __name__ == "__main__":
    sys.exit(main())
