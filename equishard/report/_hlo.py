"""The HLO collective reader: which collectives a compiled program runs, and how many bytes.

`read_collectives` parses the *optimized* HLO text of a compiled program
(`compiled.as_text()`) and lists every collective it runs: its kind, the size of its
replica group, operand and result shapes, how many times it executes (trip counts of the
enclosing while loops multiplied) and the bytes each device sends per execution under
ring algorithms. The tests' structure assertions, the benchmarks and the reports all read
programs through it.

**What is read.**

- Kinds: `all-gather`, `reduce-scatter`, `all-reduce`, `all-to-all`,
  `collective-permute`, `ragged-all-to-all`. An asynchronous pair (`all-gather-start` /
  `all-gather-done`, `collective-permute-start` / `-done`, ...) counts as one op whose
  result is the `-done`'s; a collective wrapped in a generic `async-start` is found in the
  async computation it calls.
- Collectives in called computations (while bodies and conditions, conditional branches,
  calls, fusions, async computations) are found. A while loop multiplies what it contains
  by its trip count: `known_trip_count` from the loop's `backend_config`, or, when that is
  missing, the count inferred from the loop condition's compare of a counter against an
  integer constant (start and step from `known_init_step` when present, else 0 and 1).
  A loop whose count cannot be found counts once, with a warning. Every branch of a
  conditional counts as if it ran (an upper bound), unless `weights` says how often:
  a collective whose `op_name` metadata passes through a named scope in `weights`
  (the innermost such scope) counts `weights[scope]` times its loop's trips — e.g. an
  explicit pipeline schedule's branches (`equishard.core.schedule_weights`).
- Replica groups in every printed form: explicit (`replica_groups={{0,1},{2,3}}`), iota
  (`replica_groups=[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`), mesh axes
  (`replica_groups=mesh['a'=4,'b'=2] {'a'}`, sub-axes `'a':(1)2`), and empty (`{}`: all
  devices). A collective-permute has no replica groups: its group size is the number of
  devices in the largest ring (connected component) its `source_target_pairs` form, so a
  shift by one over an axis of size n has group size n.

**Bytes per device** (one execution, ring algorithms, n the group size; a tuple-shaped
op, such as a combined all-reduce of several arrays, sums over its operands):

| kind | bytes each device sends |
|---|---|
| all-gather | (n − 1)/n · the gathered result |
| reduce-scatter | (n − 1)/n · the unscattered operand |
| all-reduce | 2(n − 1)/n · the operand |
| all-to-all | (n − 1)/n · the operand |
| collective-permute | the operand |
| ragged-all-to-all | (n − 1)/n · the input operand (an upper bound: the real sizes are runtime values) |

**What XLA:CPU does to collectives** (observed on JAX 0.10.2 and 0.12.0.1 with
`shard_map` programs on 8 simulated devices; the reader reports what the compiled program
runs, so these show up in its output):

- Every bf16 collective (all-gather, reduce-scatter, all-reduce, all-to-all,
  collective-permute) is promoted to f32: a convert runs before it and its shapes and
  bytes are f32. f16 and integer collectives keep their type. A test that counts the bytes
  of a bf16 collective on the CPU must expect f32 sizes.
- An array all-to-all is rewritten to the tuple form: n slices in, n blocks out. Its total
  size, hence its bytes, is unchanged.
- Independent all-reduces over the same group are combined into one tuple-shaped
  all-reduce; `psum` of a tuple is one tuple all-reduce to begin with.
- Small all-reduces (down to a scalar) stay all-reduces; `shard_map`'s reduce-scatter
  stays a reduce-scatter. A program partitioned by GSPMD (a plain `jit` with shardings)
  may hold an all-reduce followed by a dynamic slice where a reduce-scatter would do.
- `ragged-all-to-all` does not compile on XLA:CPU at all ("not supported by XLA:CPU
  ThunkEmitter"), so only HLO text from other backends holds one.
- Collectives run synchronously: no `-start`/`-done` pairs appear on the CPU.
- Replica groups print explicitly (`{{0,1,...}}`) on JAX 0.10 and in mesh-axes form
  (`mesh['x'=8] {'x'}`) on JAX 0.12 for `shard_map` collectives; GSPMD-generated ones use
  the iota form (`[2,4]<=[8]`) on both, and JAX 0.10 already prints some in mesh-axes form.

**On XLA:GPU** (JAX 0.11.2, compiled for 8 H100s from a topology description): bf16
stays bf16, an all-to-all keeps its array form, a lone collective stays synchronous, and
one that can overlap with other work (a psum inside a scan) becomes an
`all-reduce-start` / `all-reduce-done` pair whose start returns `((operand), result)`.
The reader gives the same kinds, group sizes, counts and bytes there as on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._text import human_bytes, text_table
from .._warn import warn

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "collective_bytes",
    "collective_table",
    "count_collectives",
    "parse_replica_groups",
    "read_collectives",
]

Shape = tuple[str, tuple[int, ...]]
Groups = tuple[tuple[int, ...], ...]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)
"""The collective kinds `read_collectives` reports, in HLO's spelling."""


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program, as `read_collectives` finds it.

    **Fields:**

    - `kind`: one of `"all-gather"`, `"reduce-scatter"`, `"all-reduce"`, `"all-to-all"`,
        `"collective-permute"`, `"ragged-all-to-all"` (an async `-start`/`-done` pair is
        one op of its base kind).
    - `group_size`: the number of devices in each replica group; for a
        collective-permute, the number of devices in the largest ring its source-target
        pairs form.
    - `operand_shapes`: `(dtype, shape)` of each operand, e.g. `("f32", (8, 16))`.
    - `result_shapes`: `(dtype, shape)` of each result (of the `-done` for an async pair).
    - `count`: how many times the op runs per program execution: the product of the trip
        counts of the while loops around it.
    - `computation`: the name of the HLO computation it lives in.
    - `bytes_per_device`: the bytes each device sends in one execution under ring
        algorithms (see the module documentation).
    - `name`: the HLO instruction's name.
    - `replica_groups`: the device groups (partition indices) it runs over, as printed
        in any form (`None` for a collective-permute).
    - `source_target_pairs`: a collective-permute's `(source, target)` partition
        indices (`None` for the other kinds, or when the text has none).
    """

    kind: str
    group_size: int
    operand_shapes: tuple[Shape, ...]
    result_shapes: tuple[Shape, ...]
    count: int
    computation: str
    bytes_per_device: float
    name: str = ""
    replica_groups: Groups | None = None
    source_target_pairs: tuple[tuple[int, int], ...] | None = None

    @property
    def total_bytes(self) -> float:
        """`bytes_per_device × count`: the bytes each device sends for this op per program run."""
        return self.bytes_per_device * self.count

    def __str__(self) -> str:
        return (
            f"{self.kind} ×{self.count} (n={self.group_size}) "
            f"{format_shapes(self.operand_shapes)} -> {format_shapes(self.result_shapes)}: "
            f"{human_bytes(self.bytes_per_device)}/device each, "
            f"{human_bytes(self.total_bytes)} total, in {self.computation}"
        )


# ---------------------------------------------------------------------------- shapes


_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS = re.compile(r"[a-z]+(\d+)")


def _parse_shapes(text: str) -> tuple[Shape, ...]:
    """Every array shape in an HLO shape string (tuples flattened, layouts ignored)."""
    shapes = []
    for dtype, dims in _SHAPE.findall(text):
        # `<=8` is a bounded dynamic size (counted at its bound); `?` is unbounded (0).
        sizes = [d.strip().lstrip("<=") for d in dims.split(",") if d.strip()]
        shapes.append((dtype, tuple(int(d) if d.isdigit() else 0 for d in sizes)))
    return tuple(shapes)


def _dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (`f32` → 4, `bf16` → 2, `s4` → 0.5)."""
    if dtype == "pred":
        return 1.0
    match = _BITS.match(dtype)
    if match is None:  # token, opaque
        return 0.0
    return int(match.group(1)) / 8


def _nbytes(shapes: Iterable[Shape]) -> float:
    """Total bytes of a sequence of shapes."""
    return float(sum(_dtype_bytes(dtype) * math.prod(dims) for dtype, dims in shapes))


def format_shapes(shapes: Sequence[Shape], limit: int | None = None) -> str:
    """`f32[8,16]`, or `(f32[8], s32[])` for several; cut to `limit` characters."""
    parts = [f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in shapes]
    text = parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------- text structure


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    callees: list[tuple[str, str]]


@dataclasses.dataclass
class _Module:
    computations: dict[str, list[_Instr]]
    entry: str | None
    num_partitions: int
    replica_count: int


_COMMENT = re.compile(r"/\*.*?\*/")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_INSTR_HEAD = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_SINGLE_CALLEE = re.compile(
    r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_MULTI_CALLEE = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _depth(text: str) -> int:
    """Open brackets left unclosed at the end of `text` (quoted strings ignored)."""
    text = _QUOTED.sub("", text)
    return sum(text.count(c) for c in "({[") - sum(text.count(c) for c in ")}]")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, last = [], 0, 0
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[last:i].strip())
            last = i + 1
    tail = text[last:].strip()
    if tail:
        parts.append(tail)
    return parts


def _parse_callees(opcode: str, attrs: str) -> list[tuple[str, str]]:
    """`(attribute, computation)` for each computation an instruction calls."""
    if opcode.endswith("-done") or opcode == "async-update":
        return []  # the computation of its -start: counted there
    attrs = _QUOTED.sub('""', attrs)
    found = [(m.group(1), m.group(2)) for m in _SINGLE_CALLEE.finditer(attrs)]
    for m in _MULTI_CALLEE.finditer(attrs):
        found += [(m.group(1), c.strip().lstrip("%")) for c in m.group(2).split(",") if c.strip()]
    return found


def _parse_instr(line: str, computation: str) -> _Instr | None:
    """One instruction (a stripped logical line), or `None` when it is not one."""
    head = _INSTR_HEAD.match(line)
    if head is None:
        return None
    name, rest = head.group(1), head.group(2)
    if rest.startswith("("):
        end = _balanced_end(rest, 0)
    else:
        space = rest.find(" ")
        end = space if space >= 0 else len(rest)
    shape, rest = rest[:end], rest[end:]
    op = _OPCODE.match(rest)
    if op is None:
        return None
    open_at = op.end() - 1
    close_at = _balanced_end(rest, open_at)
    operands = [o.split()[-1].lstrip("%") for o in _split_top(rest[open_at + 1 : close_at - 1])]
    opcode, attrs = op.group(1), rest[close_at:]
    return _Instr(name, shape, opcode, operands, attrs, computation, _parse_callees(opcode, attrs))


def _logical_lines(text: str) -> list[str]:
    """Stripped lines, an instruction written over several lines joined into one."""
    lines, pending = [], ""
    for raw in _COMMENT.sub("", text).splitlines():
        line = raw.strip()
        if not line:
            continue
        if pending:
            pending += " " + line
            if _depth(pending) <= 0:
                lines.append(pending)
                pending = ""
        elif _INSTR_HEAD.match(line) and _depth(line) > 0:
            pending = line
        else:
            lines.append(line)
    if pending:
        lines.append(pending)
    return lines


def _parse_module(text: str) -> _Module:
    """Computations and their instructions, in text order.

    Reads what `compiled.as_text()` prints and hand-written HLO alike: names with or
    without `%`, indented or not, instructions over several lines.
    """
    partitions = re.search(r"\bnum_partitions=(\d+)", text)
    replicas = re.search(r"\breplica_count=(\d+)", text)
    computations: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in _logical_lines(text):
        if current is None:
            head = _COMP_HEAD.match(line)
            is_header = (
                head is not None
                and line.endswith("{")
                and not line.startswith("HloModule")
                and not _INSTR_HEAD.match(line)
            )
            if head is not None and is_header:
                current = head.group(2)
                computations[current] = []
                if head.group(1):
                    entry = current
            continue
        if line == "}":
            current = None
            continue
        instr = _parse_instr(line, current)
        if instr is not None:
            computations[current].append(instr)
    return _Module(
        computations,
        entry,
        int(partitions.group(1)) if partitions else 1,
        int(replicas.group(1)) if replicas else 1,
    )


# ------------------------------------------------------------------------ call graph


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_INIT_STEP = re.compile(
    r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"?(-?\d+)"?\s*,\s*"step"\s*:\s*"?(-?\d+)'
)
_INT_CONSTANT = re.compile(r"^[su]\d+\[\]")


def _reachable(module: _Module, root: str) -> list[str]:
    """Computations reachable from `root`, `root` included."""
    seen, stack = [root], [root]
    while stack:
        for instr in module.computations.get(stack.pop(), []):
            for _, callee in instr.callees:
                if callee in module.computations and callee not in seen:
                    seen.append(callee)
                    stack.append(callee)
    return seen


def _infer_trip_count(module: _Module, loop: _Instr, condition: str) -> int | None:
    """Trips of a counting loop `i < N` (or `<=`, `!=`), read from its condition."""
    compares, constants = [], []
    for name in _reachable(module, condition):
        for instr in module.computations[name]:
            if instr.opcode == "compare":
                direction = re.search(r"direction=(\w+)", instr.attrs)
                compares.append(direction.group(1) if direction else "")
            elif instr.opcode == "constant" and _INT_CONSTANT.match(instr.shape):
                try:
                    constants.append(int(instr.operands[0]))
                except (IndexError, ValueError):
                    return None
    if len(compares) != 1 or len(constants) != 1 or compares[0] not in ("LT", "LE", "NE", "GT", "GE"):
        return None
    init_step = _INIT_STEP.search(loop.attrs)
    init, step = (int(init_step.group(1)), int(init_step.group(2))) if init_step else (0, 1)
    if step <= 0:
        return None
    limit = constants[0] + (1 if compares[0] in ("LE", "GE") else 0)
    return max(0, -(-(limit - init) // step))


def _trip_count(module: _Module, loop: _Instr) -> int:
    """A while loop's trip count: known, inferred, or 1 with a warning."""
    known = _TRIP_COUNT.search(loop.attrs)
    if known:
        return int(known.group(1))
    condition = dict(loop.callees).get("condition")
    inferred = None if condition is None else _infer_trip_count(module, loop, condition)
    if inferred is None:
        warn(
            f"equishard.report.read_collectives: cannot determine the trip count of while "
            f"loop %{loop.name}; counting its collectives once.")
        return 1
    return inferred


def _multiplicities(module: _Module) -> dict[str, int]:
    """How many times each computation runs per program execution (0: never called)."""
    called = {c for instrs in module.computations.values() for i in instrs for _, c in i.callees}
    roots = [module.entry] if module.entry else [c for c in module.computations if c not in called]
    # Callers before callees: reversed depth-first post-order.
    order: list[str] = []
    visited: set[str] = set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            name, done = stack.pop()
            if done:
                order.append(name)
                continue
            if name in visited:
                continue
            visited.add(name)
            stack.append((name, True))
            for instr in module.computations[name]:
                for _, callee in instr.callees:
                    if callee in module.computations and callee not in visited:
                        stack.append((callee, False))
    mult = {name: 0 for name in module.computations}
    for root in roots:
        mult[root] = 1
    for name in reversed(order):
        if mult[name] == 0:
            continue
        for instr in module.computations[name]:
            trips = None
            for attribute, callee in instr.callees:
                if callee not in mult:
                    continue
                factor = 1
                if instr.opcode == "while" and attribute in ("body", "condition"):
                    trips = _trip_count(module, instr) if trips is None else trips
                    factor = trips
                mult[callee] += mult[name] * factor
    return mult


# -------------------------------------------------------------------- device groups


_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH = re.compile(  # device_ids=(...) may hold an iota with a transpose: ([4,2]T(1,0))
    r"(maximal_)?mesh\[([^\]]*)\](?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}"
)
_DEVICE_IOTA = re.compile(r"\[([\d,\s]+)\](?:<=\[([\d,\s]+)\])?(?:T\(([\d,\s]+)\))?")
_PAIR = re.compile(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """`[dims]<=... T(perm)`: `arange` reshaped to `dims`, transposed by `perm`, flattened."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm if perm else range(len(dims))).reshape(-1)


def _device_ids(text: str | None, total: int) -> np.ndarray | None:
    """The `device_ids=(...)` of a mesh-form group (explicit or iota), else `arange`."""
    if text is None:
        return np.arange(total)
    iota = _DEVICE_IOTA.fullmatch(text.strip())  # [8]<=[4,2]T(1,0) or [4,2]T(1,0)
    if iota:
        perm = _ints(iota.group(3)) if iota.group(3) else None
        ids = _iota(_ints(iota.group(2) or iota.group(1)), perm)
        return ids if ids.size == total else None
    ids = [int(t) for t in re.findall(r"\d+", text)]  # explicit, possibly nested lists
    return np.asarray(ids) if len(ids) == total else None


def _mesh_form_groups(axes_text: str, ids_text: str | None, group_text: str) -> Groups | None:
    """The groups of `mesh['a'=4,'b'=2] {'a'}` (sub-axes `'a':(k)m` included).

    The named axes are the HLO module's own (GSPMD prints `axis_0`, `axis_1`, ...), so
    the groups are worked out from the sizes, not from any mesh of the caller's.
    """
    names, sizes = [], []
    for item in _split_top(axes_text):
        name, _, size = item.partition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    factors = [[size] for size in sizes]  # each axis, split where a sub-axis says so
    chosen: list[tuple[int, int]] = []
    for item in _split_top(group_text):
        item = item.strip()
        sub = re.fullmatch(r"(.+?):\((\d+)\)(\d+)", item)
        name = (sub.group(1) if sub else item).strip().strip("'\"")
        axis = names.index(name) if name in names else int(name) if name.isdigit() else -1
        if axis < 0 or axis >= len(names):
            return None
        if sub is None:
            chosen.append((axis, 0))
            continue
        pre, size = int(sub.group(2)), int(sub.group(3))
        if len(factors[axis]) != 1 or sizes[axis] % (pre * size):
            return None
        factors[axis] = [pre, size, sizes[axis] // (pre * size)]
        chosen.append((axis, 1))
    ids = _device_ids(ids_text, math.prod(sizes))
    if ids is None:
        return None
    dims = [f for axis in factors for f in axis]
    offsets = np.cumsum([0] + [len(axis) for axis in factors])
    picked = [int(offsets[axis]) + k for axis, k in chosen]
    rest = [d for d in range(len(dims)) if d not in picked]
    grid = ids.reshape(dims).transpose(rest + picked)
    width = math.prod(dims[d] for d in picked)
    return tuple(tuple(int(i) for i in row) for row in grid.reshape(-1, width))


def parse_replica_groups(attrs: str, num_devices: int) -> Groups | None:
    """The device groups of a collective's `replica_groups` attribute, in any printed form.

    Explicit (`{{0,1},{2,3}}`), iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`), mesh axes
    (`mesh['a'=4,'b'=2] {'a'}`, sub-axes `'a':(1)2`, with or without `device_ids`),
    `maximal_mesh` (one device per group) and empty (`{}`: every device).

    **Arguments:**

    - `attrs`: the attribute text of the HLO instruction (after its operands).
    - `num_devices`: the devices an empty `{}` stands for.

    **Returns:**

    The groups (tuples of partition indices); `None` when the attribute is absent or
    unreadable.
    """
    at = attrs.find("replica_groups=")
    if at < 0:
        return None
    value = attrs[at + len("replica_groups=") :].lstrip()
    if value.startswith("{"):
        inner = value[: _balanced_end(value, 0)][1:-1]
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", inner))
        return groups or (tuple(range(num_devices)),)
    iota = _IOTA.match(value)
    if iota:
        shape = _ints(iota.group(1))
        perm = _ints(iota.group(3)) if iota.group(3) else None
        ids = _iota(_ints(iota.group(2)), perm).reshape(-1, shape[-1])
        return tuple(tuple(int(i) for i in row) for row in ids)
    mesh = _MESH.match(value)
    if mesh:
        if mesh.group(1):  # maximal_mesh: one device
            return tuple((i,) for i in range(num_devices))
        return _mesh_form_groups(mesh.group(2), mesh.group(3), mesh.group(4))
    return None


def _all_devices(module: _Module, instr: _Instr) -> int:
    """The devices of a collective without replica groups (or with empty ones)."""
    if "use_global_device_ids=true" in instr.attrs:
        return module.num_partitions * module.replica_count
    if "channel_id=" in instr.attrs:
        return module.num_partitions
    return module.replica_count


def _replica_groups(module: _Module, instr: _Instr) -> Groups:
    """A collective's device groups: as printed, or every device when none are printed."""
    everyone = _all_devices(module, instr)
    if "replica_groups=" not in instr.attrs:
        return (tuple(range(everyone)),)
    groups = parse_replica_groups(instr.attrs, everyone)
    if groups is None:
        at = instr.attrs.find("replica_groups=")
        raise ValueError(
            f"unrecognised replica_groups in HLO instruction %{instr.name}: "
            f"{instr.attrs[at + len('replica_groups=') :][:80]!r}"
        )
    return groups


def _source_target_pairs(instr: _Instr) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's `(source, target)` pairs (`None` when not printed)."""
    at = instr.attrs.find("source_target_pairs=")
    if at < 0:
        return None
    value = instr.attrs[at + len("source_target_pairs=") :]
    return tuple((int(a), int(b)) for a, b in _PAIR.findall(value[: _balanced_end(value, 0)]))


def _ring_size(pairs: Sequence[tuple[int, int]] | None) -> int:
    """Devices in the largest connected component of a permute's pairs."""
    if not pairs:
        return 1
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    components: dict[int, int] = {}
    for device in list(parent):
        root = find(device)
        components[root] = components.get(root, 0) + 1
    return max(components.values(), default=1)


# ---------------------------------------------------------------------------- reading


def _kind(opcode: str) -> str | None:
    """The collective kind of an opcode (`-start` folded in), or `None`."""
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVE_KINDS else None


def _bytes_per_device(kind: str, n: int, operands: Sequence[Shape], results: Sequence[Shape]) -> float:
    """Bytes each device sends in one execution under ring algorithms."""
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if kind == "all-gather":
        return ring * _nbytes(results)
    if kind == "reduce-scatter":
        return ring * _nbytes(operands)
    if kind == "all-reduce":
        return 2 * ring * _nbytes(operands)
    if kind == "all-to-all":
        return ring * _nbytes(operands)
    if kind == "collective-permute":
        return _nbytes(operands[: max(1, len(results))])
    if kind == "ragged-all-to-all":
        return ring * _nbytes(operands[:1])
    raise AssertionError(kind)


def _start_results(shape: str, kind: str) -> tuple[Shape, ...]:
    """Results of an async `-start` whose `-done` is not in the text.

    A start's tuple holds its operands, then its results (then, for a
    collective-permute, scratch `u32[]`s). Operands are a nested tuple in newer
    printings (`((f32[8]), f32[8]) all-reduce-start`); a plain all-reduce-start is
    shaped like its result.
    """
    parts = _split_top(shape[1:-1]) if shape.startswith("(") else [shape]
    if len(parts) >= 2 and parts[0].startswith("("):
        rest = parts[1:2] if kind == "collective-permute" else parts[1:]
        return tuple(s for part in rest for s in _parse_shapes(part))
    shapes = _parse_shapes(shape)
    if kind == "collective-permute" and len(shapes) >= 2:
        return shapes[1:2]
    if kind != "all-reduce" and len(shapes) >= 2 and len(shapes) % 2 == 0:
        return shapes[len(shapes) // 2 :]
    return shapes


def compiled_program(program: Any) -> Any:
    """JAX's `Compiled` for a `Compiled`, a `Lowered` (compiled here) or Equinox's wrappers.

    `eqx.filter_jit(f).lower(...)` / `.compile()` wrap JAX's `Lowered` / `Compiled`.
    """
    for attr in ("compiled", "lowered"):
        inner = getattr(program, attr, None)
        if isinstance(inner, (jax.stages.Compiled, jax.stages.Lowered)):
            program = inner
    if isinstance(program, jax.stages.Lowered):
        program = program.compile()
    return program


def _program_text(program: Any) -> str:
    if isinstance(program, str):
        return program
    text = compiled_program(program).as_text()
    if not isinstance(text, str):
        raise ValueError("the compiled program has no HLO text to read")
    return text


def _weight(attrs: str, weights: Mapping[str, float] | None) -> float:
    """The weight of the innermost scope of `weights` on an instruction's `op_name`."""
    if not weights:
        return 1.0
    found = _OP_NAME.search(attrs)
    if found is None:
        return 1.0
    for part in reversed(found.group(1).split("/")):
        if part in weights:
            return float(weights[part])
    return 1.0


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def read_collectives(program: Any, *, weights: Mapping[str, float] | None = None) -> list[CollectiveOp]:
    """List the collectives a compiled program runs.

    Reads the optimized HLO (`compiled.as_text()`): what XLA actually runs after its
    rewrites (see the module documentation for what XLA:CPU changes).

    ```python
    f = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    ops = read_collectives(f.lower(x).compile())
    assert count_collectives(ops) == {"collective-permute": 7}
    ```

    **Arguments:**

    - `program`: a `jax.stages.Compiled`, a `jax.stages.Lowered` (compiled here), what
        `eqx.filter_jit(f).lower(...)` / `.compile()` return, or the HLO text of a module.
    - `weights`: optional `{named scope: runs per loop trip}` for collectives in
        conditional branches (see the module documentation), e.g.
        `equishard.core.schedule_weights(schedule)`.

    **Returns:**

    A list of `CollectiveOp`, one per collective instruction (an async pair is one), in
    the order of the text.
    """
    module = _parse_module(_program_text(program))
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    dones = {
        i.operands[0]: i
        for instrs in module.computations.values()
        for i in instrs
        if i.opcode.endswith("-done") and i.operands
    }
    mult = _multiplicities(module)
    ops = []
    for comp, instrs in module.computations.items():
        if mult[comp] == 0:
            continue
        for instr in instrs:
            kind = _kind(instr.opcode)
            if kind is None:
                continue
            operand_shapes = tuple(s for o in instr.operands for s in _parse_shapes(shapes.get(o, "")))
            result_shapes = _parse_shapes(instr.shape)
            if instr.opcode.endswith("-start"):
                done = dones.get(instr.name)
                if done is not None:
                    result_shapes = _parse_shapes(done.shape)
                else:
                    result_shapes = _start_results(instr.shape, kind)
            groups, pairs = None, None
            if kind == "collective-permute":
                pairs = _source_target_pairs(instr)
                n = _ring_size(pairs)
            else:
                groups = _replica_groups(module, instr)
                n = max(len(g) for g in groups)
            ops.append(
                CollectiveOp(
                    kind=kind,
                    group_size=n,
                    operand_shapes=operand_shapes,
                    result_shapes=result_shapes,
                    count=round(mult[comp] * _weight(instr.attrs, weights)),
                    computation=comp,
                    bytes_per_device=_bytes_per_device(kind, n, operand_shapes, result_shapes),
                    name=instr.name,
                    replica_groups=groups,
                    source_target_pairs=pairs,
                )
            )
    return ops


def collective_bytes(ops: Iterable[CollectiveOp], kinds: str | Iterable[str] | None = None) -> float:
    """Bytes each device sends over a program run: the sum of `op.total_bytes`.

    **Arguments:**

    - `ops`: collectives from `read_collectives`.
    - `kinds`: a kind or kinds to count (e.g. `"all-gather"`); all when `None`.

    **Returns:**

    The total bytes per device, a float.
    """
    if isinstance(kinds, str):
        kinds = (kinds,)
    wanted = None if kinds is None else set(kinds)
    return float(sum(op.total_bytes for op in ops if wanted is None or op.kind in wanted))


def count_collectives(ops: Iterable[CollectiveOp]) -> dict[str, int]:
    """How many times each kind of collective runs per program execution.

    **Arguments:**

    - `ops`: collectives from `read_collectives`.

    **Returns:**

    A dict from kind to executions (each op weighted by its `count`); kinds that do not
    occur are absent.
    """
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.kind] = counts.get(op.kind, 0) + op.count
    return counts


def collective_table(ops: Iterable[CollectiveOp]) -> str:
    """A plain-text table of collectives for reports, one row per op and a total.

    **Arguments:**

    - `ops`: collectives from `read_collectives`.

    **Returns:**

    The table as a string (columns: kind, group size, count, operands, results, bytes per
    device per execution, total bytes per device, computation).
    """
    ops = list(ops)
    header = ("kind", "n", "count", "operands", "results", "bytes/device", "total", "computation")
    rows = [
        (
            op.kind,
            str(op.group_size),
            str(op.count),
            format_shapes(op.operand_shapes),
            format_shapes(op.result_shapes),
            human_bytes(op.bytes_per_device),
            human_bytes(op.total_bytes),
            op.computation,
        )
        for op in ops
    ]
    executions = sum(op.count for op in ops)
    total = ("total", "", str(executions), "", "", "", human_bytes(collective_bytes(ops)), "")
    return text_table(header, rows, total)
