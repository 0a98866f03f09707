"""Fully-sharded data parallelism (FSDP / ZeRO-3) for any Equinox module.

Parameters are stored split over a data axis (`fsdp_split_params`), all-gathered just
before the module's call (`fsdp_gather_params`) and — by default — gathered again in the backward
pass instead of being kept alive from the forward pass. Under equishard's gradient
convention the transpose of each all-gather is a reduce-scatter, so gradients come out
split like their parameters and equal to the single-device gradients.

The modules: `FSDP`, `shard_module_params` and `fsdp_wrap` here; the gathers of the
parameters in `_fsdp_gather`; the re-gather's custom VJP in `_fsdp_regather`; a scan over
stacked FSDP units, differentiated as one, in `_fsdp_scan`.

The re-gather is a custom VJP that recomputes the layer in its backward pass, as a
`jax.checkpoint` would: both forward and backward
gathers are tied by a data dependency to the layer's input (forward) or output
cotangent (backward), so that no scheduler can hoist them and hold every layer's
parameters whole at once. (With a checkpoint policy alone, XLA:CPU issues all the
gathers at the start of the step, and merges the backward's with the forward's.) The
forward keeps the outputs of the layer's other collectives (a
tensor-parallel all-reduce, an expert all-to-all), so that the recomputation in the
backward pass sends nothing but the FSDP gathers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src.interpreters.batching import BatchTracer
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._axes import is_bound, vmap_names
from .._errors import LayerConfigError
from .._warn import warn
from ..sharding import (
    fsdp_split_params,
    is_array_like,
    is_sharded,
    shard_params,
)
from ..sharding._internal import DEFAULT_MIN_WEIGHT_SIZE, map_modules, spec_axes
from ._fsdp_gather import GathersFSDP, _check_dtype, fsdp_gather_params
from ._fsdp_regather import _call_regathering, _GatherConfig
from ._remat import save_collectives_except


class FSDP(eqx.Module, GathersFSDP):
    """Wrap any Equinox module so that its parameters are fully sharded.

    ```python
    block = FSDP(MyBlock(..., key=key), "fsdp", mesh=mesh)   # or under sharded_init
    y = block(x)                      # inside filter_shard_map: gathers, calls, frees
    ```

    **Arguments:**

    - `module`: the module (a plain one or one of equishard's layers).
    - `axis_name`: the data axis to split parameters over.
    - `min_weight_size`: arrays with fewer elements stay replicated (equishard's rule,
      `fsdp_split_params`: global sizes, ties to the earlier dimension). A warning
      says when that leaves half of the module's parameter bytes or more replicated.
    - `gather_dtype`, `grad_scatter_dtype`: mixed precision of the gathers and of the
      gradient reduce-scatters (see `fsdp_gather_params`); `None`: each array's dtype,
      unless the train step's precision policy sets them
      (`make_train_step(precision=MixedPrecision(...))`, through `with_fsdp_dtypes`).
    - `regather`: gather the parameters again in the backward pass instead of saving
      the gathered copies from the forward pass (the layer's forward is recomputed
      there too, as under `jax.checkpoint`, except its collectives over other axes —
      tensor-parallel all-reduces, expert all-to-alls — whose outputs are kept from the
      forward pass rather than sent twice). On by default.
    - `mean_grads`: the local-loss convention (gradients averaged, see `gather_params`);
      `make_train_step` (global loss) refuses it.
    - `split_rule`: `"fsdp"` (default, `fsdp_split_params`) or `"xlstm"` (xLSTM-JAX's
      rule, `shard_params`, as `shard_module_params` uses).
    - `mesh`: outside `shard_map`, the mesh whose `axis_name` size decides divisibility
      (default: the ambient mesh, which `sharded_init` sets).
    - `path`: where the unit sits in the model (`fsdp_wrap` sets it), for the messages.

    An attribute of the wrapped module read through the unit (`model.embed.weight`, the
    unit at `embed`) is refused with a `LayerConfigError` naming its path: outside the
    unit's call the parameters are this device's blocks. A tied head reads the weight
    inside a unit that holds both (see the "Your own model" guide).
    """

    module: PyTree
    axis_name: str = eqx.field(static=True)
    gather_dtype: Any = eqx.field(static=True)
    grad_scatter_dtype: Any = eqx.field(static=True)
    regather: bool = eqx.field(static=True)
    mean_grads: bool = eqx.field(static=True)
    path: str = eqx.field(static=True)
    __fsdp_unit__: ClassVar[bool] = True

    def __init__(
        self,
        module: PyTree,
        axis_name: str = "fsdp",
        *,
        min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
        gather_dtype: Any = None,
        grad_scatter_dtype: Any = None,
        regather: bool = True,
        mean_grads: bool = False,
        split_rule: str = "fsdp",
        mesh: Mesh | AbstractMesh | None = None,
        path: str = "",
    ):
        _check_dtype("gather_dtype", gather_dtype)
        _check_dtype("grad_scatter_dtype", grad_scatter_dtype)
        if split_rule not in ("fsdp", "xlstm"):
            raise LayerConfigError(f"FSDP: split_rule must be 'fsdp' or 'xlstm', got {split_rule!r}.")
        split = fsdp_split_params if split_rule == "fsdp" else shard_params
        self.module = split(module, axis_name, min_weight_size, mesh=mesh)
        if split_rule == "fsdp":
            _warn_if_little_is_split(self.module, axis_name, min_weight_size)
        self.axis_name = axis_name
        self.gather_dtype = gather_dtype
        self.grad_scatter_dtype = grad_scatter_dtype
        self.regather = regather
        self.mean_grads = mean_grads
        self.path = path

    def __getattr__(self, name: str) -> Any:
        # Only for names the unit itself lacks: an attribute of the wrapped module read
        # through the unit (a tied head's `embed.weight`) is refused by its path.
        module = self.__dict__.get("module")
        if name.startswith("__") or module is None or not hasattr(module, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise _ThroughUnitError(_through_unit_message(self.path, module, name, self.axis_name))

    def __unbox__(self) -> PyTree:
        """The wrapped module, for `equishard.unbox` (its arrays still in their boxes).

        Inside `shard_map` with `axis_name` bound (the local view), the module with its
        parameters all-gathered (`gathered`'s gather: the gradients reduce-scattered),
        so that `unbox(model)(x)` computes with the global parameters, as in the global
        view, not with this device's blocks of them. The gathered parameters then stay
        whole until the last use, every unbox-ed unit at once: call the model itself
        (`model(x)`) to gather one unit at a time.
        """
        if not is_bound(self.axis_name):
            return self.module
        # f32[.., K/fsdp, ..] -> f32[.., K, ..] for each split array
        return fsdp_gather_params(
            self.module, self.axis_name, self.gather_dtype, self.grad_scatter_dtype,
            mean_grads=self.mean_grads, skip_units=True,
        )  # fmt: skip

    def _config(self) -> _GatherConfig:
        return _GatherConfig(self.axis_name, self.gather_dtype, self.grad_scatter_dtype, self.mean_grads)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, call the wrapped module with `args`, free them.

        Inside `shard_map` (local view). The gathers wait for the inputs, so one layer's
        parameters are whole at a time; with `regather` the backward pass gathers
        them again after the layer's output cotangent arrives.
        """
        operands = _without_tangents((self.module, args, kwargs))
        return _call_unit_once_per_batch(operands, self._call_unit)

    def gathered(self) -> "_GatheredUnit":
        """This unit with its split parameters all-gathered, to call many times.

        For a caller that runs the unit on many inputs one after another and gathers
        once for all of them (a pipeline schedule gathers each stage's units once per
        step, see the pipeline guide): `fsdp_gather_params` with this unit's options.
        The gathered parameters live until the last call; the gradients of all the
        calls are summed before the gather's transpose reduce-scatters them, once. With
        `regather` each call still recomputes its forward in the backward pass (keeping
        its other collectives' outputs), so a call keeps only its inputs for the
        backward, as the unit's own call does; nothing is gathered again.
        """
        module = fsdp_gather_params(
            self.module, self.axis_name, self.gather_dtype, self.grad_scatter_dtype,
            mean_grads=self.mean_grads, skip_units=True,
        )  # fmt: skip
        return _GatheredUnit(module, self.axis_name, self.regather)

    def _call_unit(self, operands: Any) -> Any:
        if self.regather:
            return _call_regathering(operands, self._config())
        return self._config().call(operands, operands[1:])


class _ThroughUnitError(LayerConfigError, AttributeError):
    """An attribute of an FSDP unit's module read through the unit (also an
    `AttributeError`, so `hasattr` and `getattr(..., default)` keep their meaning)."""


def _through_unit_message(path: str, module: Any, name: str, axis_name: str) -> str:
    where = f"`{path}`" if path else "this FSDP unit"
    full = f"{path}.{name}" if path else name
    return (
        f"`{full}`: {where} is an FSDP unit (wrapping {type(module).__name__}) whose "
        f"parameters are split over {axis_name!r} and gathered only inside its own call, "
        f"so `{name}` cannot be read through it: outside that call it would be this "
        f"device's block. To share a weight (a tied head reading the embedding's), wrap "
        f"the module that reads it instead, so that the weight is gathered with it: "
        f"`fsdp_wrap(model, policy=lambda path, m: path == \"\")` for the whole model, "
        f"or wrap the repeated blocks first and the model around them with "
        f"`equishard.nn.FSDP(model)` (see the \"Your own model\" guide, \"Tied weights\"). "
        f"(The stored block is `{path + '.' if path else ''}module.{name}`.)"
    )


class _GatheredUnit(eqx.Module):
    """An `FSDP` unit's module with its parameters already gathered (`FSDP.gathered`).

    Calls the module; with `recompute`, under a checkpoint that keeps only the outputs
    of its collectives over axes other than `axis_name` (as `FSDP`'s regathering call).
    """

    module: PyTree
    axis_name: str = eqx.field(static=True)
    recompute: bool = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.recompute:
            return self.module(*args, **kwargs)
        call = eqx.filter_checkpoint(
            lambda m, a, k: m(*a, **k), policy=save_collectives_except(self.axis_name)
        )
        return call(self.module, args, kwargs)


def _without_tangents(tree: PyTree) -> PyTree:
    """`tree` with its integer and boolean arrays cut from differentiation.

    Such an array has no gradient, but one computed from differentiated values (a batch
    norm's step counter, updated by an earlier layer under the step's `jax.vjp` and
    returned by an earlier unit) may carry an instantiated zero tangent, which the
    unit's custom gradient (`eqx.filter_custom_vjp`) refuses for its non-differentiated
    inputs. A conversion to the unsigned type of the same width and back (exact, bit for
    bit) has a symbolic zero tangent.
    """

    def cut(x: Any) -> Any:
        if not eqx.is_array(x) or eqx.is_inexact_array(x):
            return x
        dtype = x.dtype
        if dtype == jnp.bool_:
            return x.astype(jnp.uint8).astype(dtype)
        if jnp.issubdtype(dtype, jnp.signedinteger):
            return x.astype(jnp.dtype(f"uint{dtype.itemsize * 8}")).astype(dtype)
        if jnp.issubdtype(dtype, jnp.unsignedinteger):
            return x.astype(jnp.dtype(f"int{dtype.itemsize * 8}")).astype(dtype)
        return x  # a key array: its tangent is not instantiated by JAX's rules

    return jax.tree.map(cut, tree)


def _call_unit_once_per_batch(operands: Any, call: Callable[[Any], Any]) -> Any:
    """`call(operands)`; under `vmap`s outside the unit (its inputs batch tracers),
    with each `vmap` moved inside it (`_call_once_per_batch`)."""
    if any(isinstance(x, BatchTracer) for x in jax.tree.leaves(operands)):
        return _call_once_per_batch(operands, call)
    return call(operands)


def _is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _split_states(out: Any) -> tuple[Any, Any]:
    """`(rest, states)`: `out` with its `eqx.nn.State`s taken out, and those alone."""
    rest = jax.tree.map(lambda x: None if _is_state(x) else x, out, is_leaf=_is_state)
    states = jax.tree.map(lambda x: x if _is_state(x) else None, out, is_leaf=_is_state)
    return rest, states


def _join_states(rest: Any, states: Any) -> Any:
    return jax.tree.map(lambda r, s: r if s is None else s, rest, states, is_leaf=lambda x: x is None or _is_state(x))


class _OverExamples(eqx.Module):
    """A module called on a batch of inputs, one example at a time (`jax.vmap` named
    `axis_name`, as the `vmap` it stands for, so that batch statistics find it). A
    returned `eqx.nn.State` is one for the whole batch (as the `vmap`'s `out_axes=None`
    the model's caller gives it)."""

    module: PyTree
    static_inputs: Any = eqx.field(static=True)
    in_axes: Any = eqx.field(static=True)
    axis_name: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def one(dynamic: Any) -> Any:
            args, kwargs = eqx.combine(dynamic, self.static_inputs)
            return _split_states(self.module(*args, **kwargs))

        dynamic = eqx.partition((args, kwargs), eqx.is_array)[0]
        rest, states = jax.vmap(one, in_axes=(self.in_axes,), out_axes=(0, None), axis_name=self.axis_name)(dynamic)
        return _join_states(rest, states)


def _call_once_per_batch(operands: Any, call: Callable[[Any], Any]) -> Any:
    """`call(operands)` under a `vmap` outside the unit, with the parameters gathered once.

    A `vmap` over the examples would batch the unit's custom gradient, and with it the
    reduce-scatter of every parameter's gradient: one per example. Its batching rule
    instead moves the `vmap` inside the unit, around the wrapped module's call: the
    parameters are gathered once per batch, their gradients summed over the examples
    and then reduce-scattered once.
    """
    dynamic, static = eqx.partition(operands, eqx.is_array)
    out_static: list[Any] = []
    # The name of the innermost `vmap` batching the operands: the one whose batching
    # rule runs first, below.
    names = [vmap_names(x) for x in jax.tree.leaves(operands)]
    axis_name = next((n[0] for n in names if n), None)

    def arrays_of(out: Any) -> Any:
        arrays, rest = eqx.partition(out, eqx.is_array)
        out_static.append(rest)
        return arrays

    @jax.custom_batching.custom_vmap
    def per_example(dynamic: Any) -> Any:
        return arrays_of(call(eqx.combine(dynamic, static)))

    @per_example.def_vmap
    def over_examples(axis_size: int, in_batched: Any, dynamic: Any) -> Any:
        del axis_size
        module, args, kwargs = eqx.combine(dynamic, static)
        ((module_batched, args_batched, kwargs_batched),) = in_batched
        if any(jax.tree.leaves(module_batched)):  # per-example parameters: nothing to share
            in_axes = jax.tree.map(lambda b: 0 if b else None, in_batched[0])
            out = jax.vmap(lambda d: call(eqx.combine(d, static)), in_axes=(in_axes,))(dynamic)
        else:
            in_axes = jax.tree.map(lambda b: 0 if b else None, (args_batched, kwargs_batched))
            static_inputs = eqx.partition((args, kwargs), eqx.is_array)[1]
            # Further `vmap`s outside this one move inside the unit too.
            over = _OverExamples(module, static_inputs, in_axes, axis_name)
            out = _call_unit_once_per_batch((over, args, kwargs), call)
        arrays = arrays_of(out)
        # Batched, but for a returned state (one for the whole batch).
        batched = jax.tree.map(
            lambda x: jax.tree.map(lambda _: not _is_state(x), x), arrays, is_leaf=_is_state
        )
        return arrays, batched

    return eqx.combine(per_example(dynamic), out_static[-1])


def shard_module_params(
    target: PyTree,
    axis_name: str,
    min_weight_size: int = 2**18,
    gather_dtype: Any = None,
    grad_scatter_dtype: Any = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
) -> FSDP:
    """xLSTM-JAX's `shard_module_params`: `target` with its parameters split over `axis_name`.

    As `xlstm_jax.distributed.data_parallel.shard_module_params` (a Flax
    `nn.map_variables` of `shard_params` / `gather_params`): the parameters are split
    by `shard_params`'s rule and all-gathered before each call by `gather_params`, whose
    gradients are averaged over the axis. The reference's recipe — each device's local
    loss differentiated inside `shard_map(..., check_vma=False)`, then
    `sync_gradients(grads, axis_names)` — gives the single-device gradients of the mean
    loss; with the varying-axes check on, the gradients of the split arrays are the
    reference's too (see the coming-from guide for `sync_gradients` there). Under
    equishard's global-loss convention use `FSDP` (`make_train_step` refuses this
    module). (The returned module is an `FSDP` with `mean_grads=True,
    split_rule="xlstm"`.)

    **Arguments:**

    - `target`: any Equinox module (a user's own too).
    - `axis_name`: the axis to split parameters over.
    - `min_weight_size`: arrays of at most this many elements stay replicated.
    - `gather_dtype`, `grad_scatter_dtype`: see `gather_params`.
    - `mesh`: see `FSDP`.

    **Returns:**

    An `FSDP` module: parameters stored split, gathered just before each call.
    """
    return FSDP(
        target,
        axis_name,
        min_weight_size=min_weight_size,
        gather_dtype=gather_dtype,
        grad_scatter_dtype=grad_scatter_dtype,
        mean_grads=True,
        split_rule="xlstm",
        mesh=mesh,
    )


def _split_fraction(module: PyTree, axis_name: str) -> tuple[int, int]:
    """`(split, total)`: parameter bytes split over `axis_name`, and all of them."""
    split = total = 0
    for leaf in jax.tree.leaves(module, is_leaf=is_sharded):
        value = leaf.value if is_sharded(leaf) else leaf
        if not is_array_like(value):
            continue
        shape = leaf.global_shape if is_sharded(leaf) else tuple(value.shape)
        size = math.prod(shape) * value.dtype.itemsize
        total += size
        if is_sharded(leaf) and axis_name in spec_axes(leaf.spec):
            split += size
    return split, total


def _warn_if_little_is_split(module: PyTree, axis_name: str, min_weight_size: int) -> None:
    split, total = _split_fraction(module, axis_name)
    if total and split < total / 2:
        warn(
            f"FSDP over {axis_name!r} splits {split} of the {total} parameter bytes of "
            f"{type(module).__name__} (min_weight_size={min_weight_size}); the rest stays "
            f"replicated on every device. Lower min_weight_size, or check that the "
            f"arrays' dimensions divide by the axis size.")


WrapPolicy = type | tuple[type, ...] | str | Callable[[str, Any], bool]


def _policy_matcher(policy: WrapPolicy) -> Callable[[str, Any], bool]:
    if isinstance(policy, str):
        pattern = re.compile(policy)
        return lambda path, node: isinstance(node, eqx.Module) and bool(pattern.search(path))
    if isinstance(policy, type) or (
        isinstance(policy, tuple) and all(isinstance(t, type) for t in policy)
    ):
        return lambda path, node: isinstance(node, policy)
    if callable(policy):
        return policy
    raise LayerConfigError(
        f"fsdp_wrap: policy must be a class, a tuple of classes, a path pattern or a "
        f"function (path, module) -> bool, got {policy!r}."
    )


def fsdp_wrap(
    model: PyTree,
    axis_name: str = "fsdp",
    *,
    policy: WrapPolicy,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    mesh: Mesh | AbstractMesh | None = None,
    **fsdp_options: Any,
) -> PyTree:
    """Wrap the sub-modules of `model` that `policy` selects in `FSDP` units.

    PyTorch FSDP's auto-wrap for Equinox: each selected module (the outermost match;
    nothing inside it is wrapped again) becomes one FSDP unit, whose parameters are
    gathered just before its call and freed after it. Wrap the repeated blocks of a
    model, one unit each, so that one block's parameters are whole at a time:

    ```python
    model = es.nn.fsdp_wrap(model, "fsdp", policy=TransformerBlock, mesh=mesh)
    ```

    The arrays outside every unit (an embedding, a head) are not split: give them specs
    with path rules, or wrap the model's root too (`policy=lambda path, m: path == ""`
    wraps the whole model as one unit). See the "Your own model" guide.

    **Arguments:**

    - `model`: any pytree of Equinox modules (a plain model too).
    - `axis_name`: the data axis to split parameters over.
    - `policy`: which modules become units: a class or a tuple of classes
      (`isinstance`), a regular expression searched in the module's path
      (`r"blocks\\[\\d+\\]"`), or a function `(path, module) -> bool`. Paths are written
      as `blocks[3].attention`; the root's path is `""`.
    - `min_weight_size`: arrays with fewer elements stay replicated (see `FSDP`).
    - `mesh`: outside `shard_map`, the mesh (see `FSDP`).
    - `fsdp_options`: further `FSDP` options (`regather`, `gather_dtype`, ...).

    **Returns:**

    `model` with the selected modules wrapped.

    **Raises:**

    `LayerConfigError` if the policy selects nothing.
    """
    matches = _policy_matcher(policy)
    wrapped: list[str] = []

    def visit(path: str, node: Any, descend: Callable[[Any], Any]) -> Any:
        if not matches(path, node):
            return descend(node)
        wrapped.append(path)
        return FSDP(node, axis_name, min_weight_size=min_weight_size, mesh=mesh, path=path, **fsdp_options)

    result = map_modules(model, visit)
    if not wrapped:
        raise LayerConfigError(
            f"fsdp_wrap: policy {policy!r} selects no module of {type(model).__name__}."
        )
    return result
