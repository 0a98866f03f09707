"""`filter_shard_map`: `shard_map` for Equinox pytrees.

It is to `jax.shard_map` what `eqx.filter_jit` is to `jax.jit`: non-array leaves pass
through untouched, in_specs default to the specs the arguments carry, out_specs to the
specs the outputs carry, arrays not yet placed on the mesh are placed by their specs,
and a spec that does not fit fails with a message naming the parameter's path, its
shape, the spec and the mesh before XLA sees it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._axes import varying_axes
from .._errors import SpecError
from ._place import _map_with_specs, is_tracer, place
from ._specs import (
    check_tree_specs,
    describe_mesh,
    is_array_like,
    is_spec,
    path_str,
    spec_axes,
    specs_of,
)


def _is_spec_or_none(x: Any) -> bool:
    return x is None or is_spec(x)


def _resolve_specs(given: PyTree, tree: PyTree, *, name: str, mesh: Mesh) -> PyTree:
    """Fill the `None` entries of a user's spec prefix with the specs `tree` carries."""
    if given is None:
        return specs_of(tree)
    try:
        return jax.tree.map(
            lambda spec, sub: specs_of(sub) if spec is None else spec,
            given,
            tree,
            is_leaf=_is_spec_or_none,
        )
    except ValueError as err:
        raise SpecError(
            f"the specs given for `{name}` do not match its structure on "
            f"{describe_mesh(mesh)}: specs {jax.tree.structure(given, is_leaf=_is_spec_or_none)} "
            f"vs {jax.tree.structure(tree)} ({err})"
        ) from None


def _fill_out_specs(given: PyTree, carried: PyTree, mesh: Mesh) -> PyTree:
    """Fill the `None` entries of a user's out_specs prefix with the carried specs."""
    if given is None:
        return carried
    try:
        return jax.tree.map(
            lambda spec, sub: sub if spec is None else spec, given, carried, is_leaf=_is_spec_or_none
        )
    except ValueError as err:
        raise SpecError(
            f"out_specs {given!r} do not match the structure of the outputs on "
            f"{describe_mesh(mesh)}: {err}"
        ) from None


def _check_out_specs(out: PyTree, out_specs: PyTree, mesh: Mesh, manual: frozenset[str]) -> None:
    """Check each output block against its out_spec, in the local view, before JAX does.

    The structure must match (a spec prefix), every axis be a mesh axis, every spec fit
    its output's rank, and an output that varies over a manual axis (with the
    varying-axes check on) be split over it: a replicated spec for a varying value
    would keep one device's block and drop the others.
    """
    spec_paths, spec_def = jax.tree_util.tree_flatten_with_path(out_specs, is_leaf=_is_spec_or_none)
    try:
        subtrees = spec_def.flatten_up_to(out)
    except (ValueError, TypeError) as err:
        raise SpecError(
            f"out_specs {out_specs!r} do not match the structure of the outputs on "
            f"{describe_mesh(mesh)}: the outputs are {jax.tree.structure(out)} ({err})."
        ) from None
    for (spec_path, spec), subtree in zip(spec_paths, subtrees):
        for leaf_path, x in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            if not is_array_like(x):
                continue
            where = (
                f"output `{path_str((*spec_path, *leaf_path))}` (local shape "
                f"{tuple(x.shape)}) with out_spec {spec} on {describe_mesh(mesh)}"
            )
            _check_out_spec(where, spec, mesh)
            if len(spec) > x.ndim:
                raise SpecError(
                    f"{where}: the spec has {len(spec)} entries but the output has only "
                    f"{x.ndim} dimensions."
                )
            missing = sorted((varying_axes(x) & manual) - set(spec_axes(spec)))
            if missing:
                names = tuple(missing) if len(missing) > 1 else missing[0]
                raise SpecError(
                    f"{where}: the value varies over {names!r} but the spec does not split it "
                    f"there, so all but one device's block would be dropped. If it is a "
                    f"partial result, reduce it first (`jax.lax.psum` or `jax.lax.pmean` over "
                    f"{names!r}); if each device holds its own block, split it over "
                    f"{names!r} in out_specs."
                )


def _check_out_axes(out_specs: PyTree, mesh: Mesh) -> None:
    """Every axis the given out_specs name is a mesh axis (checked before tracing)."""
    leaves = jax.tree_util.tree_flatten_with_path(out_specs, is_leaf=_is_spec_or_none)[0]
    for path, spec in leaves:
        if spec is None:
            continue
        where = f"out_specs entry `{path_str(path)}` {spec!r}" if path else f"out_specs {spec!r}"
        _check_out_spec(f"{where} on {describe_mesh(mesh)}", spec, mesh)


def _check_out_spec(where: str, spec: Any, mesh: Mesh) -> None:
    """`spec` is a PartitionSpec whose every axis is an axis of `mesh`."""
    if not is_spec(spec):
        raise SpecError(f"{where}: an out_spec must be a PartitionSpec or None.")
    unknown = [a for a in spec_axes(spec) if a not in mesh.shape]
    if unknown:
        raise SpecError(
            f"{where}: axis {unknown[0]!r} is not an axis of the mesh (its axes are "
            f"{tuple(mesh.shape)})."
        )


def _argument_names(fn: Callable, count: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(count):
        if i < len(params) and params[i].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(params[i].name)
        else:
            names.append(f"args[{i}]")
    return names


def _in_specs_per_argument(in_specs: Any, num_args: int, mesh: Mesh) -> Sequence[Any]:
    if in_specs is None:
        return (None,) * num_args
    if is_spec(in_specs):
        return (in_specs,) * num_args
    if not isinstance(in_specs, (tuple, list)) or len(in_specs) != num_args:
        raise SpecError(
            f"in_specs must be a PartitionSpec or a tuple with one entry per positional "
            f"argument ({num_args} here), got {in_specs!r} on {describe_mesh(mesh)}."
        )
    return in_specs


def filter_shard_map(
    fn: Callable | None = None,
    /,
    *,
    mesh: Mesh,
    in_specs: Any = None,
    out_specs: Any = None,
    check_vma: bool = True,
    axis_names: frozenset[str] | set[str] = frozenset(),
) -> Callable:
    """Map `fn` over the shards of its arguments on `mesh` (local view).

    Inside `fn`, every array is this device's block and collectives over the mesh axes
    are available; outside, the wrapped function takes and returns global arrays, so it
    can be called from a plain `eqx.filter_jit` program (the global view). Usable as a
    decorator: `@filter_shard_map(mesh=mesh)`.

    **Arguments:**

    - `fn`: the function to map. Its arguments and outputs may be any pytrees: arrays
      are split by their specs, everything else (activation functions, ints, static
      fields) passes through unchanged.
    - `mesh`: the device mesh.
    - `in_specs`: `None` (default) to use the specs the arguments carry (`specs_of`);
      one `PartitionSpec` for every array of every positional argument; or a tuple with
      one entry per positional argument, each a `PartitionSpec`, a spec tree that is a
      prefix of the argument, or `None` for the argument's own specs. Keyword arguments
      always use their own specs.
    - `out_specs`: `None` (default) to use the specs the outputs carry (plain arrays:
      replicated), or a spec prefix of the outputs in which `None` means "the specs
      this part carries".
    - `check_vma`: keep `shard_map`'s varying-manual-axes check on (the default, which
      equishard's gradient convention relies on).
    - `axis_names`: the mesh axes to make manual (default: all).

    **Returns:**

    The mapped function.

    **Raises:**

    `SpecError` naming the parameter's path (`model.blocks[3].mlp.w1`), its shape, the
    spec and the mesh when an input spec does not fit.
    """
    if fn is None:
        return functools.partial(
            filter_shard_map,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
            axis_names=axis_names,
        )

    _check_out_axes(out_specs, mesh)

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        names = _argument_names(fn, len(args))
        given = _in_specs_per_argument(in_specs, len(args), mesh)
        arg_specs = tuple(
            _resolve_specs(g, a, name=n, mesh=mesh) for g, a, n in zip(given, args, names)
        )
        kwarg_specs = {k: specs_of(v) for k, v in kwargs.items()}
        for name, arg, spec in zip(names, args, arg_specs):
            check_tree_specs(arg, spec, mesh, what="argument", prefix=name)
        for name, arg in kwargs.items():
            check_tree_specs(arg, kwarg_specs[name], mesh, what="argument", prefix=name)

        specs = (arg_specs, kwarg_specs)
        # On a mesh of Auto axes `in_specs` lays a traced array out on its way in: only
        # concrete arrays are placed (a sharding constraint would add nothing but work).
        auto = all(t == AxisType.Auto for t in mesh.axis_types)

        def put(x: Any, spec: P) -> Any:
            return x if auto and is_tracer(x) else place(x, mesh, spec)

        placed = _map_with_specs(put, (args, kwargs), specs)
        dynamic, static = eqx.partition(placed, is_array_like)
        record: dict[str, Any] = {"validate": None}
        needs_carried = out_specs is None or any(
            s is None for s in jax.tree.leaves(out_specs, is_leaf=_is_spec_or_none)
        )
        manual = frozenset(axis_names or mesh.axis_names) if check_vma else frozenset()

        def body(dyn: Any) -> Any:
            call_args, call_kwargs = eqx.combine(dyn, static)
            out = fn(*call_args, **call_kwargs)
            out_dyn, out_static = eqx.partition(out, is_array_like)
            record["static"] = out_static
            if needs_carried:
                # Read while the mesh axes are bound: a box fits its spec if its value is
                # this device's block of the global shape (see `box_fits`).
                record["carried"] = specs_of(out_dyn)
            if record["validate"] is not None:
                _check_out_specs(out_dyn, record["validate"], mesh, manual)
            return out_dyn

        def run(final_out_specs: Any, *, validate: bool = True) -> Any:
            record["validate"] = final_out_specs if validate else None
            return jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(specs,),
                out_specs=final_out_specs,
                check_vma=check_vma,
                axis_names=set(axis_names),
            )(dynamic)

        if needs_carried:
            # Trace once, abstractly, to learn the outputs' structure and carried specs.
            # With out_specs P() the trace fails (a ValueError from shard_map's
            # replication check) for outputs that vary; the body, traced first, has
            # recorded what is needed by then. Any other error is the user's.
            try:
                jax.eval_shape(lambda d: run(P(), validate=False), dynamic)
            except ValueError:
                if "carried" not in record:
                    raise
            resolved = _fill_out_specs(out_specs, record["carried"], mesh)
        else:
            resolved = out_specs
        out_dyn = run(resolved)
        return eqx.combine(out_dyn, record["static"])

    return mapped
