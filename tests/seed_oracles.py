"""Minimal plain-JAX oracles of the two reference libraries, for the seed-fidelity tests.

Each function here is written from the reference implementation it names:

- `xlstm_jax/distributed/{tensor_parallel,data_parallel,pipeline_parallel}.py` of
  NX-AI/xlstm-jax at commit 04d514eaede5d76cce46db691c38e7df2b0f8c52;
- `ml/models/parallel.py` of maximilianmbeck/ml-starter at commit
  72a03fd86c1eb7363e59a1b59f157bce3fa4f875 (its `init_` from `ml/models/init.py` at
  ce41300e81c7f395c05019994ffb118116cc6dfb).

They use only `jax.lax` collectives over one mesh axis, in the references' own order
of operations, and nothing from equishard. Flax's parameter collections are replaced by
explicit arrays; torch's process-group reductions by `jax.lax` collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _size(axis_name: str) -> int:
    return jax.lax.psum(1, axis_name)


def _perm(n: int, up: bool) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)] if up else [(j, (j - 1) % n) for j in range(n)]


# ----------------------------------------------------------------- tensor_parallel.py


def async_gather(x, axis_name, shift_up=True):
    n = _size(axis_name)
    ps, p = [x], x
    for _ in range(1, n):
        p = jax.lax.ppermute(p, axis_name, perm=_perm(n, shift_up))
        ps.append(p)
    return ps


def async_gather_bidirectional(x, axis_name, shift_up=True):
    n = _size(axis_name)
    ps_up, ps_down, p_up, p_down = [], [], x, x
    for i in range(1, n):
        if i % 2 == 0:
            p_down = jax.lax.ppermute(p_down, axis_name, perm=_perm(n, False))
            ps_down.append(p_down)
        else:
            p_up = jax.lax.ppermute(p_up, axis_name, perm=_perm(n, True))
            ps_up.append(p_up)
    return [x] + ps_up + ps_down[::-1] if shift_up else [x] + ps_down + ps_up[::-1]


def async_gather_split(x, axis_name):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return async_gather(x1, axis_name, shift_up=True) + async_gather(x2, axis_name, shift_up=False)


def async_scatter(xs, axis_name, shift_up=True):
    n = _size(axis_name)
    assert len(xs) == n
    y = xs[0]
    for x in xs[1:]:
        y = jax.lax.ppermute(y, axis_name, perm=_perm(n, shift_up)) + x
    return y


def async_scatter_split(xs, axis_name):
    n = _size(axis_name)
    assert len(xs) == n
    half = lambda x: (x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :])
    y_up, y_down = half(xs[0])
    for x in xs[1:]:
        y_up = jax.lax.ppermute(y_up, axis_name, perm=_perm(n, True))
        y_down = jax.lax.ppermute(y_down, axis_name, perm=_perm(n, False))
        x_up, x_down = half(x)
        y_up, y_down = y_up + x_up, y_down + x_down
    return jnp.concatenate([y_up, y_down], axis=-1)


# ----------------------------------------------------------------- data_parallel.py


def shard_dimension(local_shape, names, axis_size, min_weight_size):
    """The dimension `shard_params` splits (None: left alone), from its rules: size of the
    block in hand `<= min_weight_size` stays; else the largest dimension (ties: the later,
    `np.argsort(shape)[::-1]`) divisible by the axis size and not yet named."""
    if int(np.prod(local_shape)) <= min_weight_size:
        return None
    for i in np.argsort(local_shape)[::-1]:
        if local_shape[i] % axis_size == 0 and names[i] is None:
            return int(i)
    return None


def gather_array_with_mean_grads(x, axis, axis_name, gather_dtype=None, grad_scatter_dtype=None):
    n = _size(axis_name)
    param_dtype = x.dtype
    grad_scatter_dtype = param_dtype if grad_scatter_dtype is None else grad_scatter_dtype

    @jax.custom_gradient
    def f(x):
        def grad_fn(g):
            g = g.astype(grad_scatter_dtype)
            g = jax.lax.psum_scatter(g, axis_name, scatter_dimension=axis, tiled=True) / n
            return g.astype(param_dtype)

        if gather_dtype is not None:
            x = x.astype(gather_dtype)
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True), grad_fn

    gathered: jax.Array = f(x)  # pyright: ignore[reportAssignmentType] (custom_gradient)
    return gathered


# ----------------------------------------------------------------- pipeline_parallel.py


def execute_pipeline_step(module, state, input, *args, model_axis_name, **kwargs):
    n = _size(model_axis_name)
    stage = jax.lax.axis_index(model_axis_name)
    state = jnp.where(stage == 0, input, state)
    state = module(state, *args, **kwargs)
    output = jnp.where(stage == n - 1, state, jnp.zeros_like(state))
    state = jax.lax.ppermute(state, model_axis_name, perm=_perm(n, True))
    return state, output


def execute_pipeline(module, x, *args, num_microbatches, model_axis_name, **kwargs):
    n = _size(model_axis_name)
    micro = x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])
    inputs = jnp.concatenate([micro, jnp.zeros((n - 1, *micro.shape[1:]), micro.dtype)], axis=0)

    def body(state, inp):
        return execute_pipeline_step(module, state, inp, *args, model_axis_name=model_axis_name, **kwargs)

    _, outputs = jax.lax.scan(body, jnp.zeros_like(micro[0]), inputs)
    return jnp.concatenate(outputs[-num_microbatches:], axis=0)


# ----------------------------------------------------------------- ml/models/parallel.py
# torch.autograd.Functions as custom VJPs; `mp.reduce` is an all-reduce with `op`,
# `mp.split` narrows to this rank's slice, `mp.gather` concatenates the all-gather.

_REDUCE = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _split(x, axis_name, dim):
    n = _size(axis_name)
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * size, size, axis=dim)


def mp_copy(x, op, axis_name):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (_REDUCE[op](g, axis_name),))
    return f(x)


def mp_reduce(x, op, axis_name):
    @jax.custom_vjp
    def f(x):
        return _REDUCE[op](x, axis_name)

    f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))
    return f(x)


def mp_scatter(x, dim, axis_name):
    @jax.custom_vjp
    def f(x):
        return _split(x, axis_name, dim)

    f.defvjp(lambda x: (f(x), None), lambda _, g: (jax.lax.all_gather(g, axis_name, axis=dim, tiled=True),))
    return f(x)


def mp_gather(x, dim, axis_name):
    @jax.custom_vjp
    def f(x):
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    f.defvjp(lambda x: (f(x), None), lambda _, g: (_split(g, axis_name, dim),))
    return f(x)


def sync_gradients(grads_and_names, axis_names):
    """`sync_gradients` on `(value, names)` pairs: replicated over all axes -> pmean over
    all; partitioned -> pmean over the axes its names leave out (none: unchanged)."""
    out = {}
    for k, (g, names) in grads_and_names.items():
        replicated = [a for a in axis_names if a not in names]
        out[k] = jax.lax.pmean(g, axis_name=tuple(replicated)) if replicated else g
    return out
