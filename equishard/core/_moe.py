"""Mixture-of-experts routing and dispatch: pure functions on local blocks.

Everything here takes arrays (and axis names) and returns arrays; it is valid inside
`shard_map` with the expert axis manual, and outside it with `axis_name=None` (one
device holds every expert).

The pieces, in the order a layer uses them:

- `top_k_router`: router logits → the `k` experts of each token and their weights.
- `expert_capacity`: the slots per expert per token group.
- `capacity_mask`: which assignments fit (per expert within each group, the highest
  router probability first, ties to the earlier token) and the slot of each.
- `chunk_offsets`: where each chunk of a ragged array starts, from the chunk sizes.
- the dense path, `dense_dispatch` / `dense_combine`: fixed-capacity buffers exchanged
  with `jax.lax.all_to_all` (every backend);
- the ragged path, `ragged_dispatch` / `ragged_combine`: only the kept assignments
  travel, with `jax.lax.ragged_all_to_all` where the backend has it and
  `ragged_all_to_all_emulated` (same signature and semantics, built from
  `all_to_all`, gathers and scatters) where it does not (XLA:CPU);
- `load_balancing_loss` and `router_z_loss` over the whole global batch.

Shapes in comments use the [shape letters](../guides/meshes-and-specs.md#shape-letters): `N` tokens routed by this device, `G`
token groups, `g` tokens per group, `k` experts per token, `E` experts (`E/n` per
device), `C` capacity, `D` the model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._axes import AxisName, cast_varying, combined_axis_size, varying_axes
from .._errors import LayerConfigError, SpecError

__all__ = [
    "RaggedPlan",
    "chunk_offsets",
    "capacity_mask",
    "dense_combine",
    "dense_dispatch",
    "expert_capacity",
    "load_balancing_loss",
    "native_ragged_all_to_all",
    "ragged_all_to_all_emulated",
    "ragged_combine",
    "ragged_dispatch",
    "router_z_loss",
    "top_k_router",
]


def _axis_size(axis_name: AxisName | None) -> int:
    """The size of the (bound) axis `axis_name`; 1 for `None`, one device."""
    return 1 if axis_name is None else combined_axis_size(axis_name)


# --------------------------------------------------------------------------- routing


def top_k_router(
    logits: Float[Array, "tokens experts"],
    top_k: int,
    *,
    softmax_over: Literal["selected", "all"] = "selected",
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Pick each token's `top_k` experts and their combine weights.

    **Arguments:**

    - `logits`: router logits, one row per token.
    - `top_k`: experts per token.
    - `softmax_over`: `"selected"` (default) normalises with a softmax over the `top_k`
      selected logits, so each token's weights sum to one; `"all"` takes the softmax over
      all experts first, then the `top_k` largest probabilities (they sum to less than
      one).

    **Returns:**

    `(weights, experts)`: `f[tokens, k]` router probabilities and `int32[tokens, k]`
    expert indices, highest first (ties go to the lower expert index).
    """
    if softmax_over == "selected":
        values, experts = jax.lax.top_k(logits, top_k)
        weights = jax.nn.softmax(values, axis=-1)
    elif softmax_over == "all":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    else:
        raise LayerConfigError(
            f"top_k_router(softmax_over={softmax_over!r}): expected 'selected' or 'all'."
        )
    return weights, experts.astype(jnp.int32)


def expert_capacity(
    group_tokens: int, top_k: int, num_experts: int, capacity_factor: int | float
) -> int:
    """Slots per expert per token group: `ceil(group_tokens·top_k/num_experts·capacity_factor)`.

    The product is taken exactly with the factor read as the decimal it prints as
    (`1.1` is 11/10), so `ceil` does not round a whole number up by float error.

    **Arguments:**

    - `group_tokens`: tokens per group.
    - `top_k`: experts per token.
    - `num_experts`: experts in the layer.
    - `capacity_factor`: slack over a perfectly balanced load (> 0).

    **Returns:**

    The capacity, at least 1.
    """
    if capacity_factor <= 0:
        raise LayerConfigError(
            f"expert_capacity: capacity_factor must be > 0, got {capacity_factor}."
        )
    exact = Fraction(group_tokens * top_k, num_experts) * Fraction(repr(float(capacity_factor)))
    return max(1, math.ceil(exact))


def capacity_mask(
    experts: Int[Array, "groups group_tokens k"],
    weights: Float[Array, "groups group_tokens k"],
    *,
    num_experts: int,
    capacity: int,
) -> tuple[Bool[Array, "groups group_tokens k"], Int[Array, "groups group_tokens k"]]:
    """The drop mask: which assignments each expert keeps within each token group.

    Within a group, each expert keeps the `capacity` assignments with the highest router
    probability; equal probabilities go to the earlier token. The kept assignments of an
    expert are numbered `0, 1, ...` in that priority order: the slot each occupies in the
    expert's capacity buffer.

    **Arguments:**

    - `experts`: the expert of each assignment (`top_k_router`'s second output, grouped).
    - `weights`: the router probability of each assignment.
    - `num_experts`: experts in the layer.
    - `capacity`: slots per expert per group (`expert_capacity`).

    **Returns:**

    `(keep, slot)`: `bool` (True: kept, False: dropped) and `int32` slot, both shaped
    like `experts`. A dropped assignment's slot is its would-be rank (≥ `capacity`).
    """
    groups, group_tokens, k = experts.shape
    n = group_tokens * k
    weights = jax.lax.stop_gradient(weights)

    def one_group(e: Array, w: Array) -> Array:
        # int32[g*k] in token-major order: assignment a belongs to token a // k.
        e = e.reshape(n)
        token = jnp.arange(n, dtype=jnp.int32) // k
        index = jnp.arange(n, dtype=jnp.int32)
        # Sort by (expert, probability descending, token): each expert's assignments
        # become a contiguous run in priority order.
        e_sorted, _, _, index_sorted = jax.lax.sort(
            (e, -w.reshape(n), token, index), num_keys=3
        )
        counts = jnp.zeros(num_experts, jnp.int32).at[e].add(1)
        rank_sorted = jnp.arange(n, dtype=jnp.int32) - chunk_offsets(counts)[e_sorted]
        return jnp.zeros(n, jnp.int32).at[index_sorted].set(rank_sorted)

    slot = jax.vmap(one_group)(experts, weights).reshape(groups, group_tokens, k)
    return slot < capacity, slot


def chunk_offsets(sizes: Int[Array, "*batch chunks"]) -> Int[Array, "*batch chunks"]:
    """Where each chunk starts when chunks of these sizes are laid end to end.

    The exclusive cumulative sum along the last axis: `offsets[i] = sum(sizes[:i])`.

    **Arguments:**

    - `sizes`: integer chunk sizes (last axis: the chunks).

    **Returns:**

    The offsets, same shape and dtype.
    """
    return jnp.cumsum(sizes, axis=-1, dtype=sizes.dtype) - sizes


# ------------------------------------------------------------------------- aux losses


def load_balancing_loss(
    logits: Float[Array, "tokens experts"],
    experts: Int[Array, "tokens k"],
    *,
    axis_name: AxisName | None = None,
) -> Float[Array, ""]:
    """The Switch/GShard load-balancing loss over the global batch.

    `num_experts · Σ_e f_e · P_e`, where `f_e` is the fraction of all (token, choice)
    assignments routed to expert `e` (before capacity drops) and `P_e` the mean over all
    tokens of the softmax over all experts. Both are sums over every device's tokens
    divided by the global counts, so the loss is the single-device loss of the whole
    batch, not a mean of per-device losses. It is 1 for a perfectly uniform router.
    Gradients flow through `P_e` only.

    **Arguments:**

    - `logits`: this device's router logits.
    - `experts`: this device's top-k choices.
    - `axis_name`: every mesh axis the tokens are split over (data axes and the expert
      axis), or `None` on one device.

    **Returns:**

    The scalar loss, the same on every device.
    """
    num_experts = logits.shape[-1]
    tokens, k = experts.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    prob_sum = jnp.sum(probs, axis=0)  # f32[E]
    routed = jnp.zeros(num_experts, jnp.float32).at[experts.reshape(-1)].add(1.0)
    global_tokens = tokens * _axis_size(axis_name)
    if axis_name is not None:
        prob_sum, routed = jax.lax.psum((prob_sum, routed), axis_name)
    fraction = routed / (global_tokens * k)
    mean_prob = prob_sum / global_tokens
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(
    logits: Float[Array, "tokens experts"], *, axis_name: AxisName | None = None
) -> Float[Array, ""]:
    """The router z-loss (ST-MoE): the global mean over tokens of `logsumexp(logits)²`.

    **Arguments:**

    - `logits`: this device's router logits.
    - `axis_name`: every mesh axis the tokens are split over, or `None` on one device.

    **Returns:**

    The scalar loss, the same on every device.
    """
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    total = jnp.sum(z * z)
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
    return total / (logits.shape[0] * _axis_size(axis_name))


# ------------------------------------------------------------------------- dense path


def dense_dispatch(
    x: Float[Array, "groups group_tokens dim"],
    experts: Int[Array, "groups group_tokens k"],
    slot: Int[Array, "groups group_tokens k"],
    keep: Bool[Array, "groups group_tokens k"],
    *,
    num_experts: int,
    capacity: int,
    axis_name: str | None,
) -> Float[Array, "local_experts source_groups capacity dim"]:
    """Send each kept assignment's token to its expert's device, in fixed-size buffers.

    Every device fills an `[E, G, C, D]` buffer (expert, group, slot) and one
    `all_to_all` over the expert axis hands each device the buffers of its own experts
    from every device. Empty slots hold zeros.

    **Arguments:**

    - `x`: this device's tokens, grouped.
    - `experts`, `slot`, `keep`: from `top_k_router` and `capacity_mask`.
    - `num_experts`: experts in the layer (divisible by the axis size).
    - `capacity`: slots per expert per group.
    - `axis_name`: the expert axis, or `None` on one device.

    **Returns:**

    `[E/n, n·G, C, D]`: for each local expert, the groups of device 0, then device 1, ...
    """
    groups, group_tokens, k = experts.shape
    dim = x.shape[-1]
    # Dropped assignments get an out-of-range slot and are discarded by the scatter.
    where = jnp.where(keep, slot, capacity)
    group = jnp.broadcast_to(jnp.arange(groups)[:, None, None], experts.shape)
    updates = jnp.broadcast_to(x[:, :, None, :], (groups, group_tokens, k, dim))
    # f32[G, g, D] -> f32[E, G, C, D]
    buffer = jnp.zeros((num_experts, groups, capacity, dim), x.dtype)
    buffer = buffer.at[experts, group, where].add(updates, mode="drop")
    if axis_name is None:
        return buffer
    # f32[E, G, C, D] -> f32[E/n, n*G, C, D]
    return jax.lax.all_to_all(buffer, axis_name, 0, 1, tiled=True)


def dense_combine(
    y: Float[Array, "local_experts source_groups capacity dim"],
    experts: Int[Array, "groups group_tokens k"],
    slot: Int[Array, "groups group_tokens k"],
    keep: Bool[Array, "groups group_tokens k"],
    weights: Float[Array, "groups group_tokens k"],
    *,
    axis_name: str | None,
) -> Float[Array, "groups group_tokens dim"]:
    """Return expert outputs to their tokens and sum each token's `k` of them.

    The inverse `all_to_all` of `dense_dispatch`, then each token's kept outputs are
    weighted by their router probabilities and summed; dropped assignments contribute
    zero.

    **Arguments:**

    - `y`: expert outputs laid out as `dense_dispatch` returned its buffer.
    - `experts`, `slot`, `keep`: as given to `dense_dispatch`.
    - `weights`: router probabilities (the combine weights).
    - `axis_name`: the expert axis, or `None` on one device.

    **Returns:**

    `[G, g, D]`: each token's combined expert output.
    """
    groups = experts.shape[0]
    if axis_name is not None:
        # f32[E/n, n*G, C, D] -> f32[E, G, C, D]
        y = jax.lax.all_to_all(y, axis_name, 1, 0, tiled=True)
    capacity = y.shape[2]
    where = jnp.where(keep, slot, capacity)
    group = jnp.broadcast_to(jnp.arange(groups)[:, None, None], experts.shape)
    # f32[E, G, C, D] -> f32[G, g, k, D]; dropped assignments read zeros.
    gathered = y.at[experts, group, where].get(mode="fill", fill_value=0)
    scale = jnp.where(keep, weights, 0).astype(y.dtype)
    return jnp.einsum("gsk,gskd->gsd", scale, gathered)


# ------------------------------------------------------------------------ ragged path


def _segment_of(starts: Array, sizes: Array, rows: int) -> tuple[Array, Array, Array]:
    """For packed rows `0..rows-1` of chunks laid end to end: chunk, row within, valid."""
    ends = starts + sizes
    p = jnp.arange(rows, dtype=starts.dtype)
    chunk = jnp.searchsorted(ends, p, side="right").astype(starts.dtype)
    valid = p < ends[-1]
    chunk = jnp.minimum(chunk, sizes.shape[0] - 1)
    return chunk, p - starts[chunk], valid


def ragged_all_to_all_emulated(
    operand: Array,
    output: Array,
    input_offsets: Int[Array, " slices"],
    send_sizes: Int[Array, " slices"],
    output_offsets: Int[Array, " slices"],
    recv_sizes: Int[Array, " slices"],
    *,
    axis_name: AxisName | None,
    axis_index_groups: Sequence[Sequence[int]] | None = None,
) -> Array:
    """`jax.lax.ragged_all_to_all` built from `all_to_all`, gathers and scatters.

    Same signature and semantics, for backends that lack the collective (XLA:CPU).
    With `K = len(input_offsets)` slices and `n` devices on the axis, slice `i` of
    `operand` (`operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]`) goes to
    device `i // (K/n)`, where it is written at `output_offsets[i]`; on the receiver,
    slot `i` holds the slice from device `i // (K/n)`, `recv_sizes[i]` rows long. The
    rest of `output` is kept. As for the real collective, `send_sizes` must equal
    `all_to_all(recv_sizes)` and the receiver's writes must not overlap.

    How: each device packs the rows it sends to each destination contiguously into an
    `[n, R, ...]` buffer (`R = min(output rows, (K/n) · operand rows)`, the most rows a
    destination can receive from one device), one `all_to_all` exchanges the buffers,
    and the receiver scatters them where `output_offsets` (exchanged with a second,
    small `all_to_all`) and `recv_sizes` say. It moves `n·R` rows per device where the
    real collective moves only the rows sent. Differentiable like its parts.

    **Arguments:**

    As `jax.lax.ragged_all_to_all`; `axis_name=None` means a single device (the
    exchange is the identity).

    **Returns:**

    `output` with the received slices written in.
    """
    slices = input_offsets.shape[0]
    if axis_name is None:
        n = 1
    elif axis_index_groups is not None:
        n = len(axis_index_groups[0])
    else:
        n = combined_axis_size(axis_name)
    if slices % n:
        raise SpecError(
            f"ragged_all_to_all_emulated: {slices} slices do not divide over the {n} "
            f"devices of axis {axis_name!r}."
        )
    per_device = slices // n
    rows = min(output.shape[0], per_device * operand.shape[0])
    trailing = operand.shape[1:]
    to_groups = lambda a: a.reshape(n, per_device)  # noqa: E731

    # Sender: for destination d, packed row p comes from slice d*(K/n) + chunk.
    def pack(offsets: Array, sizes: Array) -> Array:
        chunk, within, valid = _segment_of(chunk_offsets(sizes), sizes, rows)
        source = jnp.where(valid, offsets[chunk] + within, operand.shape[0])
        return operand.at[source].get(mode="fill", fill_value=0)  # [R, ...]

    # f[N, ...] -> f[n, R, ...]
    packed = jax.vmap(pack)(to_groups(input_offsets), to_groups(send_sizes))
    if axis_name is None:
        received, where_to = packed, output_offsets
    else:
        received = jax.lax.all_to_all(
            packed, axis_name, 0, 0, axis_index_groups=axis_index_groups
        )
        where_to = jax.lax.all_to_all(
            output_offsets, axis_name, 0, 0, tiled=True, axis_index_groups=axis_index_groups
        )

    # Receiver: packed row p from source s goes to where_to[s*(K/n) + chunk] + within.
    def targets(offsets: Array, sizes: Array) -> Array:
        chunk, within, valid = _segment_of(chunk_offsets(sizes), sizes, rows)
        return jnp.where(valid, offsets[chunk] + within, output.shape[0])

    target = jax.vmap(targets)(to_groups(where_to), to_groups(recv_sizes))  # int[n, R]
    return output.at[target.reshape(n * rows)].set(
        received.reshape(n * rows, *trailing).astype(output.dtype), mode="drop"
    )


def native_ragged_all_to_all(backend: str | None = None) -> bool:
    """Whether `backend` (default: JAX's default backend) compiles `ragged_all_to_all`.

    XLA:CPU does not; the GPU and TPU backends do.

    **Arguments:**

    - `backend`: a platform name (`"cpu"`, `"gpu"`, `"cuda"`, `"rocm"`, `"tpu"`).

    **Returns:**

    `True` where the native collective can be used.
    """
    backend = jax.default_backend() if backend is None else backend
    return backend != "cpu"


class RaggedPlan(NamedTuple):
    """The bookkeeping `ragged_dispatch` hands to `ragged_combine` (all integer arrays).

    - `order`: `int32[N·k]`, the assignments sorted by expert (kept ones first, in
      expert order; dropped ones last).
    - `keep`: `bool[N, k]`, which assignments were kept.
    - `send_offsets`, `send_sizes`: `int32[E]`, this device's chunk of each expert in
      its sorted rows.
    - `remote_offsets`: `int32[E]`, where each of those chunks lands on its receiver.
    - `recv_offsets`, `recv_sizes`: `int32[n·E/n]`, slot `s·(E/n) + l`: the chunk of
      local expert `l` from device `s` in this device's receive buffer.
    - `source_offsets`: `int32[n·E/n]`, where that chunk sits in device `s`'s sorted
      rows (where the combine sends it back).
    """

    order: Array
    keep: Array
    send_offsets: Array
    send_sizes: Array
    remote_offsets: Array
    recv_offsets: Array
    recv_sizes: Array
    source_offsets: Array


def _exchange(emulate: bool) -> Callable[..., Array]:
    return ragged_all_to_all_emulated if emulate else jax.lax.ragged_all_to_all


def _zeros_varying(shape: tuple[int, ...], dtype: jnp.dtype, like: Array) -> Array:
    """Zeros typed as varying over the same manual axes as `like`.

    `jax.lax.ragged_all_to_all` types its result like its `output` argument: an
    invariant zero buffer would make the received rows look invariant, and the
    transpose would then wrongly `psum` their cotangent.
    """
    return cast_varying(jnp.zeros(shape, dtype), varying_axes(like))


def ragged_dispatch(
    x: Float[Array, "tokens dim"],
    experts: Int[Array, "tokens k"],
    keep: Bool[Array, "tokens k"],
    *,
    num_experts: int,
    buffer_rows: int,
    axis_name: str | None,
    emulate: bool,
) -> tuple[Float[Array, "buffer_rows dim"], Int[Array, " local_experts"], RaggedPlan]:
    """Send each kept assignment's token to its expert's device, with no padding.

    The kept assignments are sorted by expert; each expert's run travels with one
    `ragged_all_to_all` to the device holding it, where the runs land grouped by local
    expert (expert 0's rows from device 0, 1, ..., then expert 1's, ...), ready for
    `jax.lax.ragged_dot`. Sizes are exchanged with one small `all_gather`, and every
    offset is computed from them locally.

    **Arguments:**

    - `x`: this device's tokens.
    - `experts`, `keep`: the top-k choices and the capacity mask, per token.
    - `num_experts`: experts in the layer (divisible by the axis size).
    - `buffer_rows`: rows of the receive buffer; must hold the most any device can
      receive (with capacity `C` per group and `G` groups per device: `E·G·C`).
    - `axis_name`: the expert axis, or `None` on one device.
    - `emulate`: use `ragged_all_to_all_emulated` instead of the native collective.

    **Returns:**

    `(rows, group_sizes, plan)`: the received rows `[buffer_rows, D]` (zeros past the
    last group), the rows per local expert `int32[E/n]`, and the bookkeeping for
    `ragged_combine`.
    """
    tokens, k = experts.shape
    n = _axis_size(axis_name)
    local = num_experts // n
    me = 0 if axis_name is None else jax.lax.axis_index(axis_name)
    flat_experts = experts.reshape(tokens * k)
    flat_keep = keep.reshape(tokens * k)
    # Kept assignments sorted by expert, dropped ones (key E) at the end.
    order = jnp.argsort(jnp.where(flat_keep, flat_experts, num_experts), stable=True)
    order = order.astype(jnp.int32)
    sorted_x = x[order // k]  # f32[N*k, D]

    sizes = jnp.zeros(num_experts, jnp.int32).at[flat_experts].add(flat_keep.astype(jnp.int32))
    offsets = chunk_offsets(sizes)  # int32[E]
    if axis_name is None:
        counts = sizes[None, :]  # int32[n=1, E]
    else:
        counts = jax.lax.all_gather(sizes, axis_name)  # int32[n, E]: source x expert
    # Receive buffer of device d: local expert l's rows from source 0, 1, ...
    per_expert = jnp.sum(counts, axis=0).reshape(n, local)  # rows per (device, local expert)
    expert_start = chunk_offsets(per_expert).reshape(num_experts)  # int32[E]
    before_me = chunk_offsets(counts.T).T  # int32[n, E]: rows from earlier sources
    remote_offsets = expert_start + before_me[me]
    # Slot s*(E/n) + l on this device: local expert l from source s.
    mine = jax.lax.dynamic_slice_in_dim(counts, me * local, local, axis=1)  # [n, E/n]
    recv_sizes = mine.reshape(n * local)
    mine_start = jax.lax.dynamic_slice_in_dim(expert_start, me * local, local)
    mine_before = jax.lax.dynamic_slice_in_dim(before_me, me * local, local, axis=1)
    recv_offsets = (mine_start[None, :] + mine_before).reshape(n * local)
    source_offsets = jax.lax.dynamic_slice_in_dim(
        chunk_offsets(counts), me * local, local, axis=1
    ).reshape(n * local)
    group_sizes = jax.lax.dynamic_slice_in_dim(per_expert.reshape(num_experts), me * local, local)

    output = _zeros_varying((buffer_rows, x.shape[-1]), x.dtype, like=x)
    if axis_name is None:
        rows = ragged_all_to_all_emulated(
            sorted_x, output, offsets, sizes, remote_offsets, recv_sizes, axis_name=None
        )
    else:
        rows = _exchange(emulate)(
            sorted_x, output, offsets, sizes, remote_offsets, recv_sizes, axis_name=axis_name
        )
    plan = RaggedPlan(
        order=order,
        keep=keep,
        send_offsets=offsets,
        send_sizes=sizes,
        remote_offsets=remote_offsets,
        recv_offsets=recv_offsets,
        recv_sizes=recv_sizes,
        source_offsets=source_offsets,
    )
    return rows, group_sizes, plan


def ragged_combine(
    y: Float[Array, "buffer_rows dim"],
    weights: Float[Array, "tokens k"],
    plan: RaggedPlan,
    *,
    axis_name: str | None,
    emulate: bool,
) -> Float[Array, "tokens dim"]:
    """Return expert outputs to their tokens and sum each token's `k` of them.

    The reverse `ragged_all_to_all` of `ragged_dispatch` (each chunk goes back to where
    it came from), then each token's kept outputs are weighted by their router
    probabilities and summed; dropped assignments contribute zero.

    **Arguments:**

    - `y`: expert outputs in the receive buffer's layout.
    - `weights`: router probabilities.
    - `plan`: from `ragged_dispatch`.
    - `axis_name`, `emulate`: as given to `ragged_dispatch`.

    **Returns:**

    `[N, D]`: each token's combined expert output.
    """
    tokens, k = weights.shape
    output = _zeros_varying((tokens * k, y.shape[-1]), y.dtype, like=y)
    args = (y, output, plan.recv_offsets, plan.recv_sizes, plan.source_offsets, plan.send_sizes)
    if axis_name is None:
        back = ragged_all_to_all_emulated(*args, axis_name=None)
    else:
        back = _exchange(emulate)(*args, axis_name=axis_name)
    # Sorted rows -> assignment order: f32[N*k, D] -> f32[N, k, D]
    inverse = jnp.zeros(tokens * k, jnp.int32).at[plan.order].set(
        jnp.arange(tokens * k, dtype=jnp.int32)
    )
    per_assignment = back[inverse].reshape(tokens, k, -1)
    scale = jnp.where(plan.keep, weights, 0).astype(y.dtype)
    return jnp.einsum("tk,tkd->td", scale, per_assignment)
