"""A train step's per-device memory by category, analytically (`MemoryEstimate`), and its
text beside the compiler's figures (`format_memory_estimate`).

`equishard.models.gpt_memory` derives the reference GPT's estimate from its shapes and a
layout (its module documentation gives every formula).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._text import fill, human_bytes

__all__ = ["MemoryEstimate", "format_memory_estimate"]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Analytical per-device memory of a train step, by category (see
    `equishard.models.gpt_memory`).

    **Fields:**

    - `parameters`, `optimizer_state`, `gradients`: bytes per device by their specs.
    - `remat`: the policy the step runs with.
    - `saved_activations`: for each remat policy, the bytes its layers keep for the
      backward pass beyond what `full` keeps (under FSDP the same for every policy).
    - `working_set`: the backward pass's other activations (layer inputs, one layer
      recomputed, the logits).
    - `update`: the new optimizer state built during the update.
    - `other_arguments`: the batch shard and the counters.
    """

    parameters: int
    optimizer_state: int
    gradients: int
    remat: str
    saved_activations: Mapping[str, int]
    working_set: int
    update: int
    other_arguments: int = 0

    @property
    def arguments(self) -> int:
        """What the step is given: parameters, optimizer state, batch and counters."""
        return self.parameters + self.optimizer_state + self.other_arguments

    @property
    def temporaries(self) -> int:
        """Gradients plus the larger of the backward pass's activations and the update."""
        backward = self.saved_activations[self.remat] + self.working_set
        return self.gradients + max(backward, self.update)

    @property
    def total(self) -> int:
        """Arguments plus temporaries: the peak per device."""
        return self.arguments + self.temporaries


def format_memory_estimate(
    estimate: MemoryEstimate,
    compiled_arguments: int | None = None,
    compiled_temporaries: int | None = None,
    width: int | None = None,
) -> str:
    """The estimate as text, beside the compiler's figures where given (`width`: the
    most columns a line takes, `None` for no limit)."""
    rows = [
        ("parameters", estimate.parameters),
        ("optimizer state", estimate.optimizer_state),
        ("gradients", estimate.gradients),
        (f"saved activations beyond 'full' (remat={estimate.remat})", estimate.saved_activations[estimate.remat]),
        ("backward working set (layer inputs, one layer recomputed, logits)", estimate.working_set),
        ("update (the new optimizer state)", estimate.update),
    ]
    name_width = max(len(name) for name, _ in rows)
    lines = ["Memory per device (analytical):"]
    lines += [f"{name:<{name_width}}  {human_bytes(value)}" for name, value in rows]
    others = ", ".join(
        f"{name} {human_bytes(value)}" for name, value in estimate.saved_activations.items()
    )
    lines.append(fill(f"saved activations by remat policy: {others}", width))
    lines.append(fill(
        f"arguments {human_bytes(estimate.arguments)}, temporaries {human_bytes(estimate.temporaries)}, "
        f"total {human_bytes(estimate.total)}"
        + (
            f"; compiled: arguments {human_bytes(compiled_arguments)}, temporaries "
            f"{human_bytes(compiled_temporaries)}, total "
            f"{human_bytes(compiled_arguments + compiled_temporaries)} "
            f"(ratio {(compiled_arguments + compiled_temporaries) / estimate.total:.3f})"
            if compiled_arguments is not None and compiled_temporaries is not None
            else ""
        ),
        width,
    ))  # fmt: skip
    return "\n".join(lines)
