"""Knowledge distillation across two disjoint meshes.

A large *teacher* runs tensor parallel on one half of the devices while a small
*student* trains data parallel on the other half. Each step, the teacher's soft
targets (its temperature-`T` log-probabilities over the next byte) cross from the
teacher's devices to the student's with a single `jax.device_put`, and the student
learns from a mix of the teacher's targets and the data's own next bytes.

    python docs/examples/distill.py [--steps 40] [--teacher-steps 60]

On a machine without an accelerator the script simulates 8 CPU devices
(`jax_num_cpu_devices=8`, set before JAX starts); on a GPU host it uses the first 8
real devices. It needs at least 8.

## The two meshes

```
devices 0 1 2 3  ->  teacher mesh  tp=4   GPT "small" (1.9 M parameters), tensor parallel
devices 4 5 6 7  ->  student mesh  dp=4   GPT "tiny"  (0.1 M parameters), data parallel
```

Both are ordinary equishard meshes (`Layout("tp=4").mesh(devices[:4])`,
`Layout("dp=4").mesh(devices[4:8])`); each model is built directly sharded on its
own mesh, and every program (the teacher's forward, the student's train step) is
compiled for one mesh only. Nothing is ever replicated over all eight devices.

## The soft targets, without gathering the vocabulary

The teacher's output head is column parallel: inside its `shard_map` each device
holds the logits of a quarter of the vocabulary, `f32[B, S, V/tp]`. The
log-softmax at temperature `T` needs only two numbers per token from the other
devices -- the maximum (`pmax`) and the sum of exponentials (`psum`) -- so no
device ever forms the full-vocabulary logits of the whole batch. A last
`all_to_all` over `tp` trades the vocabulary split for a batch split: device `r`
gives each peer the rows that peer will own and keeps the vocabulary quarters of
its own rows, ending with `f32[B/tp, S, V]`. The teacher's output is a global
`f32[B, S, V]` laid out `P("tp")` (split over the batch) on devices 0-3.

## Moving between meshes

```python
targets = jax.device_put(teacher_logp, NamedSharding(student_mesh, P("dp")))
```

is the whole hand-over. The teacher's `P("tp")` on devices 0-3 and the student's
`P("dp")` on devices 4-7 split the batch the same way, so the move is four
point-to-point copies, device `r` to device `4 + r`, each `f32[B/4, S, V]`.
Such a `device_put` is asynchronous: it returns at once with an array on devices
4-7 whose buffers are filled when the teacher's forward has produced them.

That is why the teacher re-splits its output itself. A `device_put` that also
changes how the array is split -- straight from the vocabulary-split `P(None, None,
"tp")` to `P("dp")` -- is correct too, but it waits for its source before
returning (measured on the CPU with JAX 0.10 and 0.12), which would stall the loop
on every step; the `all_to_all` inside the teacher's program costs one collective
on the teacher's own interconnect instead.

## The loss

With student logits `s` and teacher logits `z` at temperature `T`,

```
loss = alpha * T^2 * KL(softmax(z/T) || softmax(s/T)) + (1 - alpha) * CE(s, next bytes)
```

(Hinton et al., 2015: the `T^2` keeps the distillation gradient's scale independent
of `T`). Both terms are local means over the student's batch shard, `pmean`-ed over
`dp`: the global loss of equishard's gradient convention, differentiated inside
`make_train_step`.

## Overlap by asynchronous dispatch

JAX returns from a jitted call as soon as the computation is enqueued. The loop
therefore dispatches, in order,

1. the student's step `i` on devices 4-7 (with the targets of step `i`),
2. the teacher's forward for step `i + 1` on devices 0-3 and its `device_put`,

and only then blocks on the student's metrics of step `i`. The teacher's forward
`i + 1` and the student's step `i` use disjoint devices, so the runtime is free to
run them at the same time; `main` counts how often the teacher's next forward was
dispatched while the student's step was still running (`jax.Array.is_ready()`).

One detail makes this work: `eqx.filter_jit` (Equinox 0.13) waits for each call's
result before returning, so that it can report runtime errors well, which would
serialise the loop. Its ahead-of-time form, `fn.lower(*args).compile()`, returns at
dispatch like `jax.jit`; the loop calls the compiled teacher forward and student
step (`compile_async`), which also keeps compilation out of the loop's timing.

What the overlap buys depends on the backend. On an accelerator host the two halves
are separate chips and the teacher's forward runs while the student trains. With
simulated CPU devices it does not: XLA:CPU launches one multi-device program at a
time, each after the previous one has finished (it gang-schedules them in a total
order so that their threads cannot deadlock on its fixed thread pool; see
`xla/pjrt/cpu/cpu_client.h`), even when their devices are disjoint, and all eight
"devices" share the machine's cores anyway. The dispatch order is the same and the
host still runs ahead -- it samples the next batch and enqueues the transfers while
the devices compute -- but the teacher's and the student's programs execute one
after the other. `--sequential` blocks after every call, for comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import warnings
from collections.abc import Callable
from typing import Any


def _accelerator_present() -> bool:
    """Whether JAX will start on a GPU/TPU (checked without starting JAX)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() not in ("cpu", "")
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    return any(importlib.util.find_spec(name) is not None for name in plugins)


import jax  # noqa: E402

if not _accelerator_present():
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # JAX already started (e.g. imported by a test): keep its devices
        pass

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, Int, PRNGKeyArray  # noqa: E402

import equishard as es  # noqa: E402
from equishard import Layout  # noqa: E402
from equishard._app import get_batch, load_stdlib_corpus  # noqa: E402  (the demo's corpus)
from equishard.models import GPT, PRESETS  # noqa: E402
from equishard.models._gpt import count_parameters  # noqa: E402
from equishard.train import TrainState, init_train_state, make_train_step  # noqa: E402

TEACHER_LAYOUT = Layout("tp=4")
STUDENT_LAYOUT = Layout("dp=4")


# --------------------------------------------------------------------------------------
# The teacher: soft targets on the tensor-parallel mesh
# --------------------------------------------------------------------------------------


def teacher_log_probs(
    teacher: GPT, ids: Int[Array, "batch seq"], *, temperature: float
) -> Float[Array, "batch_local seq vocab"]:
    """The teacher's log-probabilities at `temperature`, in the local view of `tp`.

    **Arguments:**

    - `teacher`: the tensor-parallel teacher (local blocks).
    - `ids`: `int32[B, S]` input bytes, replicated over `tp`.
    - `temperature`: the softmax temperature `T`.

    **Returns:**

    `log softmax(z / T)` over the whole vocabulary for this device's `B/tp` rows of
    the batch, `f32[B/tp, S, V]`. The normaliser is computed across `tp` with two
    scalar collectives per token, and one `all_to_all` trades the vocabulary split
    for the batch split.
    """
    h, _ = teacher.hidden(ids)  # f32[B, S, D] on each of devices 0-3
    z = teacher.logits(h).astype(jnp.float32) / temperature  # f32[B, S, V/tp]
    # f32[B, S, V/tp] -> f32[B, S]: the global maximum over the vocabulary (for exp's range)
    shift = jax.lax.pmax(jnp.max(z, axis=-1), "tp")
    # f32[B, S, V/tp] -> f32[B, S] (local sum) -> f32[B, S] (sum over the whole vocabulary)
    sum_exp = jax.lax.psum(jnp.sum(jnp.exp(z - shift[..., None]), axis=-1), "tp")
    log_normaliser = shift + jnp.log(sum_exp)  # f32[B, S], the same on every device
    log_probs = z - log_normaliser[..., None]  # f32[B, S, V/tp]
    # f32[B, S, V/tp] -> f32[B/tp, S, V]: send row block j to device j, gather the
    # vocabulary quarters of this device's rows (in vocabulary order).
    return jax.lax.all_to_all(log_probs, "tp", split_axis=0, concat_axis=2, tiled=True)


def make_teacher_forward(
    mesh: Mesh, *, temperature: float
) -> Callable[[GPT, Int[Array, "batch seq"]], Float[Array, "batch seq vocab"]]:
    """The jitted teacher forward on its own mesh (global view in and out).

    **Arguments:**

    - `mesh`: the teacher's `tp` mesh.
    - `temperature`: the softmax temperature `T`.

    **Returns:**

    `forward(teacher, ids) -> log_probs`: `ids` is `int32[B, S]` replicated on
    `mesh`; `log_probs` is `f32[B, S, V]` laid out `P("tp")` on `mesh` (device `r`
    holds rows `[r B/tp, (r + 1) B/tp)` over the whole vocabulary).
    """
    local = lambda model, ids: teacher_log_probs(model, ids, temperature=temperature)  # noqa: E731
    forward = es.filter_shard_map(local, mesh=mesh, in_specs=(None, P()), out_specs=P("tp"))
    return eqx.filter_jit(forward)


# --------------------------------------------------------------------------------------
# The student: a data-parallel train step on the mixed loss
# --------------------------------------------------------------------------------------


def distillation_loss(
    student: GPT,
    batch: dict[str, Array],
    key: PRNGKeyArray | None,
    *,
    temperature: float,
    alpha: float,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The student's global loss on its batch shard (local view of `dp`).

    **Arguments:**

    - `student`: the data-parallel student (replicated parameters).
    - `batch`: this device's shard of the batch:
        - `"tokens"`: `int32[B/dp, S + 1]` windows (inputs `[:, :-1]`, next bytes `[:, 1:]`);
        - `"teacher_logp"`: `f32[B/dp, S, V]`, the teacher's log-probabilities at `T`.
    - `key`: unused (no dropout); `make_train_step` passes one.
    - `temperature`: `T`.
    - `alpha`: the weight of the distillation term (`1 - alpha` for the hard loss).

    **Returns:**

    `(loss, metrics)`: `alpha T^2 KL + (1 - alpha) CE`, with `kl` (nats per token, at
    `T`) and `cross_entropy` (nats per byte) as metrics; all `pmean`-ed over `dp`.
    """
    del key
    tokens = batch["tokens"]  # int32[B/dp, S + 1] on one of devices 4-7
    ids, labels = tokens[:, :-1], tokens[:, 1:]  # int32[B/dp, S] each
    h, _ = student.hidden(ids)  # f32[B/dp, S, D]
    logits = student.logits(h).astype(jnp.float32)  # f32[B/dp, S, V] (no tp: whole vocab)
    # The hard loss: next-byte cross-entropy.
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    # The soft loss: KL(teacher_T || student_T), per token summed over the vocabulary.
    teacher_logp = batch["teacher_logp"]  # f32[B/dp, S, V]
    student_logp = jax.nn.log_softmax(logits / temperature, axis=-1)  # f32[B/dp, S, V]
    kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1).mean()
    loss = alpha * temperature**2 * kl + (1.0 - alpha) * cross_entropy
    # The global loss (DESIGN's gradient convention): the mean over the whole batch.
    loss, kl, cross_entropy = jax.lax.pmean((loss, kl, cross_entropy), "dp")
    return loss, {"kl": kl, "cross_entropy": cross_entropy}


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def compile_async(fn: Callable, *args: Any) -> Callable:
    """Compile an `eqx.filter_jit` function ahead of time for `args`.

    The compiled call returns as soon as its computation is enqueued, whereas calling
    `eqx.filter_jit` directly waits for the result (Equinox 0.13 does, to report
    runtime errors well); asynchronous dispatch is what lets the loop below run ahead.

    **Arguments:**

    - `fn`: an `eqx.filter_jit`-wrapped function (or a `make_train_step` step).
    - `args`: example arguments with the shapes, dtypes and shardings of the real ones.

    **Returns:**

    The compiled function, called like `fn`.
    """
    with warnings.catch_warnings():
        # XLA:CPU cannot reuse every donated buffer and says so when compiling.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return fn.lower(*args).compile()


def _device_ids(tree: Any) -> list[int]:
    """The ids of the devices the arrays of `tree` live on."""
    arrays = jax.tree.leaves(eqx.filter(es.unbox(tree), eqx.is_array))
    return sorted({d.id for x in arrays for d in x.sharding.device_set})


def _mean(values: list[float]) -> float:
    return float(np.mean(values))


def main(
    steps: int = 40,
    *,
    teacher_steps: int = 60,
    batch_size: int = 16,
    seq_len: int = 64,
    teacher_model: str = "small",
    student_model: str = "tiny",
    temperature: float = 2.0,
    alpha: float = 0.5,
    lr: float = 3e-3,
    seed: int = 0,
    sequential: bool = False,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train a teacher briefly, then distil it into a student on the other four devices.

    **Arguments:**

    - `steps`: distillation steps.
    - `teacher_steps`: steps of ordinary training the teacher gets first, on its own
      mesh (0: a randomly initialised teacher).
    - `batch_size`, `seq_len`: the global batch, `B` windows of `S` bytes (+1 target).
    - `teacher_model`, `student_model`: `GPT` presets (`equishard.models.PRESETS`).
    - `temperature`: `T` of the soft targets.
    - `alpha`: the weight of the distillation term in the student's loss.
    - `lr`: Adam's learning rate (teacher and student).
    - `seed`: the seed of the keys and the data.
    - `sequential`: block after every call (no overlap), for comparison.
    - `verbose`: print the per-step losses and the summary line.

    **Returns:**

    A dict: `loss`, `kl`, `cross_entropy` (per distillation step), `teacher_loss`
    (per teacher training step), `teacher_devices` / `student_devices` (the ids of the
    devices every parameter lives on), `teacher` / `student` (the models),
    `probe_ids` (`int32[B, S]`), `teacher_logp` (the teacher's output for them,
    `f32[B, S, V]` laid out `P("tp")` on the teacher mesh) and `student_targets` (the
    same after the `device_put`, `P("dp")` on the student mesh), `overlapped` (steps
    whose teacher forward `i + 1` was dispatched before the student's step `i` had
    finished), `seconds` (the distillation loop) and `temperature`.
    """
    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(
            f"this example needs 8 devices (4 for the teacher, 4 for the student); JAX has "
            f"{len(devices)}. On the CPU, run it as a script (it sets jax_num_cpu_devices=8) "
            f"or set jax.config.update('jax_num_cpu_devices', 8) before JAX starts."
        )
    if batch_size % 4:
        raise ValueError(
            f"batch_size={batch_size}: the batch is split four ways (over the teacher's "
            f"tp=4 and the student's dp=4), so it must be a multiple of 4."
        )
    teacher_mesh = TEACHER_LAYOUT.mesh(devices[0:4])  # devices 0-3, axis tp=4
    student_mesh = STUDENT_LAYOUT.mesh(devices[4:8])  # devices 4-7, axis dp=4
    say = print if verbose else (lambda *a, **k: None)
    train_bytes = load_stdlib_corpus().train
    key_teacher, key_student = jax.random.split(jax.random.key(seed))

    # ---- The teacher: built tensor parallel on devices 0-3, briefly trained there.
    teacher_par = TEACHER_LAYOUT.resolve(4)
    teacher_opt = optax.adam(lr)
    teacher_state: TrainState = init_train_state(
        lambda k: GPT(PRESETS[teacher_model], teacher_par, key=k),
        teacher_opt, key_teacher, mesh=teacher_mesh,
    )  # fmt: skip
    teacher_step = make_train_step(
        lambda m, b, k: m.loss(b, k), teacher_opt,
        mesh=teacher_mesh, batch_spec=TEACHER_LAYOUT.resolve(4).batch_spec,  # P(): tp only
    )  # fmt: skip
    teacher_losses = []
    teacher_start = time.perf_counter()
    for i in range(teacher_steps):
        batch = get_batch(train_bytes, i * batch_size, batch_size, seq_len, seed=seed + 1)
        teacher_state, metrics = teacher_step(teacher_state, batch)
        teacher_losses.append(float(metrics["loss"]))
    teacher: GPT = teacher_state.model
    if teacher_steps:
        say(
            f"teacher {teacher_model} ({count_parameters(teacher) / 1e6:.2f} M parameters, "
            f"tp=4 on devices {_device_ids(teacher)}): {teacher_steps} steps, loss "
            f"{teacher_losses[0]:.3f} -> {teacher_losses[-1]:.3f} in "
            f"{time.perf_counter() - teacher_start:.1f} s (compilation included)"
        )

    # ---- The student: built data parallel on devices 4-7.
    student_par = STUDENT_LAYOUT.resolve(4)
    student_opt = optax.adam(lr)
    state: TrainState = init_train_state(
        lambda k: GPT(PRESETS[student_model], student_par, key=k),
        student_opt, key_student, mesh=student_mesh,
    )  # fmt: skip

    def loss_fn(model: GPT, batch: dict[str, Array], key: PRNGKeyArray) -> Any:
        return distillation_loss(model, batch, key, temperature=temperature, alpha=alpha)

    student_step = make_train_step(
        loss_fn, student_opt, mesh=student_mesh,
        batch_spec={"tokens": P("dp"), "teacher_logp": P("dp")},
    )  # fmt: skip
    say(
        f"student {student_model} ({count_parameters(state.model) / 1e6:.2f} M parameters, "
        f"dp=4 on devices {_device_ids(state.model)}), T={temperature}, alpha={alpha}"
    )

    on_teacher = NamedSharding(teacher_mesh, P())  # replicated over tp, devices 0-3
    on_student = NamedSharding(student_mesh, P("dp"))  # split over the batch, devices 4-7

    def tokens_at(step: int) -> np.ndarray:
        # int32[B, S + 1] on the host; the distillation stream differs from the teacher's.
        return get_batch(train_bytes, step * batch_size, batch_size, seq_len, seed=seed)

    # ---- The hand-over, once, as a probe: it also gives the example arguments with
    # which both programs are compiled ahead of time (see `compile_async`).
    probe_ids = tokens_at(0)[:, :-1]  # int32[B, S] on the host
    probe_ids_teacher = jax.device_put(probe_ids, on_teacher)  # int32[B, S] on devices 0-3
    teacher_forward = compile_async(
        make_teacher_forward(teacher_mesh, temperature=temperature), teacher, probe_ids_teacher
    )
    teacher_logp = teacher_forward(teacher, probe_ids_teacher)  # f32[B, S, V] on devices 0-3
    student_targets = jax.device_put(teacher_logp, on_student)  # f32[B, S, V] on devices 4-7
    example = {"tokens": jax.device_put(tokens_at(0), on_student), "teacher_logp": student_targets}
    student_step = compile_async(student_step, state, example)

    sync: Callable[[Any], Any] = jax.block_until_ready if sequential else (lambda x: x)

    def soft_targets(tokens: np.ndarray) -> jax.Array:
        """Dispatch the teacher's forward and the move to the student; returns at once."""
        ids = jax.device_put(tokens[:, :-1], on_teacher)  # int32[B, S] on devices 0-3
        logp = sync(teacher_forward(teacher, ids))  # f32[B, S, V], P("tp") on devices 0-3
        # Point-to-point, device r -> device 4 + r: f32[B/4, S, V] each.
        return sync(jax.device_put(logp, on_student))  # f32[B, S, V], P("dp") on devices 4-7

    losses: list[float] = []
    kls: list[float] = []
    ces: list[float] = []
    overlapped = 0
    start = time.perf_counter()
    tokens = tokens_at(0)
    targets = soft_targets(tokens)
    for i in range(steps):
        batch = {
            "tokens": jax.device_put(tokens, on_student),  # int32[B, S + 1] on devices 4-7
            "teacher_logp": targets,  # f32[B, S, V] on devices 4-7 (donated to the step)
        }
        # 1. Dispatch the student's step i on devices 4-7 (returns before it runs).
        state, metrics = sync(student_step(state, batch))
        # 2. Dispatch the teacher's forward for step i + 1 on devices 0-3 while it runs.
        if i + 1 < steps:
            tokens = tokens_at(i + 1)
            targets = soft_targets(tokens)
            overlapped += not metrics["loss"].is_ready()
        # 3. Only now wait for the student's step i.
        losses.append(float(metrics["loss"]))
        kls.append(float(metrics["kl"]))
        ces.append(float(metrics["cross_entropy"]))
        say(
            f"step {i:3d}  loss {losses[-1]:.4f}  kl {kls[-1]:.4f}  "
            f"cross-entropy {ces[-1]:.4f}"
        )
    seconds = time.perf_counter() - start

    k = max(1, min(5, steps // 4))
    teacher_devices, student_devices = _device_ids(teacher), _device_ids(state.model)
    say(
        f"distilled: kl {_mean(kls[:k]):.3f} -> {_mean(kls[-k:]):.3f}, cross-entropy "
        f"{_mean(ces[:k]):.3f} -> {_mean(ces[-k:]):.3f} (mean of the first/last {k} steps); "
        f"teacher on devices {teacher_devices}, student on devices {student_devices}; "
        f"teacher forward dispatched before the student's step finished in "
        f"{overlapped}/{max(steps - 1, 0)} steps; {steps} steps in {seconds:.1f} s"
    )
    return {
        "loss": losses,
        "kl": kls,
        "cross_entropy": ces,
        "teacher_loss": teacher_losses,
        "teacher_devices": teacher_devices,
        "student_devices": student_devices,
        "teacher": teacher,
        "student": state.model,
        "probe_ids": probe_ids,
        "teacher_logp": teacher_logp,
        "student_targets": student_targets,
        "overlapped": overlapped,
        "seconds": seconds,
        "temperature": temperature,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Knowledge distillation across two disjoint meshes.")
    parser.add_argument("--steps", type=int, default=40, help="distillation steps (default 40)")
    parser.add_argument(
        "--teacher-steps", type=int, default=60,
        help="training steps the teacher gets first (default 60; 0: random teacher)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--seq-len", type=int, default=64, help="bytes per window (default 64)")
    parser.add_argument("--temperature", type=float, default=2.0, help="T (default 2.0)")
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="weight of the distillation term (default 0.5)"
    )
    parser.add_argument(
        "--sequential", action="store_true",
        help="block after every call instead of overlapping by asynchronous dispatch",
    )  # fmt: skip
    args = parser.parse_args()
    main(
        args.steps, teacher_steps=args.teacher_steps, batch_size=args.batch_size,
        seq_len=args.seq_len, temperature=args.temperature, alpha=args.alpha,
        sequential=args.sequential,
    )  # fmt: skip
