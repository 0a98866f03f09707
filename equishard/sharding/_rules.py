"""Path rules: specs for a model written without equishard (`eqx.nn.MLP`, a user's own).

An ordered list of `(pattern, PartitionSpec)` pairs, as MaxText's logical rules and
Haliax's axis mappings do it: the first pattern that matches an array's path
(`re.search` on a path like `layers[1].weight`) gives its spec; no match means
replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._errors import SpecError
from .._warn import warn
from ._box import Sharded, is_sharded
from ._specs import is_array_like, is_spec, path_str

Rules = Sequence[tuple[str, P]]


def _compile_rules(rules: Rules) -> list[tuple[re.Pattern[str], P]]:
    compiled = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise SpecError(f"rule {i} must be a (pattern, PartitionSpec) pair, got {rule!r}.")
        pattern, spec = rule
        if not is_spec(spec):
            raise SpecError(f"rule {i} ({pattern!r}) gives {spec!r}, not a PartitionSpec.")
        compiled.append((compile_pattern(pattern, f"rule {i}"), spec))
    return compiled


def compile_pattern(pattern: str, what: str) -> re.Pattern[str]:
    """`re.compile(pattern)`, or a `SpecError` that names `what` gave the pattern."""
    try:
        return re.compile(pattern)
    except re.error as err:
        raise SpecError(f"{what}: {pattern!r} is not a valid regular expression ({err}).") from None


def apply_rules(tree: PyTree, rules: Rules, *, strict: bool = False) -> PyTree:
    """Give every array of an unmodified model a spec by path rules.

    ```python
    mlp = eqx.nn.MLP(32, 4, 128, depth=3, key=key)
    mlp = equishard.apply_rules(mlp, [
        (r"layers\\[\\d+\\]\\.weight", P("tp", None)),
        (r"layers\\[\\d+\\]\\.bias", P("tp")),
    ])
    y = equishard.unbox(mlp)(x)      # call it as the plain model it is
    ```

    **Arguments:**

    - `tree`: any pytree of modules and arrays (boxed arrays get the new spec too).
    - `rules`: ordered `(regex, PartitionSpec)` pairs matched with `re.search` against
      each array's path; the first match wins; no match gives `P()` (replicated).
    - `strict`: raise, instead of warning, when a rule matches no array (a typo in a
      pattern would otherwise leave its arrays silently replicated).

    **Returns:**

    `tree` with every array in a `Sharded` box.

    **Raises:**

    `SpecError` naming the path and shape when a matched spec has more entries than
    the array has dimensions, when a rule is malformed, or (with `strict=True`) when a
    rule matches no array.
    """
    compiled = _compile_rules(rules)
    used = [False] * len(compiled)

    def give(path: Sequence[Any], leaf: Any) -> Any:
        value = leaf.value if is_sharded(leaf) else leaf
        if not is_array_like(value):
            return leaf
        name = path_str(path)
        spec = P()
        for i, (pattern, rule_spec) in enumerate(compiled):
            if pattern.search(name):
                used[i], spec = True, rule_spec
                break
        if len(spec) > value.ndim:
            raise SpecError(
                f"rule spec {spec} matched parameter `{name}` (shape {tuple(value.shape)}), "
                f"which has only {value.ndim} dimensions."
            )
        return Sharded(value, spec)

    out = jax.tree_util.tree_map_with_path(give, tree, is_leaf=is_sharded)
    unused = [pattern.pattern for (pattern, _), hit in zip(compiled, used) if not hit]
    if unused:
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]]
        message = (
            f"apply_rules: the rule(s) {unused} match no array path of {type(tree).__name__} "
            f"(paths look like {paths[:3]}); the arrays they were meant for stay replicated."
        )
        if strict:
            raise SpecError(message)
        warn(message)
    return out


def map_modules(tree: PyTree, fn: Callable[[str, Any, Callable[[Any], Any]], Any]) -> PyTree:
    """Rebuild `tree` module by module, outermost first, each module seen with its path.

    `fn(path, module, descend)` returns what replaces `module`; `descend(module)` is
    `module` with `fn` applied to each of its sub-modules (return it to leave the module
    as it is and look inside). Paths are written as `blocks[3].attention`; the root's is
    `""`. Used by the module-level plans (`fsdp_wrap`'s policy, `parallelize`'s plan).
    """

    def descend(node: Any, prefix: str) -> Any:
        children, treedef = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module)
        )
        if len(children) == 1 and children[0][1] is node:
            return node
        out = []
        for path, child in children:
            name = path_str(path)
            joined = name if not prefix else prefix + ("" if name.startswith("[") else ".") + name
            out.append(visit(child, joined) if isinstance(child, eqx.Module) else child)
        return jax.tree_util.tree_unflatten(treedef, out)

    def visit(node: Any, prefix: str) -> Any:
        return fn(prefix, node, lambda n: descend(n, prefix))

    return visit(tree, "")
