"""The package's shape, read from its source with `ast` (nothing is imported or run).

- Imports point down the floors: a module imports only modules of lower floors or of its
  own package, and no import (at module level, in a function, or under `TYPE_CHECKING`)
  closes a cycle.
- Across packages, a module imports another package itself (its public names) or that
  package's `_internal` module, never one of its private modules: a package's private
  modules can then be split or renamed behind its `__init__` and `_internal`.
- No function body is longer than `MAX_LINES` lines, its docstring not counted.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "equishard"

# Bottom to top, in DESIGN.md's order ("The four floors"): `core` and `sharding` siblings
# over `_axes`, then `nn`, `report` (needs no training extras), `train`, `models` (the
# reference GPT, its training and its report) and the application with the command line
# on top. A module may import modules of lower floors and of its own package; packages on
# one floor are siblings and import neither each other nor anything above.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("_errors", "_names", "_text", "_version", "_warn"),
    ("_axes", "_compile", "_env"),
    ("core", "sharding", "distributed"),
    ("nn",),
    ("report",),
    ("train",),
    ("models", ""),  # "" is the package root, `equishard/__init__.py`
    ("_app", "_cli_base"),
    ("_cli_report", "_cli_text", "_launch"),
    ("_cli",),
    ("__main__",),
)
INTERNAL = "_internal"
MAX_LINES = 100
# Functions still longer than MAX_LINES, and why they are left so for now.
LONG_FUNCTIONS: dict[str, str] = {}  # none left


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package(module: str) -> str:
    """The top-level name a module belongs to (`"core"`, `"_cli"`, `""` for the root)."""
    return module.split(".")[0]


def _floor(module: str) -> int:
    top = _package(module)
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"equishard.{module} is on no floor: add it to FLOORS")


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Every module -> the equishard modules it names in an import statement."""
    modules = _modules()
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        here = [p for p in here if p]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.split(".")[0] == "equishard":
                    target = ".".join(node.module.split(".")[1:])
                else:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "equishard":
                        found.add(".".join(alias.name.split(".")[1:]))
        out[name] = found - {name}
    return out


def _edges() -> dict[str, set[str]]:
    """The import graph with the packages a cross-package import runs first."""
    edges = {m: set(ts) for m, ts in _imports().items()}
    for m, targets in _imports().items():
        for t in targets:
            if "." in t and _package(t) != _package(m):
                edges[m].add(_package(t))  # importing core._x runs core/__init__ first
    return edges


def test_no_import_cycle():
    edges = _edges()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_floors():
    up = [
        f"equishard.{m} (floor {_floor(m)}) imports equishard.{t} (floor {_floor(t)})"
        for m, targets in sorted(_imports().items())
        for t in sorted(targets)
        if _package(t) != _package(m) and _floor(t) >= _floor(m)
    ]
    assert not up, "imports that do not point down:\n" + "\n".join(up)


def test_no_private_import_across_packages():
    private = [
        f"equishard.{m} imports equishard.{t}"
        for m, targets in sorted(_imports().items())
        for t in sorted(targets)
        if _package(t) != _package(m)
        and len(t.split(".")) > 1
        and t.split(".")[-1].startswith("_")
        and t.split(".")[-1] != INTERNAL
    ]
    assert not private, (
        f"imports of another package's private module (import the package, or add the "
        f"name to its {INTERNAL} module):\n" + "\n".join(private)
    )


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    if not body:
        return 0
    return max(getattr(n, "end_lineno", 0) or 0 for n in ast.walk(fn)) - body[0].lineno + 1


def _functions() -> dict[str, int]:
    """`module.qualname` -> body lines, for every function and method in equishard/."""
    out: dict[str, int] = {}
    for module, path in _modules().items():

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}.{child.name}"
                    out[name] = _body_lines(child)
                    walk(child, name)
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}.{child.name}")
                else:
                    walk(child, prefix)

        walk(ast.parse(path.read_text(), str(path)), module)
    return out


def test_no_function_longer_than_100_lines():
    functions = _functions()
    long = {name: n for name, n in functions.items() if n > MAX_LINES and name not in LONG_FUNCTIONS}
    assert not long, f"functions whose body is longer than {MAX_LINES} lines: {long}"
    stale = [name for name in LONG_FUNCTIONS if functions.get(name, 0) <= MAX_LINES]
    assert not stale, f"listed as long but no longer (remove them from LONG_FUNCTIONS): {stale}"
