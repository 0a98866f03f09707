"""An explicit pipeline schedule executor: the forward and backward of every micro-batch,
step by step as a schedule table says, inside `shard_map`.

GPipe and circular pipelines are one differentiated `jax.lax.scan`, so autodiff keeps the
residuals of every step until the backward pass: memory grows with the number of
micro-batches. `execute_schedule` runs the backward itself. At every step each stage
device runs the forward (`F`), backward (`B`) or weight-gradient (`W`) work of one
micro-batch, or nothing, following a `PipelineSchedule`; activations move to the next
stage and cotangents to the previous one by collective-permutes. A micro-batch's loss
is computed on the last stage as soon as its forward ends, and its backward starts
from there, so a stage holds only the micro-batches its schedule has in flight.

**What a stage keeps for its backward.** The forward of a micro-batch runs under
`jax.vjp` and its residuals (the intermediate activations the backward reads) are
written to a stash of as many slots as the schedule has micro-batches in flight; the
backward reads them back. Residuals that are the stage's parameters themselves are
recognised and not stashed. Keeping residuals rather than only the stage input (and
recomputing the forward in the backward) costs activation memory per micro-batch in
flight but no second forward, and so none of the forward's collectives a second time
(a tensor-parallel stage's all-reduces): the collective bytes stay those of one
forward and one backward.

The whole schedule (forwards and backwards) runs in the forward rule of a
`jax.custom_vjp`; its backward rule scales the gradients by the loss's cotangent. So
the result is an ordinary differentiable loss inside a train step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._axes import bound_axis_size, cast_varying, varying_axes
from .._errors import LayerConfigError
from ._microbatch import split_microbatches
from ._pipeline import check_stage_output
from ._schedule import BACKWARD, FORWARD, IDLE, WEIGHT, PipelineSchedule

# ----------------------------------------------------------------------------------------
# The plan: stash slots and transfers, read off the table once, on the host.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per step and stage device (`int32[K, S]` each, `-1`: none) what the executor does.

    - `inbox_read`: the inbox slot holding the activation a forward reads.
    - `inbox_write`: the inbox slot the activation received at the end of the step goes to.
    - `stash_write`/`stash_read`: the residual slot a forward writes / a backward reads.
    - `grad_read`: the cotangent slot a backward reads.
    - `grad_local`: the cotangent slot the last stage's loss writes (forward of the last
      global stage).
    - `grad_write`: the cotangent slot the cotangent received at the end of the step goes to.
    - `send_forward`, `send_backward`: `bool[K]`, whether any device sends this step.
    """

    inbox_read: np.ndarray
    inbox_write: np.ndarray
    stash_write: np.ndarray
    stash_read: np.ndarray
    grad_read: np.ndarray
    grad_local: np.ndarray
    grad_write: np.ndarray
    send_forward: np.ndarray
    send_backward: np.ndarray
    inbox_slots: int
    stash_slots: int
    grad_slots: int


class _Slots:
    """A free list of stash slots; remembers how many were ever needed at once."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.used: dict[Any, int] = {}
        self.size = 0

    def take(self, key: Any) -> int:
        slot = self.free.pop(0) if self.free else self.size
        self.size = max(self.size, slot + 1)
        self.used[key] = slot
        return slot

    def peek(self, key: Any) -> int:
        return self.used[key]

    def give(self, key: Any) -> int:
        slot = self.used.pop(key)
        self.free.append(slot)
        self.free.sort()
        return slot


def _plan(schedule: PipelineSchedule) -> _Plan:
    s, r = schedule.num_stages, schedule.repeats
    last = s * r - 1
    k = schedule.num_steps
    split = schedule.split_backward
    arrays = {
        name: np.full((k, s), -1, np.int32)
        for name in (
            "inbox_read", "inbox_write", "stash_write", "stash_read",
            "grad_read", "grad_local", "grad_write",
        )
    }  # fmt: skip
    send_forward = np.zeros(k, bool)
    send_backward = np.zeros(k, bool)
    inbox = [_Slots() for _ in range(s)]
    stash = [_Slots() for _ in range(s)]
    grad = [_Slots() for _ in range(s)]
    for t in range(k):
        # Reads first (the step's compute), then writes (its results and what arrives).
        for d in range(s):
            op, mb, v = (int(a[t, d]) for a in (schedule.op, schedule.microbatch, schedule.virtual))
            key = (mb, v)
            if op == FORWARD and v * s + d > 0:
                arrays["inbox_read"][t, d] = inbox[d].give(key)
            elif op == BACKWARD or op == WEIGHT:
                release = op == WEIGHT or not split
                pick = (lambda slots: slots.give(key)) if release else (lambda slots: slots.peek(key))
                arrays["stash_read"][t, d] = pick(stash[d])
                arrays["grad_read"][t, d] = pick(grad[d])
        for d in range(s):
            op, mb, v = (int(a[t, d]) for a in (schedule.op, schedule.microbatch, schedule.virtual))
            g = v * s + d
            if op == FORWARD:
                arrays["stash_write"][t, d] = stash[d].take((mb, v))
                if g == last:
                    arrays["grad_local"][t, d] = grad[d].take((mb, v))
                else:  # to global stage g + 1, on the next device
                    nxt = (d + 1) % s
                    arrays["inbox_write"][t, nxt] = inbox[nxt].take((mb, (g + 1) // s))
                    send_forward[t] = True
            elif op == BACKWARD and g > 0:  # to global stage g - 1, on the previous device
                prev = (d - 1) % s
                arrays["grad_write"][t, prev] = grad[prev].take((mb, (g - 1) // s))
                send_backward[t] = True
    return _Plan(
        **arrays,
        send_forward=send_forward,
        send_backward=send_backward,
        inbox_slots=max(1, max(x.size for x in inbox)),
        stash_slots=max(1, max(x.size for x in stash)),
        grad_slots=max(1, max(x.size for x in grad)),
    )


# ----------------------------------------------------------------------------------------
# Execution.
# ----------------------------------------------------------------------------------------


def _index(tree: PyTree, i: Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(tree: PyTree, i: Array, value: PyTree, write: Array) -> PyTree:
    """`tree[i] = value` where `write`, else unchanged (slot `i` clipped to be valid)."""

    def put(a: Array, x: Array) -> Array:
        j = jnp.maximum(i, 0)
        old = jax.lax.dynamic_index_in_dim(a, j, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(a, jnp.where(write, x, old), j, 0)

    return jax.tree.map(put, tree, value)


def _typed(x: Any, like: Any, axes: frozenset[str]) -> Any:
    """`x` varying over what `like` varies over and over `axes`."""
    return cast_varying(x, varying_axes(like) | axes)


def _zeros(tree: PyTree, axes: frozenset[str]) -> PyTree:
    """Zeros like `tree`, each varying over what its leaf varies over and over `axes`."""
    return jax.tree.map(lambda a: _typed(jnp.zeros(a.shape, a.dtype), a, axes), tree)


def _residuals(fn: Callable, diff: tuple, rest: tuple) -> tuple[Any, Any, list[int | None]]:
    """`jax.vjp` of `fn(*diff, *rest)` in `diff`, and which residuals are parameters.

    **Returns:**

    `(out, vjp_fn, where)`: `where[i]` is the index of the leaf of `diff[0]` (the
    parameters) that residual `i` *is* (not to stash), or `None` (to stash).
    """
    out, vjp_fn = jax.vjp(lambda *d: fn(*d, *rest), *diff)
    param_leaves = jax.tree.leaves(diff[0])
    where = []
    for res in jax.tree.leaves(vjp_fn):
        where.append(next((i for i, a in enumerate(param_leaves) if res is a), None))
    return out, vjp_fn, where


class _Stage:
    """A function's vjp, split into residuals to stash and how to rebuild it.

    `fn(*diff, *rest)` is differentiated in `diff`, whose first entry holds the
    parameters: residuals that are parameter arrays are taken from the parameters at
    the backward, not stashed.
    """

    def __init__(self, fn: Callable, diff: tuple, rest: tuple, axes: frozenset[str]):
        self.fn = fn
        self.axes = axes
        captured: dict[str, Any] = {}

        def probe(diff: tuple, rest: tuple) -> Any:
            out, vjp_fn, where = _residuals(fn, diff, rest)
            captured["treedef"] = jax.tree.structure(vjp_fn)
            captured["where"] = where
            return [r for r, w in zip(jax.tree.leaves(vjp_fn), where) if w is None]

        self.kept = jax.eval_shape(probe, diff, rest)
        self.treedef = captured["treedef"]
        self.where: list[int | None] = captured["where"]

    def forward(self, diff: tuple, rest: tuple) -> tuple[Any, list[Array]]:
        out, vjp_fn, where = _residuals(self.fn, diff, rest)
        if where != self.where:  # pragma: no cover - tracing is deterministic
            raise AssertionError("pipeline: the stage traced differently twice")
        kept = [r for r, w in zip(jax.tree.leaves(vjp_fn), where) if w is None]
        return out, [_typed(r, a, self.axes) for r, a in zip(kept, self.kept)]

    def backward(self, params: PyTree, kept: list[Array], cotangent: Array) -> tuple:
        param_leaves = jax.tree.leaves(params)
        it = iter(kept)
        leaves = [next(it) if w is None else param_leaves[w] for w in self.where]
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)


@dataclasses.dataclass(frozen=True, eq=False)
class _Run:
    """What every step of `_run`'s loop reads: the stage functions and their parameters,
    the micro-batches, this device's index, and the varying-axes types of the
    activations (`h_axes`) and the loss (`loss_axes`)."""

    params: PyTree  # [V, ...]: this device's local stages
    first_params: PyTree
    last_params: PyTree
    inputs_mb: PyTree  # [M, b, ...]
    targets_mb: PyTree  # [M, b, ...]
    last: Callable
    enter: Callable
    run_stage: Callable
    enter_parts: Callable
    stage_vjp: _Stage
    enter_vjp: _Stage
    kept_avals: Any
    enter_kept_avals: Any
    h_aval: Any
    h_axes: frozenset[str]
    loss_axes: frozenset[str]
    axes: frozenset[str]
    axis: str
    me: Array
    schedule: PipelineSchedule
    grad_inputs: bool
    with_grad: bool
    zero_h: Callable[[], Array]  # one function each, so that `cond` traces its branch once
    zero_loss: Callable[[], Array]


@dataclasses.dataclass(frozen=True, eq=False)
class _At:
    """One step of the loop on this device: its row of the schedule (`mine`), the work
    (`op`), the micro-batch and local stage it works on, and where that stage is."""

    mine: dict
    op: Array
    mb: Array
    v: Array
    is_first: Array
    is_last: Array
    p: PyTree  # this local stage's parameters
    x_mb: PyTree
    t_mb: PyTree


def _activation_axes(stage: Callable, first: Callable | None, chunk0: PyTree, first_params: PyTree, x0: PyTree, axes: frozenset[str]) -> tuple[frozenset[str], Any]:
    """The axes the activations vary over, and the first stage's output's shape.

    Activations and their cotangents vary over the stage and data axes and over what the
    stages make them vary over (not over what they are replicated on, e.g. a
    tensor-parallel axis: their cotangents are then the full ones, not partial sums).
    """
    raw = jax.eval_shape(lambda fp, x: x if first is None else first(fp, x), first_params, x0)
    if not hasattr(raw, "shape"):
        raise LayerConfigError("execute_schedule: the first stage must produce one array.")
    h_axes = axes | varying_axes(raw)
    while True:
        h0 = cast_varying(jnp.zeros(raw.shape, raw.dtype), h_axes)
        out = jax.eval_shape(stage, chunk0, h0)
        check_stage_output(out, h0, "execute_schedule: the stage")
        if varying_axes(out) <= h_axes:
            return h_axes, h0
        h_axes = h_axes | varying_axes(out)


def _rows(schedule: PipelineSchedule, plan: _Plan, with_grad: bool) -> dict[str, Array]:
    """The schedule table and its slot plan as the loop's rows, `[steps, stages]` each
    (without gradients: the forwards alone, backward steps idle, nothing stashed)."""
    rows = {
        "op": schedule.op.astype(np.int32), "mb": schedule.microbatch, "v": schedule.virtual,
        **{f: getattr(plan, f) for f in (
            "inbox_read", "inbox_write", "stash_write", "stash_read",
            "grad_read", "grad_local", "grad_write",
        )},
        "send_forward": plan.send_forward, "send_backward": plan.send_backward,
    }  # fmt: skip
    if not with_grad:
        rows["op"] = np.where(rows["op"] == FORWARD, FORWARD, IDLE).astype(np.int32)
        rows["send_backward"] = np.zeros_like(plan.send_backward)
    return jax.tree.map(jnp.asarray, rows)


def _run(
    stage: Callable,
    first: Callable | None,
    last: Callable,
    params: PyTree,
    first_params: PyTree,
    last_params: PyTree,
    inputs: PyTree,
    targets: PyTree,
    schedule: PipelineSchedule,
    axis: str,
    axes: frozenset[str],
    grad_inputs: bool,
    with_grad: bool,
) -> tuple[Array, tuple]:
    """Run the schedule; `(loss, (d params, d first_params, d last_params, d inputs))`."""
    s, m, r = schedule.num_stages, schedule.num_microbatches, schedule.repeats
    last_stage = s * r - 1
    me = jax.lax.axis_index(axis)
    inputs_mb = split_microbatches(inputs, m, what="execute_schedule")  # [M, b, ...]
    targets_mb = split_microbatches(targets, m, what="execute_schedule")

    chunk0 = _index(params, jnp.int32(0))
    x0 = _index(inputs_mb, jnp.int32(0))
    t0 = _index(targets_mb, jnp.int32(0))
    h_axes, h0 = _activation_axes(stage, first, chunk0, first_params, x0, axes)

    def enter(fp: PyTree, x: PyTree) -> Array:
        h = x if first is None else first(fp, x)
        return cast_varying(h, h_axes)

    def run_stage(p: PyTree, h: Array) -> Array:
        return cast_varying(stage(p, h), h_axes)

    h_aval = jax.eval_shape(enter, first_params, x0)
    loss_axes = axes | varying_axes(jax.eval_shape(last, last_params, h0, t0))
    stage_vjp = _Stage(run_stage, (chunk0, h0), (), axes)

    def enter_parts(x: PyTree) -> tuple[tuple, tuple]:
        """(differentiated, not differentiated) arguments of `enter` for micro-batch `x`."""
        return ((first_params, x), ()) if grad_inputs else ((first_params,), (x,))

    enter_vjp = _Stage(enter, *enter_parts(x0), axes)
    plan = _plan(schedule)
    xs = _rows(schedule, plan, with_grad)

    def stack(avals: Any, n: int) -> Any:
        return jax.tree.map(lambda a: _typed(jnp.zeros((n, *a.shape), a.dtype), a, axes), avals)

    kept_avals = stage_vjp.kept if with_grad else []
    enter_kept_avals = enter_vjp.kept if with_grad else []
    zero_h = lambda: cast_varying(jnp.zeros(h_aval.shape, h_aval.dtype), h_axes)  # noqa: E731
    zero_loss = lambda: cast_varying(jnp.zeros((), jnp.float32), loss_axes)  # noqa: E731
    c = _Run(
        params, first_params, last_params, inputs_mb, targets_mb, last, enter, run_stage,
        enter_parts, stage_vjp, enter_vjp, kept_avals, enter_kept_avals, h_aval, h_axes,
        loss_axes, axes, axis, me, schedule, grad_inputs, with_grad, zero_h, zero_loss,
    )  # fmt: skip
    carry0 = {
        "inbox": stack(h_aval, plan.inbox_slots),
        "stash": stack(kept_avals, plan.stash_slots),
        "enter_stash": stack(enter_kept_avals, plan.stash_slots),
        "grad": stack(h_aval, plan.grad_slots) if with_grad else None,
        "d_params": _zeros(params, axes) if with_grad else None,
        "d_first": _zeros(first_params, axes) if with_grad else None,
        "d_last": _zeros(last_params, axes) if with_grad else None,
        "d_inputs": _zeros(inputs_mb, axes) if (with_grad and grad_inputs) else None,
        "loss": c.zero_loss(),
    }
    carry, _ = jax.lax.scan(functools.partial(_step, c), carry0, xs)
    # The loss lives on the last stage: every stage gets it (one scalar all-reduce).
    loss = jax.lax.psum(jnp.where(me == (last_stage % s), carry["loss"], 0.0), axis) / m
    if not with_grad:
        return loss, ()
    scale = 1.0 / m
    d_inputs = None
    if grad_inputs:
        d_inputs = jax.tree.map(lambda a, x: (a * scale).reshape(x.shape), carry["d_inputs"], inputs)
    grads = jax.tree.map(lambda a: a * scale, (carry["d_params"], carry["d_first"], carry["d_last"]))
    return loss, (*grads, d_inputs)


def _step(c: _Run, carry: dict, row: dict) -> tuple[dict, None]:
    """One trip of the loop: this device's work of the step, the carry updated with it,
    and the step's transfers."""
    s = c.schedule.num_stages
    last_stage = s * c.schedule.repeats - 1
    mine = {k: (v[c.me] if v.ndim else v) for k, v in row.items()}
    mb = jnp.maximum(mine["mb"], 0)
    v = jnp.maximum(mine["v"], 0)
    g = v * s + c.me
    is_first = g == 0
    is_last = g == last_stage
    p = _index(c.params, v)
    at = _At(mine, mine["op"], mb, v, is_first, is_last, p, _index(c.inputs_mb, mb), _index(c.targets_mb, mb))
    out = _work(c, carry, at)
    new = _accumulated(c, carry, at, out)
    return _transfers(c, new, at, out), None


def _work(c: _Run, carry: dict, at: _At) -> dict:
    """This device's work of the step (`op`): nothing, a forward, a backward (`B`: the
    input gradient and, unless split off, the weight gradient) or a weight gradient
    (`W`). The first stage's `first` gradient goes with `B`."""
    with_grad, axes = c.with_grad, c.axes
    zero_out = {
        "send": c.zero_h(),
        "stash": _zeros(c.kept_avals, axes),
        "enter_stash": _zeros(c.enter_kept_avals, axes),
        "dy": c.zero_h(),
        "loss": c.zero_loss(),
        "d_params": _zeros(jax.tree.map(lambda a: a[0], c.params), axes) if with_grad else None,
        "d_first": _zeros(c.first_params, axes) if with_grad else None,
        "d_last": _zeros(c.last_params, axes) if with_grad else None,
        "d_x": _zeros(at.x_mb, axes) if (with_grad and c.grad_inputs) else None,
    }

    def idle() -> dict:
        return zero_out

    @jax.named_scope("pipeline_forward")
    def forward() -> dict:
        return _forward(c, carry, at, zero_out)

    if not with_grad:
        return jax.lax.cond(at.op == FORWARD, forward, idle)
    split = c.schedule.split_backward
    branches = [
        idle,
        forward,
        jax.named_scope("pipeline_backward")(functools.partial(_backward, c, carry, at, zero_out, not split, True)),
        jax.named_scope("pipeline_weight")(functools.partial(_backward, c, carry, at, zero_out, True, False)),
    ]
    return jax.lax.switch(at.op, branches)


def _forward(c: _Run, carry: dict, at: _At, zero_out: dict) -> dict:
    """A forward: the stage's input (`first` of the micro-batch on the first stage, else
    the inbox), the stage (under `vjp`, residuals to the stash, when gradients follow),
    and on the last stage the loss and its cotangent."""
    out = dict(zero_out)
    enter_diff, enter_rest = c.enter_parts(at.x_mb)
    f32 = jnp.float32

    @jax.named_scope("pipeline_first")
    def from_inputs() -> tuple[Array, list]:
        if c.with_grad:
            h, kept = c.enter_vjp.forward(enter_diff, enter_rest)
            return h, kept
        return c.enter(c.first_params, at.x_mb), []

    def from_inbox() -> tuple[Array, list]:
        return _index(carry["inbox"], at.mine["inbox_read"]), _zeros(c.enter_kept_avals, c.axes)

    h, out["enter_stash"] = jax.lax.cond(at.is_first, from_inputs, from_inbox)
    if c.with_grad:
        y, out["stash"] = c.stage_vjp.forward((at.p, h), ())
    else:
        y = c.run_stage(at.p, h)

    @jax.named_scope("pipeline_last")
    def finish() -> tuple:
        if c.with_grad:
            loss, grads = jax.value_and_grad(c.last, argnums=(0, 1))(c.last_params, y, at.t_mb)
            return (cast_varying(loss.astype(f32), c.loss_axes), grads[1], grads[0])
        loss = c.last(c.last_params, y, at.t_mb)
        return cast_varying(loss.astype(f32), c.loss_axes), c.zero_h(), None

    def pass_on() -> tuple:
        return c.zero_loss(), c.zero_h(), _zeros(c.last_params, c.axes) if c.with_grad else None

    out["loss"], out["dy"], out["d_last"] = jax.lax.cond(at.is_last, finish, pass_on)
    out["send"] = y
    return out


def _backward(c: _Run, carry: dict, at: _At, zero_out: dict, weights: bool, inputs_too: bool) -> dict:
    """A backward from the stashed residuals and the received cotangent: the weight
    gradient if `weights`, the input cotangent (sent on; on the first stage, through
    `first`) if `inputs_too`."""
    axes = c.axes
    out = dict(zero_out)
    kept = _index(carry["stash"], at.mine["stash_read"])
    dy = _index(carry["grad"], at.mine["grad_read"])
    d_p, d_h = c.stage_vjp.backward(at.p, kept, dy)
    if weights:
        out["d_params"] = cast_varying(d_p, axes)
    if inputs_too:
        d_h = cast_varying(d_h, axes)

        @jax.named_scope("pipeline_first")
        def leave() -> tuple:
            enter_kept = _index(carry["enter_stash"], at.mine["stash_read"])
            grads = c.enter_vjp.backward(c.first_params, enter_kept, d_h)
            d_x = cast_varying(grads[1], axes) if c.grad_inputs else None
            return cast_varying(grads[0], axes), d_x

        def stay() -> tuple:
            return zero_out["d_first"], zero_out["d_x"]

        out["d_first"], out["d_x"] = jax.lax.cond(at.is_first, leave, stay)
        out["send"] = d_h
    return out


def _accumulated(c: _Run, carry: dict, at: _At, out: dict) -> dict:
    """The carry with the step's loss, residuals, cotangent and gradients added in."""
    op, mine = at.op, at.mine
    new = dict(carry)
    new["loss"] = carry["loss"] + out["loss"]
    if not c.with_grad:
        return new
    # Written only by a forward; a conditional update (not a select) keeps the
    # write in place: no second copy of a slot's residuals.
    new["stash"] = jax.lax.cond(
        op == FORWARD,
        lambda: jax.tree.map(
            lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, mine["stash_write"], 0),
            carry["stash"], out["stash"],
        ),
        lambda: carry["stash"],
    )  # fmt: skip
    new["enter_stash"] = _put(
        carry["enter_stash"], mine["stash_write"], out["enter_stash"], (op == FORWARD) & at.is_first
    )
    new["grad"] = _put(carry["grad"], mine["grad_local"], out["dy"], (op == FORWARD) & at.is_last)
    new["d_params"] = jax.tree.map(
        lambda acc, d: jax.lax.dynamic_update_index_in_dim(
            acc, jax.lax.dynamic_index_in_dim(acc, at.v, keepdims=False) + d, at.v, 0
        ),
        carry["d_params"], out["d_params"],
    )  # fmt: skip
    new["d_first"] = jax.tree.map(jnp.add, carry["d_first"], out["d_first"])
    new["d_last"] = jax.tree.map(jnp.add, carry["d_last"], out["d_last"])
    if c.grad_inputs:
        new["d_inputs"] = _put(carry["d_inputs"], at.mb, out["d_x"], (op == BACKWARD) & at.is_first)
    return new


def _transfers(c: _Run, new: dict, at: _At, out: dict) -> dict:
    """The step's transfers: activations forward, cotangents backward, only on steps
    that send; what arrives goes to the inbox and the gradient slots."""
    s, wrap, mine, op = c.schedule.num_stages, c.schedule.repeats > 1, at.mine, at.op
    dtype = c.h_aval.dtype
    send_f = jnp.where((op == FORWARD) & ~at.is_last, 1.0, 0.0).astype(dtype) * out["send"]
    received = jax.lax.cond(
        mine["send_forward"],
        jax.named_scope("pipeline_send_forward")(lambda: _shift(send_f, c.axis, s, 1, wrap)),
        c.zero_h,
    )
    new["inbox"] = _put(new["inbox"], mine["inbox_write"], received, mine["inbox_write"] >= 0)
    if c.with_grad:
        send_b = jnp.where((op == BACKWARD) & ~at.is_first, 1.0, 0.0).astype(dtype) * out["send"]
        got = jax.lax.cond(
            mine["send_backward"],
            jax.named_scope("pipeline_send_backward")(lambda: _shift(send_b, c.axis, s, -1, wrap)),
            c.zero_h,
        )
        new["grad"] = _put(new["grad"], mine["grad_write"], got, mine["grad_write"] >= 0)
    return new


def _shift(x: Array, axis: str, s: int, offset: int, wrap: bool) -> Array:
    """Send `x` `offset` devices along `axis` (round the ring only if `wrap`)."""
    pairs = [(i, (i + offset) % s) for i in range(s) if wrap or 0 <= i + offset < s]
    return jax.lax.ppermute(x, axis, pairs)


def execute_schedule(
    stage: Callable[[PyTree, Array], Array],
    params: PyTree,
    inputs: PyTree,
    targets: PyTree,
    *,
    last: Callable[[PyTree, Array, PyTree], Array],
    last_params: PyTree = None,
    first: Callable[[PyTree, PyTree], Array] | None = None,
    first_params: PyTree = None,
    schedule: PipelineSchedule,
    model_axis_name: str,
) -> Array:
    """Run a pipeline schedule's forwards and backwards; the mean loss (inside `shard_map`).

    Every device of the stage axis `model_axis_name` holds `R` local stages (global
    stages `d, d + S, ...`). Micro-batch `m` enters global stage 0 as
    `first(first_params, inputs[m])` (or `inputs[m]` itself), goes through the `S R`
    stages and leaves the last one into `last(last_params, y, targets[m])`, a scalar
    loss. Forwards and backwards run when `schedule`'s table says (see
    `pipeline_schedule`), activations and cotangents moving between neighbouring
    stages by collective-permutes; a stage stashes the residuals of the micro-batches
    it has in flight, no more. Steps where a device is idle run nothing (no stage
    call, none of its collectives); a transfer runs only on steps where some device
    sends. See the pipeline guide (docs/guides/pipeline.md).

    The result is differentiable in `params`, `first_params`, `last_params` and, when
    `first` is `None`, in `inputs` (a custom VJP: the forward runs the whole schedule
    and keeps the gradients; the backward scales them). `targets` are not
    differentiated, nor are `inputs` when `first` is given (put what needs a gradient,
    e.g. an embedding table, in `first_params`).

    **Arguments:**

    - `stage`: `stage(chunk_params, h) -> h'` runs one local stage; `h'` has the shape
      and dtype of `h`.
    - `params`: this device's local stages' parameters, a pytree of arrays with a
      leading axis of size `R` (local stage `v` is `params[v]`).
    - `inputs`: a pytree of arrays `[B, ...]`, split into `M` micro-batches along the
      first axis, read by global stage 0.
    - `targets`: a pytree of arrays `[B, ...]`, split likewise, read by `last`.
    - `last`: `last(last_params, y, targets_m) -> f32[]`, the loss of one micro-batch
      (the head: final norm, output layer, cross-entropy).
    - `last_params`: the head's parameters (a pytree of arrays).
    - `first`: `first(first_params, inputs_m) -> h` (e.g. the embedding), or `None`.
    - `first_params`: its parameters.
    - `schedule`: from `pipeline_schedule` with `S` the size of the stage axis.
    - `model_axis_name`: the stage axis.

    **Returns:**

    `f32[]`: the mean over micro-batches of `last`'s losses, the same on every stage.

    **Raises:**

    `LayerConfigError` if the stage axis is unbound or of another size than the
    schedule's, `params` do not have `R` local stages, the batch does not split into
    `M` micro-batches, or the stage changes the activation's shape or dtype.
    """
    axis = model_axis_name
    size = bound_axis_size(axis)
    if size is None:
        raise LayerConfigError(
            f"execute_schedule: the stage axis {axis!r} is not bound; run it inside "
            f"`equishard.filter_shard_map` over a mesh with that axis."
        )
    if size != schedule.num_stages:
        raise LayerConfigError(
            f"execute_schedule: the {schedule.name!r} schedule has "
            f"{schedule.num_stages} stages but the stage axis {axis!r} has size {size}."
        )
    heads = {a.shape[0] if a.ndim else None for a in jax.tree.leaves(params)}
    if heads and heads != {schedule.repeats}:
        raise LayerConfigError(
            f"execute_schedule: params must hold this device's {schedule.repeats} local "
            f"stage(s) along their leading axis; got leading sizes {sorted(map(str, heads))}."
        )
    grad_inputs = first is None and all(
        jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(inputs)
    )
    # Parameters vary like the batch and over the stage axis, once, here: the transposes
    # of these casts sum each gradient over the data axes and the stages (the head's, the
    # embedding's) by one all-reduce per array after the schedule, not one per step.
    axes = frozenset({axis}).union(*(varying_axes(a) for a in jax.tree.leaves((inputs, targets))))
    params, first_params, last_params = cast_varying((params, first_params, last_params), axes)
    if grad_inputs:
        inputs = cast_varying(inputs, axes)

    def run(with_grad: bool, params: PyTree, first_params: PyTree, last_params: PyTree, inputs: PyTree) -> Any:
        return _run(
            stage, first, last, params, first_params, last_params, inputs, targets,
            schedule, axis, axes, grad_inputs, with_grad,
        )  # fmt: skip

    @jax.custom_vjp
    def loss_of(params: PyTree, first_params: PyTree, last_params: PyTree, inputs: PyTree) -> Array:
        return run(False, params, first_params, last_params, inputs)[0]

    def fwd(params: PyTree, first_params: PyTree, last_params: PyTree, inputs: PyTree) -> tuple:
        loss, grads = run(True, params, first_params, last_params, inputs)
        return loss, grads

    def bwd(grads: tuple, g: Array) -> tuple:
        d_params, d_first, d_last, d_inputs = grads
        scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), (d_params, d_first, d_last))
        d_inputs = None if d_inputs is None else jax.tree.map(lambda a: (a * g).astype(a.dtype), d_inputs)
        return (*scaled, d_inputs)

    loss_of.defvjp(fwd, bwd)
    return loss_of(params, first_params, last_params, inputs)


def schedule_weights(schedule: PipelineSchedule, device: int | None = None) -> dict[str, float]:
    """How often `execute_schedule`'s step loop runs each kind of work, per loop trip.

    `execute_schedule` names its work with `jax.named_scope`: `pipeline_forward`,
    `pipeline_backward`, `pipeline_weight` (one per op of the table),
    `pipeline_first`/`pipeline_last` (the first stage's input function and the last
    stage's loss, inside those) and `pipeline_send_forward`/`pipeline_send_backward`
    (the transfers). Its compiled loop runs `K` trips; a collective inside one of these
    runs on device `device` only in the fraction of the trips given here. Pass the
    result to `equishard.report.read_collectives(program, weights=...)` to count the
    collectives of conditional branches as the schedule runs them rather than on every
    trip.

    **Arguments:**

    - `schedule`: from `pipeline_schedule`.
    - `device`: the position on the stage axis (default: the last, which runs the loss).

    **Returns:**

    `{scope name: runs / K}`.
    """
    s, k = schedule.num_stages, schedule.num_steps
    d = s - 1 if device is None else device
    op = schedule.op[:, d]
    g = schedule.virtual[:, d] * s + d
    plan = _plan(schedule)
    last = s * schedule.repeats - 1
    return {
        "pipeline_forward": float(np.sum(op == FORWARD)) / k,
        "pipeline_backward": float(np.sum(op == BACKWARD)) / k,
        "pipeline_weight": float(np.sum(op == WEIGHT)) / k,
        "pipeline_first": float(np.sum((op == FORWARD) & (g == 0))) / k,
        "pipeline_last": float(np.sum((op == FORWARD) & (g == last))) / k,
        "pipeline_send_forward": float(np.sum(plan.send_forward)) / k,
        "pipeline_send_backward": float(np.sum(plan.send_backward)) / k,
    }
