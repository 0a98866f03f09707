"""Helpers shared by the tests: the tolerance, keys, perturbation, and the harness that checks a
sharded computation against its single-device self on several layouts."""

from __future__ import annotations

import collections
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import equishard as es

FP32_RTOL = 1e-5
BF16_RTOL = 1e-2

# XLA options for a test that compares the bits of two differently fused computations of
# the same values (an initialisation against its permuted copy): compile them as users
# do. The suite's default (the conftest's XLA_FLAGS: LLVM at -O0, and on JAX 0.10 the
# older fusion emitters) rounds some elementwise code differently from one fusion to the
# next (1 ulp).
OPTIMISED: dict[str, Any] = {"xla_backend_optimization_level": 3}
if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):
    OPTIMISED["xla_cpu_use_fusion_emitters"] = True


def getkey(seed: int = 0):
    """A function that returns a new PRNG key each call."""
    counter = itertools.count()
    base = jax.random.key(seed)
    return lambda: jax.random.fold_in(base, next(counter))


def jit_once(fn: Callable, compiler_options: dict[str, Any] | None = None) -> Callable:
    """`eqx.filter_jit(fn)` for a call made once, compiled with `compiler_options` (and
    caching nothing). The output may hold non-arrays (a module's static parts), as
    `eqx.filter_jit`'s may."""

    def call(*args: Any) -> Any:
        dynamic, static = eqx.partition(args, eqx.is_array)
        rest = []

        def arrays_of(dynamic: Any) -> Any:
            arrays, others = eqx.partition(fn(*eqx.combine(dynamic, static)), eqx.is_array)
            rest.append(others)
            return arrays

        arrays = jax.jit(arrays_of, compiler_options=compiler_options)(dynamic)
        return eqx.combine(arrays, rest[0])

    return call


def subjaxprs(eqn: Any) -> Any:
    """The jaxprs in an equation's parameters (a scan's body, a `cond`'s branches, ...)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def primitive_counts(jaxpr: Any) -> collections.Counter[str]:
    """How many equations of each primitive `jaxpr` holds, its nested jaxprs' included."""
    counts: collections.Counter[str] = collections.Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in subjaxprs(eqn):
            counts += primitive_counts(sub)
    return counts


def _norm(x) -> float:
    return float(np.linalg.norm(np.asarray(x, dtype=np.float64).ravel()))


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ (‖a − b‖ when b is zero), computed in float64 on the host."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    nb = _norm(b)
    diff = _norm(a - b)
    return diff / nb if nb > 0 else diff


def assert_tree_allclose(a, b, rtol: float | None = None) -> None:
    """Assert equality (see `tree_allclose`), naming the first array that differs.

    Boxes are looked through and sharded arrays gathered first.
    """
    a = es.unbox(es.gather(a))
    b = es.unbox(es.gather(b))
    la, ta = jax.tree_util.tree_flatten_with_path(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree_util.tree_flatten_with_path(eqx.filter(b, eqx.is_array))
    assert ta == tb, f"structures differ:\n{ta}\n{tb}"
    for (path, x), (_, y) in zip(la, lb):
        tol = rtol
        if tol is None:
            low = jnp.dtype(x.dtype) == jnp.bfloat16 or jnp.dtype(y.dtype) == jnp.bfloat16
            tol = BF16_RTOL if low else FP32_RTOL
        where = jax.tree_util.keystr(path)
        assert x.shape == y.shape, f"{where}: shape {x.shape} vs {y.shape}"
        err = rel_err(x, y)
        assert err <= tol, f"{where}: relative error {err:.3e} > {tol:.0e}"


def tree_bytes(tree) -> int:
    """The bytes of the arrays of `tree` (boxes looked through), whole (global) arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(es.unbox(tree)) if eqx.is_array(x))


def dot_result_shapes(text: str) -> list[str]:
    """The result shapes of the dots of an optimized HLO module (`f32[64,128]`), one per dot."""
    return re.findall(r"= (\w+\[[\d,]*\])\{?[^ ]* dot\(", text)


def one_device_training(model, trained, optimizer, batches, *, clip_norm: float | None = None):
    """Plain JAX and optax on one device, the reference of a step that trains part of a
    model: the floating arrays `trained` marks (an `eqx.partition` filter spec) trained,
    the rest constants of `model.loss(batch)[0]`. `(losses, final model)`."""
    import optax

    train, frozen = eqx.partition(model, trained)
    train = eqx.filter(train, eqx.is_inexact_array)
    frozen = eqx.combine(frozen, eqx.filter(model, lambda x: not eqx.is_inexact_array(x)))
    opt_state = optimizer.init(train)

    @eqx.filter_jit
    def one(train, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(lambda t: eqx.combine(t, frozen).loss(batch)[0])(train)
        if clip_norm is not None:
            grads = optax.clip_by_global_norm(clip_norm).update(grads, optax.EmptyState())[0]
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return loss, optax.apply_updates(train, updates), opt_state

    losses = []
    for batch in batches:
        loss, train, opt_state = one(train, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), eqx.combine(train, frozen)


def tree_allclose(a, b, rtol: float | None = None) -> bool:
    """Equality: per array ‖a−b‖/‖b‖ ≤ rtol (1e-5 fp32, 1e-2 bf16); same structure."""
    try:
        assert_tree_allclose(a, b, rtol)
    except AssertionError:
        return False
    return True


def jax_array(box: es.Sharded) -> jax.Array:
    """The array in `box`, asserted to be a `jax.Array` (a box may also hold a NumPy array)."""
    assert isinstance(box.value, jax.Array), type(box.value)
    return box.value


def perturb(tree, key, scale: float = 0.1):
    """`tree` with Gaussian noise (`scale`) added to every floating array.

    Makes zero-initialised biases, LoRA factors and unit norms non-trivial, so a test
    compares values that could differ.
    """
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    out = [
        x + scale * jax.random.normal(k, x.shape, x.dtype) if eqx.is_inexact_array(x) else x
        for x, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, out)


def _spec_axes(spec: P, mesh) -> tuple[str, ...]:
    axes = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
    return tuple(a for a in mesh.axis_names if a in axes)


def _split_inputs(inputs: Mapping[str, Any]):
    float_in = {k: v for k, v in inputs.items() if eqx.is_inexact_array(es.unbox(v))}
    other_in = {k: v for k, v in inputs.items() if k not in float_in}
    return float_in, other_in


def sharded_value_and_grad(apply: Callable, out_specs: Mapping[str, P], mesh):
    """The jitted sharded step of `check_against_single_device` on `mesh`.

    `step(model, float_inputs, other_inputs, probes) -> (outs, (model_grads, input_grads))`:
    inside `filter_shard_map`, `apply(model, inputs)` on the local blocks, the loss
    `Σ_n <out_n, probe_n>` summed over the axes each output is split over (the global
    loss), and its gradient with respect to the model and the floating inputs. Outputs
    leave boxed with `out_specs`.
    """

    def body(model, float_in, other_in, probes):
        def loss(diff):
            model, float_in = diff
            outs = apply(model, es.unbox({**float_in, **other_in}))
            total = 0.0
            for name, out in outs.items():
                local = jnp.sum(out * probes[name].value)
                axes = _spec_axes(out_specs[name], mesh)
                total = total + (jax.lax.psum(local, axes) if axes else local)
            return total, outs

        (_, outs), grads = eqx.filter_value_and_grad(loss, has_aux=True)((model, float_in))
        return {n: es.Sharded(o, out_specs[n]) for n, o in outs.items()}, grads

    return eqx.filter_jit(es.filter_shard_map(body, mesh=mesh))


def check_against_single_device(
    build: Callable[[], Any] | Any,
    apply: Callable[[Any, dict[str, Any]], dict[str, Any]],
    inputs: Mapping[str, Any],
    layouts: Sequence[Any],
    *,
    out_specs: Mapping[str, P],
    reference: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None,
    rtol: float | None = None,
    seed: int = 0,
) -> list[tuple[Any, Any]]:
    """Check a sharded computation, values and gradients, against one device on each layout.

    **Arguments:**

    - `build`: the model (global arrays; boxes carry the specs it is split by), or a
      function of no arguments that returns it.
    - `apply`: `apply(model, inputs) -> {name: output}`; run inside `filter_shard_map`
      on the local blocks.
    - `inputs`: `{name: es.Sharded(global array, spec)}`; the floating ones are
      differentiated too.
    - `layouts`: layout strings (`"dp=2,tp=4"`) or meshes.
    - `out_specs`: how each output of `apply` is split.
    - `reference`: the single-device oracle, `reference(model, inputs) -> {name:
      output}` on global arrays (default: `apply` outside `shard_map`, the layers' own
      single-device self).
    - `rtol`: the tolerance (default: 1e-5 fp32, 1e-2 bf16).

    The loss is `Σ_n <out_n, probe_n>` with random probes: outputs, the model's
    gradient (gathered) and the floating inputs' gradients must equal the reference's.

    **Returns:**

    Per layout, the sharded `(outputs, (model_grads, input_grads))`, for further
    assertions.
    """
    model = build() if callable(build) and not isinstance(build, eqx.Module) else build
    reference = apply if reference is None else reference
    float_in, other_in = _split_inputs(inputs)
    plain_other = es.unbox(other_in)

    def ref_loss(diff, probes):
        model, float_in = diff
        outs = reference(model, {**float_in, **plain_other})
        return sum(jnp.sum(outs[n] * probes[n]) for n in outs), outs

    shapes = jax.eval_shape(lambda: reference(model, es.unbox(inputs)))
    key = jax.random.key(seed)
    probes = {
        n: jax.random.normal(jax.random.fold_in(key, i), s.shape, s.dtype)
        for i, (n, s) in enumerate(sorted(shapes.items()))
    }
    (_, ref_outs), ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(ref_loss, has_aux=True))(
        (model, es.unbox(float_in)), probes
    )
    results = []
    for layout in layouts:
        mesh = es.make_mesh(layout) if isinstance(layout, str) else layout
        step = sharded_value_and_grad(apply, out_specs, mesh)
        boxed_probes = {n: es.Sharded(p, out_specs[n]) for n, p in probes.items()}
        outs, grads = step(model, float_in, other_in, boxed_probes)
        where = f"layout {layout}"
        try:
            assert_tree_allclose(es.unbox(outs), ref_outs, rtol)
            assert_tree_allclose(grads[0], ref_grads[0], rtol)
            assert_tree_allclose(es.unbox(grads[1]), ref_grads[1], rtol)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        results.append((outs, grads))
    return results
