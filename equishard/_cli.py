"""The `equishard` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ._cli_base import HelpFormatter, add_layout_options, check_platforms, use_cpu_devices

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

    fields = {f for f in TrainConfig.__dataclass_fields__}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    run(config)
    return 0


def _clip_norm(text: str) -> float | None:
    """`--clip-norm`: a number, `0` or `none` (no clipping, as in nanoGPT)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (or none)") from None
    return None if value == 0 else value


def _add_train(sub: Any) -> argparse.ArgumentParser:
    from ._app import TrainConfig
    from ._cli_report import add_remat_options
    from .models import PRESETS

    d = TrainConfig()
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
    p.add_argument("--config", default=None, metavar="FILE", help="a TOML file of options (any option below, as batch_size = 16 or batch-size = 16); flags given here override it. A run writes its resolved options to <run-dir>/config.toml")
    add_layout_options(p, default=d.layout)
    p.add_argument("--model", default=d.model, choices=list(PRESETS), help="model size preset (the registry inspect and plan share; one too large for this machine is refused)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps to train for")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="sequence length, in bytes")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps, then cosine decay")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: <run-dir>/checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="save a checkpoint every N steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir (any layout)")
    p.add_argument("--resume-step", type=int, default=None, help="continue from this checkpoint step instead of the latest (implies --resume)")
    p.add_argument("--overwrite", action="store_true", help="start anew in a --run-dir that holds an earlier run: its files (checkpoints included) are moved into <run-dir>/previous-<UTC time>/, nothing is deleted")
    p.add_argument("--require-verified", action="store_true", help="refuse to resume a checkpoint that carries no checksums (saved with --no-verify-checkpoints); without it such a step is restored with a warning")
    p.add_argument("--clip-norm", type=_clip_norm, default=d.clip_norm, help="clip the gradient to this global norm; 0 or none: no clipping")
    p.add_argument("--max-skipped-steps", type=int, default=d.max_skipped_steps, help="stop with an error after this many consecutive steps skipped as non-finite")
    p.add_argument("--no-verify-checkpoints", dest="verify_checkpoints", action="store_false", help="neither record nor check the arrays' checksums in checkpoints")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initialisation and of the data order")
    p.add_argument("--run-dir", default=d.run_dir, help="where metrics.jsonl and loss.png go")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16"), help="compute dtype (master weights stay float32)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="gradient accumulation micro-steps per step")
    add_remat_options(p)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate on the validation split every N steps")
    p.add_argument("--log-every", type=int, default=d.log_every, help="print a step-log line every N steps (step, loss, grad norm, lr, step time, tokens/s, TFLOP/s, MFU, memory)")
    p.add_argument("--devices", type=int, default=8, help="CPU devices to simulate (ignored on accelerators and under `equishard launch`, which splits its own --devices)")
    p.add_argument("--sample-bytes", type=int, default=d.sample_bytes, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no loss-curve PNG")
    p.add_argument("--profile", default=None, metavar="START:STOP", help="write a jax.profiler trace of steps START to STOP - 1 into <run-dir>/profile (TensorBoard's profile plugin and Perfetto read it), e.g. 10:15")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="no TensorBoard events (<run-dir>/tensorboard, written with tensorboardX)")
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
