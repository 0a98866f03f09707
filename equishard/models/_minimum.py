"""The analytical minimum of the reference GPT's train step: the bytes each device must
send per step under a layout (`gpt_minimum`), built from the textbook terms of
`equishard.report` (`Term`, `Minimum`; read the textbook minima there).

**equishard's algorithm** (`gpt_minimum`, the reference GPT under a `Layout`): the same
terms, derived per parameter and per collective that equishard's train step issues,
plus the terms the textbook formulas leave out. Each `Term` records its formula.

- *Parameters* (from the per-parameter table: `b` the bytes a device stores, `S` the
  axes its spec splits it over). An array of a block split over `fsdp` is gathered in
  forward, re-gathered in backward and its gradient reduce-scattered:
  `3(n_fsdp − 1) · b`. (The re-gather recomputes the wrapped unit's forward but keeps
  the outputs of the unit's other collectives, so its tensor-parallel and expert
  collectives are not sent again.) The split arrays outside the blocks (embedding,
  output head) are gathered once: the head keeps its gathered copy for the backward
  pass, the lookup's backward needs no table: `2(n_fsdp − 1) · b`.
  Its gradient is all-reduced over the axes `R` it is replicated over but used on varying
  data: `2(n_R − 1)/n_R · b`, `R` = the data axes (`dp`, `fsdp`, `ep`) not in `S`; plus
  `tp` for the norms under sequence parallelism (their inputs are split over the
  sequence); plus `pp` for the final norm and the output head (replicated over the
  stages, run on every stage's — mostly zero — pipeline output). A tied embedding is
  cast to vary over the data axes once for its two uses (lookup and head), so its
  gradient is reduced once; under a pipeline the head's part is first summed over `pp`
  by an all-reduce of its own.
- *Tensor parallel*: per dense block 4 all-reduces of `A` (2 in a MoE block: the
  attention's), as Megatron; the vocabulary-parallel embedding (one all-reduce of `A`
  forward), the output head (one all-reduce of its input's gradient, `A`), the
  vocabulary-parallel cross-entropy (three all-reduces of one f32 per token: the
  maximum, the sum of exponentials, the target logit). Sequence parallelism turns each
  all-reduce into an all-gather / reduce-scatter pair: the same bytes.
- *Expert parallel*: per MoE layer 4 all-to-alls of the capacity buffer,
  `(n−1)/n · G·E·C·D` each (`G` token groups on the device, `E` experts, `C` capacity);
  and the routing statistics, an all-reduce over the data axes of `2E + 2` numbers
  (router-probability and routed-fraction sums, z-loss, dropped count).
- *Pipeline* (`S` stages, `M` micro-batches, `R` repeats): the SPMD schedule runs
  `T = R·M + S − 1` steps and every device calls its stage at every step, bubble steps
  included; so the stage's collectives (tensor-parallel all-reduces, FSDP gathers) run
  `T` times where a bubble-free pipeline runs `R·M`. Every step but the last sends its
  output on (the last step's output stays on the last stage): the activations cost
  `2(T − 1) · A/M` (forward and backward) where the textbook minimum is `2·R·M · A/M`
  — the same with two stages. The embedding is replicated over the stages, so the
  gradient of the pipeline's input is summed over them: `2(S−1)/S · A`. The loss is
  taken from the last stage with one all-reduce of a scalar.
- *Explicit schedules* (`1f1b`, `interleaved-1f1b`, `zb-h1`; the figures are those of
  the last stage's device, whose collectives the report reads): idle steps call no
  stage, so a device's stage runs `R·M` times, `T = R·M`. The embedding runs on the
  first stage, the head and loss on the last, micro-batch by micro-batch: the last
  stage's device sends the head's and the cross-entropy's all-reduces but not the
  embedding's, and no gradient of a pipeline input; instead the embedding's gradient,
  like the norm's and the head's, is summed over the stages (`pp` joins its gradient
  axes; a tied table is cast once for both uses, so it is summed once). The
  activations cost `(K_f + K_b) · A/M`, `K_f`, `K_b` the steps of the table on which
  some device sends forward, backward (every device of the stage axis takes part in
  a collective-permute). ZB-H1's weight-gradient step differentiates the stage again
  to reach every layer's weights, so the backward's tensor-parallel all-reduces (half
  of a block's) run twice: the block term is `3/2` of 1F1B's. With FSDP the stage's
  units and the embedding, norm and head are gathered once per step before the
  schedule and reduce-scattered once after it: `2(n_fsdp − 1) · b` for every split
  array, independent of `M`.
- *Context parallel* (`cp` devices, `K` one f32 key or value block `[b, S/cp,
  h_kv, head_dim]` of a device, `P` its int32 positions `[b, S/cp]`): ring attention
  sends per layer `(cp−1) · 2K` forward (the key/value blocks round the ring; their
  positions, the same in every layer, travel once: `(cp−1) · P`), and backward the
  blocks with their positions again, `(cp−1)(2K + P)`, plus their gradient
  accumulators, `cp · 2K` (the last shift brings them home). All-to-all attention sends per layer
  `2 · (cp−1)/cp · (2Q + 2K)` (q, k, v in and the output back, forward and backward;
  key/value heads repeated to a multiple of `cp`) and all-gathers the positions once
  for all layers, `(cp−1) · P`. With a pipeline axis a device runs its `L/(S R)`
  layers `T` times on micro-batches (`K`, `P` per micro-batch): the ring sends the
  per-layer terms for each of those calls; with `cp = 2` (one shift) the positions
  travel once and the last call's forward blocks serve its backward's re-ring, so
  `(cp−1) · 2K` per local layer less. All-to-all attention under a pipeline sends
  the bytes of `L/(S R) · T/M` layers on the whole local batch, and gathers the
  positions row `int32[S/cp]` once. The context axis also joins the data axes in the gradient reduction
  and the loss `pmean`, and `A` counts the tokens per data and context shard.
- *Scalars*: the loss `pmean` over the data axes (with MoE also the cross-entropy
  metric, which then differs from the loss, and the gradient of the global auxiliary
  loss, which joins each device's local cross-entropy), and one f32 per split gradient
  array for the global gradient norm, all-reduced over the axes that split it.

`Term.ideal_bytes` is each term without the pipeline bubble (the textbook figure);
`Term.bytes` is what equishard's algorithm must send, which the measured figure is
compared against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, PartitionSpec as P

from .._names import RING, differentiated_scan
from .._text import human_bytes
from ..core import expert_capacity, pipeline_schedule, schedule_weights
from ..nn import RMSNorm
from ..report import Minimum, Term, expert_parallel_minimum, pipeline_minimum
from ..report._internal import ring_fraction as _ring
from ..sharding import Layout, Parallelism, ParamRow, is_sharded, param_table, path_str
from ..sharding._internal import resolve_layout, spec_axes, zero_spec
from ._gpt import GPT, GPTConfig, canonical_path

__all__ = ["gpt_minimum", "gpt_param_rows"]

F32 = 4


@dataclasses.dataclass(frozen=True)
class _Setting:
    """The quantities of one GPT train step under one layout."""

    config: GPTConfig
    sizes: Mapping[str, int]
    data_axes: tuple[str, ...]
    tp: int
    ep: int
    stages: int
    microbatches: int
    repeats: int
    sequence_parallel: bool
    cp: int  # the context axis's size (1 without one)
    context: str | None
    context_impl: str
    batch: int  # sequences per data shard per step
    seq: int  # tokens per sequence
    tokens: int  # tokens per device's shard (data and context) per step
    activation: float  # A: bytes of [tokens per data shard, d_model]
    explicit: bool = False  # an explicit pipeline schedule (1F1B, ...): idle steps run nothing
    schedule: str | None = None  # the pipeline schedule's name
    zero: int = 1  # the dp size the optimizer state is split over (ZeRO-1), 1 without
    min_weight_size: int = 0  # arrays of fewer elements stay replicated under ZeRO

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    @property
    def steps(self) -> int:
        """Stage calls per device per pass: `T = R M + S − 1` (1 without a pipeline; `R M`
        with an explicit schedule, whose idle steps call no stage)."""
        if self.stages == 1:
            return 1
        if self.explicit:
            return self.repeats * self.microbatches
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def blocks(self) -> list[bool]:
        """For each block of the model, whether it is a MoE block."""
        k = max(self.config.moe_every, 1)
        moe = [self.config.moe_every > 0 and i % k == k - 1 for i in range(k)]
        return moe * (self.config.n_layers // k)


def _setting(config: GPTConfig, par: Parallelism, batch_size: int, seq_len: int) -> _Setting:
    sizes = par.shape
    data = math.prod(sizes[a] for a in par.data_axes)
    cp = par.size(par.context)
    tokens = batch_size * seq_len // (data * cp)
    # The context axis splits the tokens like a data axis: the loss is averaged and the
    # gradients are reduced over it too.
    grad_axes = tuple(a for a in sizes if a in par.data_axes or a == par.context)
    return _Setting(
        config=config,
        sizes=sizes,
        data_axes=grad_axes,
        tp=par.size(par.tensor),
        ep=par.size(par.expert),
        stages=par.num_stages,
        microbatches=par.num_microbatches,
        repeats=par.pipeline_repeats,
        sequence_parallel=par.sequence_parallel,
        cp=cp,
        context=par.context,
        context_impl=par.context_impl,
        batch=batch_size // data,
        seq=seq_len,
        tokens=tokens,
        activation=float(tokens * config.d_model * F32),
        explicit=not differentiated_scan(par.pipeline_schedule),
        schedule=par.pipeline_schedule,
        zero=par.size(par.zero),
        min_weight_size=par.fsdp_min_weight_size,
    )


def _is_unit(path: str) -> bool:
    return canonical_path("." + path).startswith(".units.")


def _gradient_roles(model: GPT) -> dict[str, frozenset[str]]:
    """The parameters' paths, each with what the model's structure says of its uses.

    `"norm"`: a parameter of an `RMSNorm` (under sequence parallelism its input is split
    over the sequence on `tp`); `"after_pipeline"`: of a field the GPT declares in
    `GPT.after_pipeline`; `"embedding"`: of the embedding; `"tied_embedding"`: the
    embedding a tied GPT also uses as its head.
    """
    roles: dict[str, set[str]] = {}

    def mark(prefix: tuple[Any, ...], sub: Any, role: str) -> None:
        for path, _ in jax.tree_util.tree_flatten_with_path(sub, is_leaf=is_sharded)[0]:
            roles.setdefault(path_str((*prefix, *path)), set()).add(role)

    is_norm = lambda x: isinstance(x, RMSNorm)  # noqa: E731
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: is_norm(x) or is_sharded(x))
    for path, leaf in found[0]:
        if is_norm(leaf):
            mark(path, leaf, "norm")
    for path, _ in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_sharded)[0]:
        field = getattr(path[0], "name", None)
        if field in type(model).after_pipeline:
            roles.setdefault(path_str(path), set()).add("after_pipeline")
        if field == "embed":
            roles.setdefault(path_str(path), set()).add("embedding")
        if field == "embed" and model.config.tied:
            roles.setdefault(path_str(path), set()).add("tied_embedding")
    return {path: frozenset(r) for path, r in roles.items()}


def _gradient_axes(row: ParamRow, s: _Setting, roles: frozenset[str]) -> list[tuple[str, ...]]:
    """The axes of each all-reduce of a parameter's gradient (see the module docs)."""
    split = set(spec_axes(row.spec))
    axes = set(s.data_axes)
    if s.sequence_parallel and "norm" in roles:
        axes.add("tp")
    groups = [axes]
    if s.stages > 1 and ("after_pipeline" in roles or (s.explicit and "embedding" in roles)):
        # Replicated over the stages and run on one: summed over them. An explicit
        # schedule casts the embedding, norm and head once, so a tied table is summed
        # once for both its uses.
        axes.add("pp")
    elif s.stages > 1 and "tied_embedding" in roles:
        # The head's use is summed over the stages first; the lookup's is the same on
        # every stage, so the total is then summed over the data axes alone.
        groups.insert(0, {"pp"})
    out = [tuple(a for a in s.sizes if a in g - split and s.sizes[a] > 1) for g in groups]
    return [g for g in out if g]


def _zero_splits(row: ParamRow, s: _Setting) -> bool:
    """Whether ZeRO splits this parameter's optimizer state (and gradient) over dp."""
    return s.zero > 1 and zero_spec(row.spec, row.shape, ("dp",), s.zero, s.min_weight_size) != row.spec


def _parameter_terms(
    rows: Sequence[ParamRow], s: _Setting, roles: Mapping[str, frozenset[str]]
) -> list[Term]:
    terms: list[Term] = []
    fsdp = s.sizes.get("fsdp", 1)
    if fsdp > 1 and s.explicit and s.stages > 1:
        # Gathered once per step before the schedule, reduce-scattered once after it.
        stored = sum(r.bytes_per_device for r in rows if "fsdp" in spec_axes(r.spec))
        value = float(2 * (fsdp - 1) * stored)
        terms.append(
            Term(
                "fsdp: gather (once per step) and reduce-scatter of split parameters",
                "all-gather/reduce-scatter",
                ("fsdp",),
                fsdp,
                f"2(n-1)/n · P = 2(n-1)/n · {human_bytes(fsdp * stored)}",
                value,
                value,
            )
        )
    elif fsdp > 1:
        calls, ideal_calls = 1.0, 1.0
        if s.stages > 1:  # each stage call gathers the layers of one local stage
            calls, ideal_calls = s.steps / s.repeats, float(s.microbatches)
        stored = sum(r.bytes_per_device for r in rows if "fsdp" in spec_axes(r.spec))
        unit_stored = sum(
            r.bytes_per_device for r in rows if "fsdp" in spec_axes(r.spec) and _is_unit(r.path)
        )
        # The units gather again in the backward pass; the arrays outside them
        # (embedding, head, final norm) keep their gathered copies or need none.
        other = stored - unit_stored
        per_pass = lambda c: (fsdp - 1) * (3 * unit_stored * c + 2 * other)  # noqa: E731
        terms.append(
            Term(
                "fsdp: gather, re-gather, reduce-scatter of split parameters",
                "all-gather/reduce-scatter",
                ("fsdp",),
                fsdp,
                f"(n-1)/n · (3 P_units + 2 P_rest) = (n-1)/n · (3 x {human_bytes(fsdp * unit_stored)} "
                f"+ 2 x {human_bytes(fsdp * other)})"
                + (f" x {calls:g} stage calls" if s.stages > 1 else ""),
                per_pass(calls),
                per_pass(ideal_calls),
            )
        )
    groups: dict[tuple[tuple[str, ...], bool], float] = {}
    for r in rows:
        for axes in _gradient_axes(r, s, roles.get(r.path, frozenset())):
            # ZeRO: reduce-scattered over dp (then summed over the rest), the updated
            # parameter all-gathered: the same ring bytes as the all-reduce.
            zero = "dp" in axes and _zero_splits(r, s)
            groups[axes, zero] = groups.get((axes, zero), 0.0) + r.bytes_per_device
    for (axes, zero), stored in groups.items():
        n = s.size(axes)
        value = 2 * _ring(n) * stored
        terms.append(
            Term(
                f"gradient reduce-scatter + parameter all-gather over {','.join(axes)} (zero)"
                if zero else f"gradient all-reduce over {','.join(axes)}",
                "reduce-scatter/all-gather" if zero else "all-reduce",
                axes,
                n,
                f"2(n-1)/n · {human_bytes(stored)}",
                value,
                value,
            )
        )
    return terms


def _tensor_terms(s: _Setting) -> list[Term]:
    if s.tp == 1:
        return []
    n, a = s.tp, s.activation
    ar = 2 * _ring(n)
    kind = "all-gather/reduce-scatter" if s.sequence_parallel else "all-reduce"
    per_block = [2 if m else 4 for m in s.blocks]
    total_blocks = sum(per_block)
    # With a pipeline, a device runs its L/S layers on micro-batches of A/M, T times.
    if s.stages > 1:
        scale = s.steps / (s.repeats * s.microbatches) / s.stages
        ideal_scale = 1.0 / s.stages
    else:
        scale = ideal_scale = 1.0
    table = _table(s)
    rerun = table is not None and table.split_backward
    if rerun:
        # ZB-H1's weight-gradient step differentiates the stage again to reach every
        # layer's weights: the backward's input-gradient all-reduces (half the block's)
        # run twice.
        scale *= 1.5
    terms = [
        Term(
            "tp: block all-reduces (2 forward, 2 backward per block; attention only in MoE blocks)",
            kind,
            ("tp",),
            n,
            f"{total_blocks} x 2(n-1)/n · A, A = {human_bytes(a)}"
            + (f", x T/(R M S) = {scale:g}" if s.stages > 1 and not rerun else "")
            + (f", x 3/(2 S) = {scale:g} (W re-runs the backward's)" if rerun else ""),
            total_blocks * ar * a * scale,
            total_blocks * ar * a * ideal_scale,
        ),
        # An explicit schedule runs the embedding on the first stage only (not the last
        # stage's device, whose collectives the report reads).
        *(
            []
            if s.explicit and s.stages > 1
            else [Term("tp: vocabulary-parallel embedding", kind, ("tp",), n, "2(n-1)/n · A", ar * a, ar * a)]
        ),
        Term("tp: output head (gradient of its input)", kind, ("tp",), n, "2(n-1)/n · A", ar * a, ar * a),
        Term(
            "tp: vocabulary-parallel cross-entropy (max, sum of exp, target)",
            "all-reduce",
            ("tp",),
            n,
            f"3 x 2(n-1)/n · {s.tokens} tokens x 4 B",
            3 * ar * s.tokens * F32,
            3 * ar * s.tokens * F32,
        ),
    ]
    return terms


def _context_terms(s: _Setting) -> list[Term]:
    """Ring or all-to-all attention over the context axis, forward and backward, every layer."""
    n, config = s.cp, s.config
    if n == 1 or s.context is None:
        return []
    tp, layers = s.tp, config.n_layers
    head_dim = config.d_model // config.n_heads
    n_kv = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    heads = config.n_heads // tp
    kv_heads = max(n_kv // tp, 1)
    rows = s.batch * s.seq // n  # query / key rows of one layer on a device: b · S/cp
    kv = rows * kv_heads * head_dim * F32  # K: one f32 key (or value) block
    pos = rows * F32  # its int32 positions
    axes = (s.context,)
    if s.context_impl == RING and s.stages > 1:
        # A device runs its L/(S R) layers T times per pass on micro-batches of K/M. With
        # n = 2 the ring is one shift: the positions row (the same for every layer and
        # step) travels once, and the last stage call's forward key/value sends serve its
        # backward's re-ring; with n > 2 the positions travel with the blocks backward.
        per = config.n_layers // (s.stages * s.repeats)
        calls = per * s.steps
        kv_m, pos_m = kv / s.microbatches, pos / s.microbatches
        one_shift = n == 2
        backward = (n - 1) * (2 * kv_m + (0 if one_shift else pos_m)) + n * 2 * kv_m
        merged = per * (n - 1) * 2 * kv_m if one_shift else 0.0
        value = float(calls * ((n - 1) * 2 * kv_m + backward) - merged + (n - 1) * pos_m)
        formula = (
            f"{calls} layer calls (L/(S R) x T) x ((n-1)·2K forward + "
            + ("(n-1)·2K + n·2K backward) - L/(S R) x (n-1)·2K (the last call's forward "
               "sends serve its backward)" if one_shift else "(n-1)(2K + P) + n·2K backward)")
            + f" + (n-1)P, K = {human_bytes(kv_m)}, P = {human_bytes(pos_m)} (per micro-batch)"
        )
        return [Term("cp: ring attention (key/value blocks; their gradients home)", "collective-permute", axes, n, formula, value, value)]
    if s.context_impl == RING:
        # Every layer reads the same positions: forward they travel the ring once.
        value = float(layers * ((n - 1) * 2 * kv + (n - 1) * (2 * kv + pos) + n * 2 * kv) + (n - 1) * pos)
        formula = (
            f"{layers} layers x ((n-1)·2K forward + (n-1)(2K + P) + n·2K backward) + "
            f"(n-1)P, K = {human_bytes(kv)}, P = {human_bytes(pos)}"
        )
        return [Term("cp: ring attention (key/value blocks; their gradients home)", "collective-permute", axes, n, formula, value, value)]
    wide = math.lcm(kv_heads, n)  # key/value heads repeated to split over the axis
    q = rows * heads * head_dim * F32
    kvw = rows * wide * head_dim * F32
    if s.stages > 1:
        # L/(S R) layers T times on micro-batches of Q/M, K/M: the same bytes as
        # L/(S R) · T/M layers on the whole local batch. The layers share one positions
        # row int32[S/cp], gathered once.
        pos = s.seq // n * F32
        calls = config.n_layers // (s.stages * s.repeats) * s.steps / s.microbatches
        value = float(calls * 2 * _ring(n) * (2 * q + 2 * kvw) + (n - 1) * pos)
        formula = (
            f"L/(S R) x T/M = {calls:g} layers x 2 x (n-1)/n (2Q + 2K) + (n-1)P, "
            f"Q = {human_bytes(q)}, K = {human_bytes(kvw)}, P = {human_bytes(pos)} "
            f"(the positions row, gathered once)"
        )
        return [Term("cp: all-to-all attention (q, k, v in; out back; forward and backward)", "all-to-all", axes, n, formula, value, value)]
    value = float(layers * 2 * _ring(n) * (2 * q + 2 * kvw) + (n - 1) * pos)
    formula = (
        f"{layers} layers x 2 x (n-1)/n (2Q + 2K) + (n-1)P, Q = {human_bytes(q)}, "
        f"K = {human_bytes(kvw)}, P = {human_bytes(pos)} (the positions, gathered once)"
    )
    return [Term("cp: all-to-all attention (q, k, v in; out back; forward and backward)", "all-to-all", axes, n, formula, value, value)]


def _expert_terms(s: _Setting) -> list[Term]:
    config = s.config
    moe_layers = sum(s.blocks)
    if not moe_layers:
        return []
    terms = []
    n_data = s.size(s.data_axes)
    if s.ep > 1:
        groups = s.tokens // config.moe_group_size
        capacity = expert_capacity(
            config.moe_group_size, config.top_k, config.num_experts, config.capacity_factor
        )
        buffer = groups * config.num_experts * capacity * config.d_model * F32
        value = expert_parallel_minimum(buffer, s.ep, moe_layers)
        terms.append(
            Term(
                "ep: dispatch and combine all-to-alls, forward and backward",
                "all-to-all",
                ("ep",),
                s.ep,
                f"{4 * moe_layers} x (n-1)/n · C, C = {groups}x{config.num_experts}x{capacity}"
                f"x{config.d_model} x 4 B = {human_bytes(buffer)}",
                value,
                value,
            )
        )
    if n_data > 1:
        stats = 2 * _ring(n_data) * (2 * config.num_experts + 2) * F32 * moe_layers
        terms.append(
            Term(
                "moe: routing statistics (2E + 2 numbers per MoE layer)",
                "all-reduce",
                s.data_axes,
                n_data,
                f"{moe_layers} x 2(n-1)/n · {2 * config.num_experts + 2} x 4 B",
                stats,
                stats,
            )
        )
    return terms


def _table(s: _Setting) -> Any:
    """The explicit schedule's table (`pipeline_schedule`), or `None`."""
    if not (s.explicit and s.schedule is not None and s.stages > 1):
        return None
    return pipeline_schedule(s.schedule, s.stages, s.microbatches, repeats=s.repeats)


def _pipeline_terms(s: _Setting) -> list[Term]:
    if s.stages == 1:
        return []
    split = s.tp if s.sequence_parallel else 1
    a = s.activation / split  # the stage input a device holds: [B/data, S(/tp), D]
    per_mb = a / s.microbatches
    sends = 2 * (s.steps - 1) * per_mb
    ideal = pipeline_minimum(a, s.microbatches, s.repeats)
    ar = 2 * _ring(s.stages)
    formula = f"2(T - 1) · A/M, T = R M + S - 1 = {s.steps}, A/M = {human_bytes(per_mb)}"
    table = _table(s)
    if table is not None:
        # A transfer runs on the steps where some device sends (every device of the
        # stage axis takes part in the collective-permute): counted from the table.
        weights = schedule_weights(table)
        count = round((weights["pipeline_send_forward"] + weights["pipeline_send_backward"]) * table.num_steps)
        sends = count * per_mb
        formula = f"(K_f + K_b) · A/M, K_f + K_b = {count} steps that send, A/M = {human_bytes(per_mb)}"
    terms = [
        Term("pp: stage activations, forward and backward", "collective-permute", ("pp",), s.stages, formula, sends, ideal),
    ]
    if not s.explicit:  # an explicit schedule's embedding runs on the first stage alone
        terms.append(
            Term(
                "pp: gradient of the pipeline input (embedding replicated over stages)",
                "all-reduce",
                ("pp",),
                s.stages,
                "2(n-1)/n · A",
                ar * a,
                ar * a,
            )
        )
    return [
        *terms,
        # The loss (the cross-entropy metric is the same number: XLA sends it once).
        Term("pp: loss from the last stage", "all-reduce", ("pp",), s.stages, "2(n-1)/n · 4 B", ar * 4, ar * 4),
    ]


def _scalar_terms(rows: Sequence[ParamRow], s: _Setting) -> list[Term]:
    terms = []
    n_data = s.size(s.data_axes)
    if n_data > 1:
        # The loss; with MoE also the cross-entropy metric (then a different number) and
        # the gradient of the (global) auxiliary loss added to the local cross-entropy.
        count = 3 if s.config.moe_every else 1
        value = 2 * _ring(n_data) * count * F32
        terms.append(
            Term("scalars: loss pmean", "all-reduce", s.data_axes, n_data, f"2(n-1)/n · {count} x 4 B", value, value)
        )
    groups: dict[tuple[str, ...], int] = {}
    for r in rows:
        axes = tuple(a for a in s.sizes if a in spec_axes(r.spec) and s.sizes[a] > 1)
        if axes:
            groups[axes] = groups.get(axes, 0) + 1
    for axes, count in groups.items():
        value = 2 * _ring(s.size(axes)) * count * F32
        terms.append(
            Term(
                "scalars: gradient-norm sums of split arrays",
                "all-reduce",
                axes,
                s.size(axes),
                f"2(n-1)/n · {count} x 4 B",
                value,
                value,
            )
        )
    # The non-finite guard over the update: each device checks its blocks, one int32
    # all-reduce over the axes some parameter is split over combines the verdicts.
    split = tuple(a for a in s.sizes if s.sizes[a] > 1 and any(a in spec_axes(r.spec) for r in rows))
    if split:
        value = 2 * _ring(s.size(split)) * F32
        terms.append(
            Term("scalars: non-finite update check", "all-reduce", split, s.size(split), "2(n-1)/n · 4 B", value, value)
        )
    return terms


def gpt_param_rows(
    config: GPTConfig, layout: Layout | Parallelism, num_devices: int | None = None
) -> list[ParamRow]:
    """The per-parameter table of the reference GPT under `layout`, from shapes alone.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the `Layout`, or one already resolved.
    - `num_devices`: the devices the layout fills (default: the layout's own size).

    **Returns:**

    `equishard.sharding.ParamRow`s (path, global shape, spec, bytes per device); nothing
    is allocated and no devices are needed.
    """
    resolved = resolve_layout(layout, num_devices)
    return _param_rows(_abstract_gpt(config, resolved), resolved.shape)


def _abstract_gpt(config: GPTConfig, layout: Parallelism) -> GPT:
    """The GPT under `layout` as shapes (no devices needed)."""
    with jax.sharding.use_abstract_mesh(AbstractMesh(layout.sizes, layout.axes)):
        return eqx.filter_eval_shape(lambda: GPT(config, layout, key=jax.random.key(0)))


def _param_rows(tree: Any, sizes: Mapping[str, int]) -> list[ParamRow]:
    """`equishard.param_table` for a mesh known only by its axis sizes."""
    return param_table(tree, AbstractMesh(tuple(sizes.values()), tuple(sizes)))


def _renamed(spec: P, names: Mapping[str, str]) -> P:
    """`spec` with its axes renamed by `names`."""

    def entry(e: Any) -> Any:
        if isinstance(e, tuple):
            return tuple(names.get(a, a) for a in e)
        return names.get(e, e) if isinstance(e, str) else e

    return P(*(entry(e) for e in spec))


def gpt_minimum(
    config: GPTConfig,
    layout: Layout | Parallelism,
    *,
    batch_size: int,
    seq_len: int,
    num_devices: int | None = None,
    rows: Sequence[ParamRow] | None = None,
) -> Minimum:
    """The bytes each device must send per train step of the reference GPT (float32).

    Every term of equishard's algorithm (see the module documentation): parameters
    (FSDP, gradient all-reduces), tensor, expert and pipeline parallelism, scalars.

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `layout`: the `Layout` (axes, sequence parallelism, micro-batches, repeats), or
      one already resolved.
    - `batch_size`: the global batch in sequences; `seq_len`: tokens per sequence.
    - `num_devices`: the devices the layout fills (default: the layout's own size).
    - `rows`: the per-parameter table, if already made (`gpt_param_rows`).

    **Returns:**

    A `Minimum`.
    """
    layout = resolve_layout(layout, num_devices)
    if layout.conventional() != layout:  # the user's axis names: computed in the conventional ones
        named = layout
        layout = layout.conventional()
        back = dict(zip(layout.axes, named.axes))  # conventional -> the user's name
        if rows is not None:
            rename = {v: k for k, v in back.items()}
            rows = [dataclasses.replace(r, spec=_renamed(r.spec, rename)) for r in rows]
        minimum = gpt_minimum(config, layout, batch_size=batch_size, seq_len=seq_len, rows=rows)
        terms = tuple(dataclasses.replace(t, axes=tuple(back.get(a, a) for a in t.axes)) for t in minimum.terms)
        return dataclasses.replace(minimum, terms=terms, description=minimum.description.replace(layout.spec, named.spec))
    s = _setting(config, layout, batch_size, seq_len)
    model = _abstract_gpt(config, layout)
    if rows is None:
        rows = _param_rows(model, layout.shape)
    terms = [
        *_parameter_terms(rows, s, _gradient_roles(model)),
        *_tensor_terms(s),
        *_context_terms(s),
        *_expert_terms(s),
        *_pipeline_terms(s),
        *_scalar_terms(rows, s),
    ]
    description = (
        f"GPT(d_model={config.d_model}, layers={config.n_layers}) on {layout.spec}, "
        f"batch {batch_size} x {seq_len} tokens"
    )
    return Minimum(tuple(t for t in terms if t.bytes or t.ideal_bytes), description)
