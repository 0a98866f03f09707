"""Run a traced call once, keeping its collectives' outputs; differentiate it later from them.

The regathering FSDP unit (`_fsdp._call_regathering`) needs, from its forward pass, only
its operands and the outputs of its collectives over other axes; its backward pass
recomputes the rest and differentiates it. `jax.checkpoint` under `jax.vjp` gives that,
but at a price in tracing: the forward linearises the checkpointed call (its JVP and
the policy's partial evaluation), and the backward transposes it (tracing the recomputation
and the transpose into a new jaxpr). Here the forward only runs the call's jaxpr, keeping
the collectives' outputs (`run`: while a jaxpr is being staged, its equations are copied
into it as they are), and the backward differentiates the same jaxpr
with each kept collective replaced by its output (`replay`): the recomputation sends
nothing again, and the collective's tangent (itself applied to its operands' tangents)
still carries the gradient through it. The computation is that of the checkpoint: the
same residuals, the same recomputation, the same transposes.

Only the collectives at the jaxpr's top level, and only the linear ones, are replayed;
`replayable` says whether a jaxpr has no other collective to keep (one inside a nested
jaxpr, a `pmax`), where the caller uses the checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax._src import core, source_info_util
from jax._src.ad_checkpoint import name_p
from jax._src.interpreters import partial_eval as pe
from jax.custom_derivatives import SymbolicZero

from ._remat import COLLECTIVES, _collective_axes

# The collectives that are linear: the tangent of the output is the collective applied to
# the tangents of the operands, so a kept output can be replayed under differentiation.
_LINEAR = frozenset(
    {"psum", "psum_invariant", "all_gather", "all_gather_invariant", "reduce_scatter", "ppermute", "all_to_all"}
)


def _kept(eqn: core.JaxprEqn, axis_name: str) -> bool:
    # As `save_collectives_except(axis_name)`: a collective not over `axis_name`.
    return eqn.primitive.name in COLLECTIVES and axis_name not in _collective_axes(eqn.params)


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zeros(aval: Any) -> Any:
    return jnp.zeros(aval.shape, aval.dtype)


def _has_kept(jaxpr: core.Jaxpr, axis_name: str) -> bool:
    return any(
        _kept(eqn, axis_name) or any(_has_kept(sub, axis_name) for sub in core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def replayable(jaxpr: core.Jaxpr, axis_name: str) -> bool:
    """Whether every collective of `jaxpr` not over `axis_name` is a linear one at its top
    level, of floating operands or of none (`run` keeps them all, `replay` replays them
    all)."""
    for eqn in jaxpr.eqns:
        if _kept(eqn, axis_name) and (
            eqn.primitive.name not in _LINEAR
            or len({_inexact(v.aval) for v in eqn.invars}) > 1
        ):
            return False
        if any(_has_kept(sub, axis_name) for sub in core.jaxprs_in_params(eqn.params)):
            return False
    return True


def unnamed(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    """`closed` without its `checkpoint_name` marks and its dead equations (the same
    inputs and outputs).

    A name only tells a `jax.checkpoint` policy what to save. Inside custom rules that
    no policy sees into (`scan_units`'), it is an identity that each pass over the jaxpr
    (its run, the backward's linearisation and transpose, the lowering) would handle
    again; so is an equation whose result nothing reads (an axis probe's `axis_index`).
    """
    jaxpr = closed.jaxpr
    alias: dict[core.Var, Any] = {}

    def read(v: Any) -> Any:
        return alias.get(v, v) if isinstance(v, core.Var) else v

    eqns = []
    for eqn in jaxpr.eqns:
        invars = [read(v) for v in eqn.invars]
        if eqn.primitive is name_p:
            alias[eqn.outvars[0]] = invars[0]
        else:
            eqns.append(eqn.replace(invars=invars))
    outvars = [read(v) for v in jaxpr.outvars]
    jaxpr, _ = pe.dce_jaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), [True] * len(outvars), instantiate=True)
    # Newer JAX has no `ClosedJaxpr`: a jaxpr holds its constants (and is its own `.jaxpr`).
    return cast("core.ClosedJaxpr", jaxpr) if closed.jaxpr is closed else closed.replace(jaxpr=jaxpr)


def _replayed(eqn: core.JaxprEqn, params: dict[str, Any]) -> Callable[..., Any]:
    """`f(outputs, *operands) -> outputs`, whose tangent is `eqn`'s collective of the
    operands' tangents: the collective's output, kept, under differentiation."""

    @jax.custom_jvp
    def replayed(outputs: Any, *operands: Any) -> Any:
        del operands
        return outputs

    @partial(replayed.defjvp, symbolic_zeros=True)
    def _jvp(primals: Any, tangents: Any) -> Any:
        outputs, *_ = primals
        _, *dx = tangents
        many = eqn.primitive.multiple_results
        if all(isinstance(t, SymbolicZero) for t in dx):
            # Operands that do not depend on what is differentiated: a zero tangent, and
            # nothing sent (as the checkpoint's symbolic zero would send nothing).
            zeros = [SymbolicZero(core.typeof(o).to_tangent_aval()) for o in (outputs if many else [outputs])]
            return outputs, zeros if many else zeros[0]
        dx = [_zeros(t.aval) if isinstance(t, SymbolicZero) else t for t in dx]
        # A linear collective: its tangent is itself applied to the tangents.
        return outputs, eqn.primitive.bind(*dx, **params)

    return replayed


def _evaluate(closed: core.ClosedJaxpr, args: Sequence[Any], axis_name: str, kept: list[Any] | None) -> tuple[list[Any], list[Any]]:
    # `core.eval_jaxpr`, except at the kept collectives: bound and their outputs kept
    # (`kept` None), or replaced by the kept outputs.
    jaxpr = closed.jaxpr
    env: dict[core.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*closed.consts, *args]):
        env[v] = x
    outputs: list[Any] = []
    replays = iter(kept) if kept is not None else None
    for eqn in jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        operands = [read(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            if replays is not None and _kept(eqn, axis_name):
                out = next(replays)
                if any(jnp.issubdtype(x.dtype, jnp.inexact) for x in operands):
                    out = _replayed(eqn, params)(out, *operands)
            else:
                out = eqn.primitive.bind(*operands, **params)
                if replays is None and _kept(eqn, axis_name):
                    outputs.append(out)
        for v, x in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
            env[v] = x
    return [read(v) for v in jaxpr.outvars], outputs


def _with_kept_outputs(jaxpr: core.Jaxpr, axis_name: str) -> tuple[core.Jaxpr, list[int]]:
    """`jaxpr` also returning the outputs of its kept collectives, and how many each
    collective has (0: a single result)."""
    kept = [eqn for eqn in jaxpr.eqns if _kept(eqn, axis_name)]
    extra = [v for eqn in kept for v in eqn.outvars]
    counts = [len(eqn.outvars) if eqn.primitive.multiple_results else 0 for eqn in kept]
    return jaxpr.replace(outvars=[*jaxpr.outvars, *extra]), counts


def _inline(
    trace: pe.DynamicJaxprTrace, closed: core.ClosedJaxpr, args: Sequence[Any], axis_name: str
) -> tuple[list[Any], list[Any]]:
    # `run` while staging a jaxpr: the traced equations are copied into it as they are
    # (as `jax.jit(..., inline=True)` inlines its trace), with no shape rule run again.
    jaxpr, counts = _with_kept_outputs(closed.jaxpr, axis_name)
    src = source_info_util.current()
    # The constants as leading inputs: one may be a value of this very trace (a call
    # that closed over it), which only an input can carry.
    tracers = [trace.to_jaxpr_tracer(x, src) for x in [*closed.consts, *args]]
    outs = pe.inline_jaxpr_into_trace(trace, src, pe.convert_constvars_jaxpr(jaxpr), (), *tracers)
    flat_out, rest = outs[: len(closed.jaxpr.outvars)], outs[len(closed.jaxpr.outvars) :]
    kept = []
    for count in counts:
        kept.append(rest[0] if count == 0 else rest[:count])
        rest = rest[max(count, 1) :]
    return flat_out, kept


def run(closed: core.ClosedJaxpr, args: Sequence[Any], axis_name: str) -> tuple[list[Any], list[Any]]:
    """Evaluate `closed` on `args`: its outputs, and the outputs of its collectives not
    over `axis_name` (for `replay`)."""
    trace = core.trace_ctx.trace
    if isinstance(trace, pe.DynamicJaxprTrace):
        return _inline(trace, closed, args, axis_name)
    return _evaluate(closed, args, axis_name, None)


def replay(closed: core.ClosedJaxpr, args: Sequence[Any], axis_name: str, kept: list[Any]) -> list[Any]:
    """Evaluate `closed` on `args` with its collectives not over `axis_name` replaced by
    `kept` (`run`'s): nothing is sent again, and differentiating it differentiates them."""
    return _evaluate(closed, args, axis_name, kept)[0]
