"""Analytical minima: the bytes each device must send per train step, by layout.

All figures are bytes **each device sends** in one train step under ring algorithms,
the convention of `equishard.report.read_collectives`, so a minimum and a measured figure
compare directly. `n` is the size of the axis (or product of axes) a collective runs
over; `(n − 1)/n` is a ring all-gather's or reduce-scatter's share, `2(n − 1)/n` an
all-reduce's (a reduce-scatter then an all-gather).

**The textbook minima** (one function each, below):

| parallelism | bytes each device sends per step |
|---|---|
| data parallel | `2(n−1)/n · P` (all-reduce of the gradients) |
| FSDP | `3(n−1)/n · P_sharded` (gather in forward, re-gather in backward, reduce-scatter of the gradients; `2(n−1)/n` without the re-gather) `+ 2(n−1)/n · P_replicated` |
| tensor parallel (Megatron) | `4 · 2(n−1)/n · A` per transformer block (2 all-reduces forward, 2 backward) |
| sequence parallel | the same bytes as all-gather / reduce-scatter pairs |
| expert parallel | `4 · (n−1)/n · C` per MoE layer (dispatch and combine, forward and backward) |
| pipeline | `2 · M · A/M` (one activation per micro-batch per stage boundary, forward and backward) |

`P` is the bytes of the parameters a device holds for the axis in question (for FSDP,
`P_sharded` is the whole array as the FSDP group sees it: `n` times the stored shard),
`A` the bytes of one block's activation `[tokens per data shard, d_model]`, `C` the
bytes of one MoE layer's capacity buffer `[groups, experts, capacity, d_model]` on a
device. Combinations sum the terms, each with its own `n`.

The reference GPT's minimum under a layout, term by term, is `equishard.models.gpt_minimum`
(its module documentation gives every formula).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .._text import human_bytes, text_table
from ..sharding import ParamRow

__all__ = [
    "Minimum",
    "Term",
    "data_parallel_minimum",
    "expert_parallel_minimum",
    "fsdp_minimum",
    "pipeline_minimum",
    "state_bytes",
    "tensor_parallel_minimum",
]


def ring_fraction(n: int) -> float:
    """`(n − 1)/n`: a ring all-gather's or reduce-scatter's share of the full array."""
    return (n - 1) / n if n > 1 else 0.0


# --------------------------------------------------------------------- textbook minima


def data_parallel_minimum(param_bytes: float | int, n: int) -> float:
    """Data parallel: the gradients' all-reduce, `2(n−1)/n · P`.

    **Arguments:**

    - `param_bytes`: `P`, the bytes of the parameters (each device holds them all).
    - `n`: the data-parallel axis size.

    **Returns:**

    Bytes each device sends per step.
    """
    return 2 * ring_fraction(n) * param_bytes


def fsdp_minimum(sharded_bytes: float | int, replicated_bytes: float | int, n: int, *, regather: bool = True) -> float:
    """FSDP: `3(n−1)/n · P_sharded` (`2(n−1)/n` without re-gather) `+ 2(n−1)/n · P_replicated`.

    **Arguments:**

    - `sharded_bytes`: `P_sharded`, the whole (gathered) bytes of the split arrays.
    - `replicated_bytes`: `P_replicated`, the bytes of the arrays left whole.
    - `n`: the FSDP axis size.
    - `regather`: the parameters are gathered again in the backward pass.

    **Returns:**

    Bytes each device sends per step.
    """
    passes = 3 if regather else 2
    return passes * ring_fraction(n) * sharded_bytes + 2 * ring_fraction(n) * replicated_bytes


def tensor_parallel_minimum(activation_bytes: float | int, n: int, blocks: int) -> float:
    """Megatron tensor parallelism: `4 · 2(n−1)/n · A` per transformer block.

    Two all-reduces forward (after the attention and the MLP), two backward (the
    gradients of their inputs). Sequence parallelism sends the same bytes as
    all-gather / reduce-scatter pairs. The embedding and cross-entropy terms are added
    by `gpt_minimum`.

    **Arguments:**

    - `activation_bytes`: `A`, one block's activation `[tokens per data shard, d_model]`.
    - `n`: the tensor-parallel axis size.
    - `blocks`: transformer blocks.

    **Returns:**

    Bytes each device sends per step.
    """
    return 4 * blocks * 2 * ring_fraction(n) * activation_bytes


def expert_parallel_minimum(buffer_bytes: float | int, n: int, layers: int) -> float:
    """Expert parallelism: `4 · (n−1)/n · C` per MoE layer.

    Dispatch and combine all-to-alls, forward and backward, of the capacity buffer.

    **Arguments:**

    - `buffer_bytes`: `C`, one MoE layer's capacity buffer on a device.
    - `n`: the expert axis size.
    - `layers`: MoE layers.

    **Returns:**

    Bytes each device sends per step.
    """
    return 4 * layers * ring_fraction(n) * buffer_bytes


def pipeline_minimum(activation_bytes: float | int, num_microbatches: int, repeats: int = 1) -> float:
    """Pipeline: one activation per micro-batch per stage boundary, forward and backward.

    A device sends each of its `M` micro-batch activations (`A/M` each) on once per
    local stage forward, and their gradients back: `2 · R · A`.

    **Arguments:**

    - `activation_bytes`: `A`, the activation of the local batch at a stage boundary.
    - `num_microbatches`: `M`.
    - `repeats`: local stages per device, `R` (circular schedules).

    **Returns:**

    Bytes each device sends per step.
    """
    return 2 * repeats * num_microbatches * activation_bytes / num_microbatches


# ------------------------------------------------------------------------ terms


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of an analytical minimum.

    **Fields:**

    - `name`: what is sent, e.g. `"fsdp: gather, re-gather, reduce-scatter"`.
    - `kind`: the collectives that send it (`"all-reduce"`, `"all-gather/reduce-scatter"`,
      `"all-to-all"`, `"collective-permute"`).
    - `axes`: the mesh axes it runs over; `n` their total size.
    - `formula`: the formula with its quantities, e.g. `"3(n-1)/n · 16.0 MiB"`.
    - `bytes`: bytes each device sends per step under equishard's algorithm.
    - `ideal_bytes`: the same without the pipeline bubble (the textbook figure).
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    n: int
    formula: str
    bytes: float
    ideal_bytes: float


@dataclasses.dataclass(frozen=True)
class Minimum:
    """An analytical minimum: its terms and their sums (see the module documentation).

    **Fields:**

    - `terms`: the `Term`s.
    - `description`: what it is the minimum of (model, layout, batch).
    """

    terms: tuple[Term, ...]
    description: str = ""

    @property
    def total(self) -> float:
        """Bytes each device sends per step under equishard's algorithm."""
        return float(sum(t.bytes for t in self.terms))

    @property
    def ideal_total(self) -> float:
        """The textbook total: no pipeline bubble."""
        return float(sum(t.ideal_bytes for t in self.terms))

    def by_axes(self) -> dict[tuple[str, ...], float]:
        """`bytes` summed per set of mesh axes."""
        out: dict[tuple[str, ...], float] = {}
        for t in self.terms:
            out[t.axes] = out.get(t.axes, 0.0) + t.bytes
        return out

    def __str__(self) -> str:
        return format_minimum(self)


def format_minimum(minimum: Minimum, width: int | None = None) -> str:
    """A plain-text table of a minimum's terms with its totals.

    **Arguments:**

    - `minimum`: a `Minimum`.
    - `width`: the most columns a line takes (`None`: no limit; see `text_table`).

    **Returns:**

    The table as a string.
    """
    header = ("term", "kind", "axes", "n", "formula", "bytes/device", "ideal")
    rows = [
        (t.name, t.kind, ",".join(t.axes), str(t.n), t.formula, human_bytes(t.bytes), human_bytes(t.ideal_bytes))
        for t in minimum.terms
    ]
    total = ("total", "", "", "", "", human_bytes(minimum.total), human_bytes(minimum.ideal_total))
    return text_table(header, rows, total, width=width)


def state_bytes(rows: Iterable[ParamRow]) -> int:
    """Bytes per device of a tree's arrays by their specs: the sum of `bytes_per_device`.

    **Arguments:**

    - `rows`: `ParamRow`s, e.g. `param_table(train_state, mesh)`.

    **Returns:**

    The total, an int.
    """
    return int(sum(r.bytes_per_device for r in rows))

