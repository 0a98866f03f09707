"""The reference GPT's train step compiled from shapes alone, and its report: the measured
collectives and memory beside the analytical minimum and estimate (`gpt_report`).
"""

from __future__ import annotations

import math
import time

from .._names import differentiated_scan
from ..core import pipeline_schedule, schedule_weights
from ..report import StepReport, report, state_bytes
from ..sharding import param_table
from ._memory import gpt_memory
from ._minimum import gpt_minimum
from ._training import AbstractStep

__all__ = ["gpt_report"]


def gpt_report(
    step: AbstractStep, *, name: str | None = None, optimizer_name: str | None = None
) -> tuple[StepReport, dict[str, float]]:
    """Compile the reference GPT's train step and report on it.

    **Arguments:**

    - `step`: the step, lowered from shapes (`abstract_train_step(config, layout, ...)`:
      the model, the layout, the batch, the optimizer and the precision in one value).
    - `name`, `optimizer_name`: the model's and the optimizer's names for the
      description line.

    **Returns:**

    `(report, facts)`: the `StepReport` (collectives, memory, parameter table, the
    analytical minimum), and a dict with `lower_seconds`, `compile_seconds`,
    `state_bytes` (parameters and optimizer state per device by their specs: the
    analytical figure to set beside the compiler's argument bytes) and `parameters`.
    """
    config, batch_size, seq_len = step.config, step.batch_size, step.seq_len
    start = time.perf_counter()
    compiled = step.lowered.compile()
    compile_seconds = time.perf_counter() - start
    rows = param_table(step.state.model, step.mesh)
    minimum = gpt_minimum(config, step.layout, batch_size=batch_size, seq_len=seq_len, rows=rows)
    parameters = sum(math.prod(r.shape) for r in rows)
    description = (
        f"{name or 'GPT'}: {parameters / 1e6:,.1f} M parameters"
        + (f" ({parameters / 1e9:.2f} B)" if parameters >= 1e9 else "")
        + f" (d_model {config.d_model}, "
        f"{config.n_layers} layers, {config.n_heads} heads"
        + (f" ({config.n_kv_heads} key/value)" if config.n_kv_heads not in (None, config.n_heads) else "")
        + f", d_ff {config.d_ff}, vocabulary "
        f"{config.vocab_size}); layout {step.layout.spec} on {step.mesh.devices.size} "
        f"{step.mesh.devices.flat[0].platform.upper()} devices; batch {batch_size} x "
        f"{seq_len} tokens; {step.compute_dtype.name} compute, {step.param_dtype.name} "
        f"parameters"
    ) + (f"; {optimizer_name}" if optimizer_name else "")
    par = step.layout
    weights = None
    schedule = par.pipeline_schedule
    if par.pipeline and schedule is not None and not differentiated_scan(schedule):
        # An explicit schedule's branches run as its table says (the last stage's device).
        table = pipeline_schedule(schedule, par.num_stages, par.num_microbatches, repeats=par.pipeline_repeats)
        weights = schedule_weights(table)
        description += f"; {schedule} schedule, collectives of the last stage's device"
    batch_bytes = batch_size // par.data_parallel_size * (seq_len + 1) * 4
    estimate = gpt_memory(
        config, par, batch_size=batch_size, seq_len=seq_len, params=rows,
        optimizer_state=param_table(step.state.opt_state, step.mesh),
        other_arguments=batch_bytes + 3 * 4 + 8,
    )  # fmt: skip
    r = report(
        compiled, mesh=step.mesh, params=rows, minimum=minimum, description=description,
        weights=weights, estimate=estimate,
    )  # fmt: skip
    facts = {
        "lower_seconds": step.lower_seconds,
        "compile_seconds": compile_seconds,
        "state_bytes": float(state_bytes(param_table((step.state.model, step.state.opt_state), step.mesh))),
        "parameters": float(parameters),
    }
    return r, facts
