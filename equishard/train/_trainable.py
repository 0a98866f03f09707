"""The trainable filter: which arrays of a model the train step differentiates and optimizes.

A `Trainable` is one of the step's parts (`make_train_step(..., trainable=...)`), held by
the `TrainStep` as a field. It resolves, against a model, into a `TrainableMask`: one flag
per leaf of the model (a `Sharded` box one leaf, frozen or trained whole), in the order
`jax.tree.leaves(model, is_leaf=is_sharded)` gives them. A mask is layout-blind: `ZeRO1`'s view and the precision policy's casts keep
a model's leaves in order, so one mask splits the model, its gradients and the view
the update reads alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._errors import LayerConfigError
from ..sharding import is_array_like, is_sharded, path_str

PathFilter = Callable[[str, Any], bool]


class TrainableMask(eqx.Module):
    """A trainable set resolved against one model: a flag per leaf (hashable, static).

    **Fields:**

    - `flags`: `True` for a trainable array, one per leaf of the model in
      `jax.tree.leaves` order (a box one leaf).
    - `paths`: each leaf's path (`equishard.sharding.path_str`; a box's array by the
      box's path), for messages.
    """

    flags: tuple[bool, ...] = eqx.field(static=True)
    paths: tuple[str, ...] = eqx.field(static=True)

    def split(self, tree: PyTree) -> tuple[PyTree, PyTree]:
        """`(trainable, frozen)`: `tree` (of the model's leaves, in order) with `None` in
        place of the other part's leaves (a whole box), as `eqx.partition` returns."""
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
        if len(leaves) != len(self.flags):
            raise LayerConfigError(
                f"the trainable set was resolved for a model of {len(self.flags)} leaves and "
                f"is applied to a tree of {len(leaves)}; resolve it against this model."
            )
        trained = [x if f else None for x, f in zip(leaves, self.flags)]
        frozen = [None if f else x for x, f in zip(leaves, self.flags)]
        return jax.tree.unflatten(treedef, trained), jax.tree.unflatten(treedef, frozen)

    def trained(self, tree: PyTree) -> PyTree:
        """The trainable part of `tree` (`None` elsewhere)."""
        return self.split(tree)[0]

    def frozen_paths(self) -> list[str]:
        """The paths of the frozen arrays (the leaves that are not trained, arrays only)."""
        return [p for f, p in zip(self.flags, self.paths) if not f and p]


def _is_unit(x: Any) -> bool:
    return x is None or is_sharded(x)


def merge(trained: PyTree, frozen: PyTree) -> PyTree:
    """The model again from `TrainableMask.split`'s two parts (of one structure, each
    with `None` where the other has a leaf or a box)."""
    a, treedef = jax.tree.flatten(trained, is_leaf=_is_unit)
    b = jax.tree.leaves(frozen, is_leaf=_is_unit)
    return jax.tree.unflatten(treedef, [y if x is None else x for x, y in zip(a, b, strict=True)])


def _leaves_with_paths(model: PyTree) -> list[tuple[str, Any]]:
    """`(path, value)` per leaf of `model` in `jax.tree.leaves` order, a box one leaf
    (its array named by the box's path). Non-array leaves get the path `""`."""
    out: list[tuple[str, Any]] = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(model, is_leaf=is_sharded):
        if is_sharded(leaf):
            out.append((path_str(path), leaf.value))
        else:
            out.append((path_str(path) if is_array_like(leaf) else "", leaf))
    return out


def _mismatch(spec: PyTree, model: PyTree) -> str:
    """The first path where `spec` is not a prefix of `model`'s structure."""
    model_paths = [k for k, _ in jax.tree_util.tree_leaves_with_path(model)]
    spec_paths = [k for k, _ in jax.tree_util.tree_leaves_with_path(spec, is_leaf=_is_flag)]
    for s in spec_paths:
        if not any(m[: len(s)] == s for m in model_paths):
            return f"the filter has `{path_str(s)}`, which the model lacks"
    for m in model_paths:
        if not any(m[: len(s)] == s for s in spec_paths):
            return f"the model has `{path_str(m)}`, which the filter does not cover"
    return "the filter's static fields (a box's spec, a layer's options) differ from the model's"


def _is_filter(x: Any) -> bool:
    """Whether `x` is a filter function (a callable that is not a model: a pattern filter
    is a module, a model's pytree of flags is not callable as one)."""
    return callable(x) and (not isinstance(x, eqx.Module) or isinstance(x, _Patterns))


def _is_flag(x: Any) -> bool:
    """Whether `x` is a leaf of a bool-tree filter: a bool or a filter function."""
    return isinstance(x, bool) or _is_filter(x)


def _flags_of_tree(spec: PyTree, model: PyTree) -> list[Any]:
    """A flag (a bool or a callable of the leaf) per leaf of `model`, broadcast from the
    prefix tree `spec`; a structure that does not fit is refused by path."""
    try:
        full = jax.tree.map(
            lambda s, sub: jax.tree.map(lambda _: s, sub),
            spec,
            model,
            is_leaf=_is_flag,
        )
    except (ValueError, TypeError):
        raise LayerConfigError(
            f"make_train_step(trainable=...): the filter's structure does not match the "
            f"model's: {_mismatch(spec, model)}. Build it from the model, e.g. "
            f"`jax.tree.map(lambda _: False, model)` then `eqx.tree_at(...)`, or pass a "
            f"callable `(path, leaf) -> bool`."
        ) from None
    return jax.tree.leaves(full, is_leaf=_is_flag)


class Trainable(eqx.Module):
    """Which arrays of the model the train step trains (the others are frozen).

    A frozen array is carried unchanged, bit for bit: no gradient is computed for it
    (the step differentiates the trainable arrays only, the frozen ones being constants
    of the differentiated function), it has no optimizer state, and it takes no part in
    clipping, the finiteness check or the gradients' reductions.

    **Arguments:**

    - `spec`: either a callable `(path, leaf) -> bool` over the model's arrays, `path`
      as `equishard.sharding.path_str` writes it (a box's array named by the box's
      path, e.g. `units.blocks.mlp.w1.weight`; an `FSDP` unit adds `.module`, a
      pipeline `.layers.unit`), `leaf` the array; e.g. `lambda path, leaf: ".lora" in
      path`. Or a pytree of bools with the model's structure (an `eqx.partition` filter
      spec: a prefix stands for its whole subtree, a leaf may also be a callable `leaf
      -> bool`), e.g. `eqx.tree_at(lambda m: m.head, jax.tree.map(lambda _: False,
      model), True)`.

    Only floating arrays can be trained: a `True` prefix covers the floating arrays of
    its subtree; naming a non-floating array trainable is refused.
    """

    spec: Any = eqx.field(static=True)

    def __init__(self, spec: PathFilter | PyTree):
        if isinstance(spec, Trainable):
            spec = spec.spec
        self.spec = spec

    @classmethod
    def matching(cls, train: str | None = None, freeze: str | None = None) -> "Trainable":
        r"""A filter by regular expressions searched in each array's path: an array is
        trainable if `train` matches its path (`None`: every path) and `freeze` does not
        (`None`: none), e.g. `Trainable.matching(freeze=r"^embed|\.mlp\.")`. Printable
        and comparable (its `repr` names the patterns), as a command line needs.

        **Raises:**

        `LayerConfigError` for a pattern that is not a regular expression.
        """
        return cls(_Patterns(train, freeze))

    def _flags(self, model: PyTree, leaves: list[tuple[str, Any]]) -> list[Any]:
        if _is_filter(self.spec):
            return [
                bool(self.spec(path, leaf)) if path else False for path, leaf in leaves
            ]
        raw = _flags_of_tree(self.spec, model)
        out: list[Any] = []
        for flag, (path, leaf) in zip(raw, leaves):
            if _is_filter(flag):
                flag = bool(flag(leaf))
            # A `True` prefix over non-floating arrays leaves them frozen; a `True` at
            # the array itself (a leaf of the spec) is checked below.
            out.append(flag if path else False)
        return out

    def mask(self, model: PyTree, what: str = "make_train_step") -> TrainableMask:
        """This filter resolved against `model`: a `TrainableMask`.

        **Raises:**

        `LayerConfigError` if the filter's structure does not fit the model (naming the
        path), marks a non-floating array trainable (naming it), or leaves nothing
        trainable.
        """
        leaves = _leaves_with_paths(model)
        flags = self._flags(model, leaves)
        explicit = self._explicit_paths(model)
        for flag, (path, leaf) in zip(flags, leaves):
            if flag and not eqx.is_inexact_array(leaf):
                if explicit is not None and path not in explicit:
                    continue
                raise LayerConfigError(
                    f"{what}(trainable=...): the filter marks `{path}` trainable, a "
                    f"{_describe(leaf)}; only floating arrays are trained (integer and "
                    f"boolean fields are carried unchanged): leave it out of the filter."
                )
        flags = [bool(f) and eqx.is_inexact_array(leaf) for f, (_, leaf) in zip(flags, leaves)]
        if not any(flags):
            floating = [p for p, leaf in leaves if eqx.is_inexact_array(leaf)]
            raise LayerConfigError(
                f"{what}(trainable={self.spec!r}): the filter leaves nothing trainable "
                f"among the model's {len(floating)} floating arrays (e.g. "
                f"{', '.join(f'`{p}`' for p in floating[:3])}): check the paths it matches."
            )
        return TrainableMask(tuple(flags), tuple(p for p, _ in leaves))

    def _explicit_paths(self, model: PyTree) -> set[str] | None:
        """The paths a bool-tree filter names at the array itself (not by a prefix);
        `None` for a callable filter (which names each array)."""
        if _is_filter(self.spec):
            return None
        named: set[str] = set()
        for path, flag in jax.tree_util.tree_leaves_with_path(self.spec, is_leaf=_is_flag):
            text = path_str(path).removesuffix(".value")
            if flag is not False:
                named.add(text)
        leaves = {p for p, _ in _leaves_with_paths(model)}
        return named & leaves


class _Patterns(eqx.Module):
    """`(path, leaf) -> bool`: `train` searched in the path and `freeze` not."""

    train: str | None = eqx.field(static=True)
    freeze: str | None = eqx.field(static=True)

    def __init__(self, train: str | None, freeze: str | None):
        for name, pattern in (("train", train), ("freeze", freeze)):
            try:
                re.compile(pattern or "")
            except re.error as err:
                raise LayerConfigError(
                    f"Trainable.matching: {name}={pattern!r} is not a regular expression ({err})."
                ) from None
        self.train, self.freeze = train, freeze

    def __call__(self, path: str, leaf: Any) -> bool:
        wanted = self.train is None or re.search(self.train, path) is not None
        return wanted and not (self.freeze is not None and re.search(self.freeze, path))


def _describe(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", type(leaf).__name__)
    shape = list(getattr(leaf, "shape", ()))
    return f"{dtype}{shape} array"


def resolve_mask(trainable: Trainable | None, model: PyTree, what: str = "make_train_step") -> TrainableMask:
    """The mask of `trainable` on `model`; `None`: every floating array trainable."""
    if trainable is None:
        leaves = _leaves_with_paths(model)
        return TrainableMask(tuple(eqx.is_inexact_array(x) for _, x in leaves), tuple(p for p, _ in leaves))
    return trainable.mask(model, what)


def check_trainable(trainable: Any, what: str) -> Trainable | None:
    """`trainable` as a `Trainable` (`None`: every floating array), a filter wrapped."""
    if trainable is None or isinstance(trainable, Trainable):
        return trainable
    if isinstance(trainable, (str, bytes, int, float)) and not isinstance(trainable, bool):
        raise LayerConfigError(
            f"{what}: trainable must be a callable (path, leaf) -> bool, a pytree of bools "
            f"with the model's structure, or an equishard.train.Trainable; got {trainable!r}."
        )
    return Trainable(trainable)


def trainable_mask(model: PyTree, spec: PathFilter | PyTree | Trainable | None) -> TrainableMask:
    """Resolve a trainable filter against `model`.

    **Arguments:**

    - `model`: the model (global arrays or shapes).
    - `spec`: a `Trainable`, a filter `Trainable` takes, or `None` (every floating array).

    **Returns:**

    A `TrainableMask`: `mask.flags` per leaf, `mask.split(model) -> (trainable, frozen)`,
    `mask.frozen_paths()`.

    **Raises:**

    `LayerConfigError` as `Trainable.mask`.
    """
    return resolve_mask(check_trainable(spec, "trainable_mask"), model, "trainable_mask")
