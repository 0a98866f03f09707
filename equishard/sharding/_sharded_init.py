"""Mesh-invariant initialisation: build a model directly sharded on a mesh.

The model is built under `jit` with output shardings, so each device computes only its
own block and a model bigger than one device never materialises on one device. With
`jax_threefry_partitionable` on (JAX's default), the random bits do not depend on the
sharding: the same key gives bit-identical global parameters on every mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from .._compile import check_compiler_options
from .._warn import warn
from ._specs import check_tree_specs, is_array_like, is_spec, specs_of


def check_threefry_partitionable() -> bool:
    """Whether `jax_threefry_partitionable` is on; warns (once per call site) if it is off.

    With it off, random bits depend on how the computation is sharded, and
    `sharded_init` is no longer mesh-invariant.
    """
    on = bool(getattr(jax.config, "jax_threefry_partitionable"))
    if not on:
        warn(
            "equishard: jax_threefry_partitionable is off, so random initialisation "
            "depends on the mesh (the same key gives different parameters on different "
            "layouts). Turn it on with jax.config.update('jax_threefry_partitionable', True).")
    return on


def sharded_init(
    make: Callable[..., PyTree],
    *args: Any,
    mesh: Mesh,
    compiler_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> PyTree:
    """Call `make(*args, **kwargs)` so that its result is born sharded on `mesh`.

    ```python
    model = equishard.sharded_init(lambda k: MyModel(cfg, key=k), key, mesh=mesh)
    ```

    **Arguments:**

    - `make`: builds the model (or any pytree whose arrays carry specs). Arrays are
      dynamic arguments; everything else is closed over.
    - `*args`, `**kwargs`: passed to `make` (typically a PRNG key).
    - `mesh`: the mesh to place the result on.
    - `compiler_options`: XLA options for the initialisation's program only, as
      `jax.jit`'s (e.g. `{"xla_backend_optimization_level": 0}`: on a CPU, a model's
      random initialisation compiles about as long as its train step); the defaults
      and the `XLA_FLAGS` environment variable otherwise. (So `make` cannot take a
      keyword argument of that name.)

    **Returns:**

    What `make` returns, each array placed on `mesh` by its spec.

    **Raises:**

    `SpecError` (path, shape, spec, mesh) if a spec does not fit, before anything is
    computed; `EquishardError` for `compiler_options` XLA refuses.
    """
    check_threefry_partitionable()
    compiler_options = check_compiler_options(compiler_options, "sharded_init")
    # The mesh is made ambient so that `make` may consult it (e.g. `FSDP` and
    # `shard_params` read the size of their axis from it).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return _sharded_init(make, args, kwargs, mesh, compiler_options)


def _sharded_init(
    make: Callable[..., PyTree], args: Any, kwargs: Any, mesh: Mesh, compiler_options: dict[str, Any] | None
) -> PyTree:
    shapes = eqx.filter_eval_shape(make, *args, **kwargs)
    specs = specs_of(shapes)
    check_tree_specs(shapes, specs, mesh)
    shardings = jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s),
        specs,
        is_leaf=lambda s: s is None or is_spec(s),
    )
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    out_static: list[Any] = []

    def build(dyn: Any) -> Any:
        call_args, call_kwargs = eqx.combine(dyn, static)
        out_dyn, rest = eqx.partition(make(*call_args, **call_kwargs), is_array_like)
        out_static.append(rest)
        return out_dyn

    out = jax.jit(build, out_shardings=shardings, compiler_options=compiler_options)(dynamic)
    return eqx.combine(out, out_static[-1])
