"""`MoE`: a mixture-of-experts MLP with expert parallelism, in local view.

Experts are split over an expert axis; each token travels to the device holding each of
its `top_k` experts and back. Token groups, capacity and drops are fixed by the layer,
not by the mesh, so the same assignments are dropped on every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import bound_axis_size, varying_axes
from .._errors import LayerConfigError, SpecError
from ..core import (
    capacity_mask,
    dense_combine,
    dense_dispatch,
    expert_capacity,
    load_balancing_loss,
    native_ragged_all_to_all,
    ragged_combine,
    ragged_dispatch,
    router_z_loss,
    top_k_router,
)
from ..sharding import Sharded
from ._initializers import check_choice, check_divisible, check_positive, default_dtype, value_of

_DISPATCHES = ("auto", "dense", "ragged")
_RAGGED_IMPLS = ("auto", "native", "emulated")


class MoEAux(eqx.Module):
    """What `MoE` returns beside its output: auxiliary losses and routing statistics.

    All are over the whole global batch (summed over every device's tokens, then
    normalised by the global counts) and the same on every device.

    **Fields:**

    - `load_balancing_loss`: `num_experts · Σ_e f_e · P_e`, `f_e` the fraction of
      assignments routed to expert `e` before capacity drops, `P_e` the mean router
      probability of `e` (softmax over all experts). 1 for a uniform router.
    - `z_loss`: the router z-loss, mean over tokens of `logsumexp(logits)²`.
    - `dropped`: `int32[]`, the (token, choice) assignments dropped for lack of capacity.
    - `expert_load`: `int32[num_experts]`, the assignments routed to each expert (before
      drops).
    """

    load_balancing_loss: Float[Array, ""]
    z_loss: Float[Array, ""]
    dropped: Int[Array, ""]
    expert_load: Int[Array, " num_experts"]


class MoE(eqx.Module):
    """A mixture-of-experts MLP layer with expert parallelism (local view).

    Each token is routed by a linear gate to its `top_k` experts; each expert is an MLP
    `w_out · act(w_in · x)`. The output is the sum of a token's expert outputs weighted
    by their router probabilities. It does not include the residual: a dropped
    assignment contributes zero, and the caller's residual carries the token.

    **Layout.** Call it inside `es.filter_shard_map` with tokens `[batch, seq, hidden]`
    split over the batch on the data axes and over the sequence on the expert axis:
    `P(data_axis_name, expert_axis_name, None)`. Each expert-axis device routes its own
    slice of the sequence; the expert weights carry `P(expert_axis_name)` on their
    expert dimension, the gate is replicated. Outside `shard_map` (nothing bound) it
    runs on one device holding every expert.

    **Groups, capacity, drops.** Tokens are taken in the global `[batch, seq]` row-major
    order and cut into contiguous groups of `group_size`. Each expert accepts at most
    `capacity = ceil(group_size · top_k / num_experts · capacity_factor)` assignments per
    group, keeping those with the highest router probability (ties to the earlier
    token); the rest are dropped. Groups are fixed by the layer, not the mesh, so the
    same assignments are dropped on every layout; every device must hold whole groups:
    `group_size` divides the local sequence slice, or, when the sequence is not split
    (`ep` of size 1), the local `batch · seq`.

    **Dispatch.** `"dense"`: fixed `[E, G, C, D]` capacity buffers exchanged with
    `jax.lax.all_to_all` (every backend). `"ragged"`: only the kept assignments travel,
    with `jax.lax.ragged_all_to_all`, and the experts run with `jax.lax.ragged_dot`;
    where the backend lacks `ragged_all_to_all` (XLA:CPU) the emulation
    `equishard.core.ragged_all_to_all_emulated` stands in (`ragged_impl="emulated"`).
    `"auto"` resolves when the layer is built, from JAX's default backend: ragged with
    the native collective on GPU and TPU, dense on the CPU. The resolved choice is a
    field (it shows in the repr); `with_dispatch` changes it.

    **Auxiliary outputs.** `MoEAux`: load-balancing and z-losses over the whole global
    batch (not per device; `data_axis_name` names the data axes they sum over), the
    number of dropped assignments and the per-expert load.
    """

    gate: Sharded
    w_in: Sharded
    w_out: Sharded
    hidden: int = eqx.field(static=True)
    ffn: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    group_size: int = eqx.field(static=True)
    expert_axis_name: str = eqx.field(static=True)
    data_axis_name: tuple[str, ...] = eqx.field(static=True)
    dispatch: Literal["dense", "ragged"] = eqx.field(static=True)
    ragged_impl: Literal["native", "emulated"] = eqx.field(static=True)
    softmax_over: Literal["selected", "all"] = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        *,
        capacity_factor: int | float = 1.25,
        group_size: int = 128,
        expert_axis_name: str = "ep",
        data_axis_name: str | Sequence[str] | None = None,
        dispatch: Literal["auto", "dense", "ragged"] = "auto",
        ragged_impl: Literal["auto", "native", "emulated"] = "auto",
        softmax_over: Literal["selected", "all"] = "selected",
        activation: Callable[[Array], Array] = jax.nn.gelu,
        dtype: jnp.dtype | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `hidden`: the model width `D` (input and output features).
        - `ffn`: each expert's hidden width `F`.
        - `num_experts`: experts `E`; must divide evenly over the expert axis.
        - `top_k`: experts per token, `1 ≤ top_k ≤ num_experts`.
        - `capacity_factor`: slack of each expert's capacity over a balanced load (> 0).
        - `group_size`: tokens per routing group (see the class documentation).
        - `expert_axis_name`: the mesh axis the experts and the sequence are split over.
        - `data_axis_name`: the mesh axis or axes the batch is split over (the aux losses
          and statistics sum over them and the expert axis); `None` for none.
        - `dispatch`: `"dense"`, `"ragged"` or `"auto"` (by backend, resolved now).
        - `ragged_impl`: for the ragged path, `"native"` `ragged_all_to_all`,
          `"emulated"`, or `"auto"` (native where the backend has it, resolved now).
        - `softmax_over`: router weights from a softmax over the `"selected"` top-k logits
          (default) or over `"all"` experts, then top-k.
        - `activation`: the experts' activation (default GELU).
        - `dtype`: parameter dtype (default: JAX's default float).
        - `key`: a `jax.random.PRNGKey` for the initial weights.
        """
        name = f"MoE(hidden={hidden}, ffn={ffn}, num_experts={num_experts}, top_k={top_k})"
        for what, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts), ("top_k", top_k)):
            check_positive(name, what, value)
        if top_k > num_experts:
            raise LayerConfigError(
                f"{name}: top_k={top_k} must be between 1 and num_experts={num_experts}."
            )
        if not capacity_factor > 0:
            raise LayerConfigError(f"{name}: capacity_factor must be > 0, got {capacity_factor}.")
        check_positive(name, "group_size", group_size)
        check_choice(name, "dispatch", dispatch, _DISPATCHES)
        check_choice(name, "ragged_impl", ragged_impl, _RAGGED_IMPLS)
        check_choice(name, "softmax_over", softmax_over, ("selected", "all"))
        if data_axis_name is None:
            data_axes: tuple[str, ...] = ()
        elif isinstance(data_axis_name, str):
            data_axes = (data_axis_name,)
        else:
            data_axes = tuple(data_axis_name)
        if expert_axis_name in data_axes:
            raise LayerConfigError(
                f"{name}: expert_axis_name={expert_axis_name!r} is also a data axis "
                f"(data_axis_name={data_axis_name!r})."
            )
        native = native_ragged_all_to_all()
        if dispatch == "auto":
            dispatch = "ragged" if native else "dense"
        if ragged_impl == "auto":
            ragged_impl = "native" if native else "emulated"

        dtype = default_dtype(dtype)
        gkey, ikey, okey = jax.random.split(key, 3)
        lim_d, lim_f = 1 / math.sqrt(hidden), 1 / math.sqrt(ffn)
        uniform = jax.random.uniform
        # f32[D, E], replicated; f32[E, D, F] and f32[E, F, D], split over experts.
        self.gate = Sharded(uniform(gkey, (hidden, num_experts), dtype, -lim_d, lim_d), P())
        self.w_in = Sharded(
            uniform(ikey, (num_experts, hidden, ffn), dtype, -lim_d, lim_d), P(expert_axis_name)
        )
        self.w_out = Sharded(
            uniform(okey, (num_experts, ffn, hidden), dtype, -lim_f, lim_f), P(expert_axis_name)
        )
        self.hidden = hidden
        self.ffn = ffn
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.group_size = group_size
        self.expert_axis_name = expert_axis_name
        self.data_axis_name = data_axes
        self.dispatch = dispatch
        self.ragged_impl = ragged_impl
        self.softmax_over = softmax_over
        self.activation = activation

    # ------------------------------------------------------------------ configuration

    @property
    def capacity(self) -> int:
        """Slots per expert per token group."""
        return expert_capacity(self.group_size, self.top_k, self.num_experts, self.capacity_factor)

    def with_dispatch(
        self,
        dispatch: Literal["auto", "dense", "ragged"],
        ragged_impl: Literal["auto", "native", "emulated"] | None = None,
    ) -> MoE:
        """A copy of this layer (same weights) with another dispatch path.

        **Arguments:**

        - `dispatch`: `"dense"`, `"ragged"` or `"auto"` (resolved by backend).
        - `ragged_impl`: `"native"`, `"emulated"`, `"auto"`, or `None` to keep.

        **Returns:**

        The new layer.
        """
        impl = self.ragged_impl if ragged_impl is None else ragged_impl

        def build() -> MoE:
            return MoE(
                self.hidden, self.ffn, self.num_experts, self.top_k,
                capacity_factor=self.capacity_factor, group_size=self.group_size,
                expert_axis_name=self.expert_axis_name, data_axis_name=self.data_axis_name,
                dispatch=dispatch, ragged_impl=impl, softmax_over=self.softmax_over,
                activation=self.activation, dtype=value_of(self.gate).dtype,
                key=jax.random.key(0),
            )

        # The new hyperparameters on a shape-only layer (validated and resolved by
        # `__init__`, no weights drawn), then this layer's weights put in.
        skeleton = eqx.filter_eval_shape(build)
        return eqx.tree_at(lambda m: (m.gate, m.w_in, m.w_out), skeleton, (self.gate, self.w_in, self.w_out))

    def _name(self) -> str:
        return (
            f"MoE(hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"group_size={self.group_size})"
        )

    # --------------------------------------------------------------------- validation

    def _check(self, x: Array) -> tuple[int, tuple[str, ...]]:
        """Validate the local input; return the expert-axis size and the token axes."""
        name = self._name()
        if x.ndim != 3 or x.shape[-1] != self.hidden:
            raise SpecError(
                f"{name}: expected local tokens [batch, seq, hidden={self.hidden}], got "
                f"shape {x.shape}."
            )
        ep_axis = self.expert_axis_name
        ep = bound_axis_size(ep_axis)
        token_axes: list[str] = []
        for axis in self.data_axis_name:
            if bound_axis_size(axis) is None:
                raise SpecError(
                    f"{name}: data axis {axis!r} is not a mesh axis of the enclosing "
                    f"shard_map."
                )
            token_axes.append(axis)
        if ep is not None:
            token_axes.append(ep_axis)
            check_divisible(name, "num_experts", self.num_experts, ep_axis, ep)
        n = 1 if ep is None else ep
        local_experts = self.num_experts // n
        for field, box, want in (
            ("w_in", self.w_in, (local_experts, self.hidden, self.ffn)),
            ("w_out", self.w_out, (local_experts, self.ffn, self.hidden)),
        ):
            shape = tuple(jnp.shape(value_of(box)))
            if shape != want:
                raise SpecError(
                    f"{name}: local {field} has shape {shape} with spec {getattr(box, 'spec', None)}, expected "
                    f"{want} ({self.num_experts} experts split {n} ways over {ep_axis!r})."
                )
        varying = varying_axes(x)
        if varying:
            extra = sorted(varying - set(token_axes))
            if extra:
                raise SpecError(
                    f"{name}: the tokens vary over mesh axes {extra}, which are neither the "
                    f"expert axis {ep_axis!r} nor a data axis (data_axis_name="
                    f"{self.data_axis_name}); name them in data_axis_name so the aux losses "
                    f"cover the whole batch."
                )
            missing = [a for a in token_axes if a not in varying and bound_axis_size(a) != 1]
            if missing:
                raise SpecError(
                    f"{name}: the tokens are not split over {missing}; expected "
                    f"[batch, seq, hidden] split as P({self.data_axis_name or None}, "
                    f"{ep_axis!r}, None)."
                )
        batch, seq, _ = x.shape
        gs = self.group_size
        whole = seq % gs == 0 if n > 1 else (batch * seq) % gs == 0
        if not whole:
            where = (
                f"the local sequence slice of {seq} tokens (sequence split {n} ways over "
                f"{ep_axis!r})"
                if n > 1
                else f"the local batch x seq = {batch} x {seq} = {batch * seq} tokens"
            )
            raise LayerConfigError(
                f"{name}: token groups are contiguous runs of group_size={gs} tokens in the "
                f"global [batch, seq] order and each device must hold whole groups, but "
                f"{gs} does not divide {where}."
            )
        return n, tuple(token_axes)

    # -------------------------------------------------------------------------- call

    def __call__(
        self, x: Float[Array, "batch seq hidden"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq hidden"], MoEAux]:
        """Route this device's tokens through their experts.

        **Arguments:**

        - `x`: local tokens `[batch/dp, seq/ep, hidden]`.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        `(y, aux)`: `y` with the shape of `x` (the weighted sum of each token's kept
        expert outputs, without the residual), and `MoEAux` (global losses and
        statistics).
        """
        n, token_axes = self._check(x)
        ep_axis = self.expert_axis_name if bound_axis_size(self.expert_axis_name) else None
        sum_axes = token_axes or None
        batch, seq, dim = x.shape
        tokens = batch * seq
        groups = tokens // self.group_size
        capacity = self.capacity
        e_total, k = self.num_experts, self.top_k

        flat = x.reshape(tokens, dim)  # f32[N, D], N = B/dp * T/ep
        gate = value_of(self.gate)
        # f32[T, D] @ f32[D, E] -> f32[T, E], routed in float32
        logits = flat.astype(jnp.float32) @ gate.astype(jnp.float32)
        weights, experts = top_k_router(logits, k, softmax_over=self.softmax_over)  # [T, k]
        grouped = (groups, self.group_size, k)
        keep, slot = capacity_mask(
            experts.reshape(grouped), weights.reshape(grouped), num_experts=e_total, capacity=capacity
        )

        # f32[E/n, D, F], f32[E/n, F, D]
        w_in, w_out = value_of(self.w_in), value_of(self.w_out)
        if self.dispatch == "dense":
            # f32[G, g, D] -> f32[E/n, n*G, C, D]
            buffer = dense_dispatch(
                flat.reshape(groups, self.group_size, dim),
                experts.reshape(grouped),
                slot,
                keep,
                num_experts=e_total,
                capacity=capacity,
                axis_name=ep_axis,
            )
            local, sources = buffer.shape[:2]
            rows = buffer.reshape(local, sources * capacity, dim)
            hidden = self.activation(jnp.einsum("erd,edf->erf", rows, w_in))
            out = jnp.einsum("erf,efd->erd", hidden, w_out).reshape(buffer.shape)
            # f32[E/n, n*G, C, D] -> f32[G, g, D]
            y = dense_combine(
                out, experts.reshape(grouped), slot, keep, weights.reshape(grouped), axis_name=ep_axis
            ).reshape(tokens, dim)
        else:
            emulate = self.ragged_impl == "emulated"
            buffer_rows = min(n * tokens * k, e_total * groups * capacity)
            # f32[T, D] -> f32[M, D], M = min(n*T*k, E*G*C), grouped by local expert
            rows, group_sizes, plan = ragged_dispatch(
                flat,
                experts,
                keep.reshape(tokens, k),
                num_experts=e_total,
                buffer_rows=buffer_rows,
                axis_name=ep_axis,
                emulate=emulate,
            )
            hidden = self.activation(jax.lax.ragged_dot(rows, w_in, group_sizes))
            out = jax.lax.ragged_dot(hidden, w_out, group_sizes)
            # f32[M, D] -> f32[T, D]
            y = ragged_combine(out, weights, plan, axis_name=ep_axis, emulate=emulate)

        dropped = jnp.sum(~keep, dtype=jnp.int32)
        load = jnp.zeros(e_total, jnp.int32).at[experts.reshape(-1)].add(1)
        if sum_axes is not None:
            dropped, load = jax.lax.psum((dropped, load), sum_axes)
        aux = MoEAux(
            load_balancing_loss=load_balancing_loss(logits, experts, axis_name=sum_axes),
            z_loss=router_z_loss(logits, axis_name=sum_axes),
            dropped=dropped,
            expert_load=load,
        )
        return y.reshape(batch, seq, dim).astype(x.dtype), aux
