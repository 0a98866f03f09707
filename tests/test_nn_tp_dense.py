"""ModelParallelismWrapper: built inside and outside shard_map, its copies and mask.

TPDense / TPAsyncDense are tested in `test_seed_fidelity_tp_dense.py` (against the
single-device layer and an oracle of the xLSTM library).
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.nn import ModelParallelismWrapper

from .helpers import assert_tree_allclose, check_against_single_device

B, T, D = 2, 4, 8


def make_wrapper(n, key):
    return ModelParallelismWrapper(
        lambda key: eqx.nn.Linear(D, 4, key=key), "tp", mask_except_model_idx=n - 1, axis_size=n, key=key
    )


def apply(wrapper, xs):
    """Each device's own copy on its batch: f32[B/dp, T, D] -> f32[1, B/dp, T, 4]."""
    return {"y": jax.vmap(jax.vmap(wrapper.local_module()))(xs["x"])[None]}


def reference(wrapper, xs):
    """Every copy on the whole batch, on one device: f32[n, B, T, 4]."""
    copies = es.unbox(wrapper.module)
    return {"y": eqx.filter_vmap(lambda m: jax.vmap(jax.vmap(m))(xs["x"]))(copies)}


@pytest.mark.parametrize("layout", ["dp=1,tp=2", "dp=2,tp=4"])
def test_wrapper_equals_its_copies_on_one_device(layout):
    mesh = es.make_mesh(layout)
    wrapper = make_wrapper(mesh.shape["tp"], jax.random.key(11))
    x = jax.random.normal(jax.random.key(12), (B, T, D))
    check_against_single_device(
        wrapper, apply, {"x": es.Sharded(x, P("dp"))}, [mesh], out_specs={"y": P("tp", "dp")}, reference=reference
    )


def test_wrapper_built_inside_shard_map_equals_built_outside():
    mesh = es.make_mesh("tp=4")
    key = jax.random.key(5)
    outside = make_wrapper(4, key)
    inside = es.filter_shard_map(
        lambda k: ModelParallelismWrapper(lambda key: eqx.nn.Linear(D, 4, key=key), "tp", mask_except_model_idx=3, key=k),
        mesh=mesh,
    )(key)
    assert es.specs_of(inside) == es.specs_of(outside)
    assert_tree_allclose(inside, outside)
    # The copies differ (split_rngs), and all but copy 3 start at zero.
    w = np.asarray(outside.module.weight.value)
    assert np.abs(w[3]).sum() > 0 and np.abs(w[:3]).sum() == 0
    same = ModelParallelismWrapper(lambda key: eqx.nn.Linear(D, 4, key=key), "tp", split_rngs=False, axis_size=4, key=key)
    w = np.asarray(same.module.weight.value)
    np.testing.assert_array_equal(w[0], w[1])
    split = ModelParallelismWrapper(lambda key: eqx.nn.Linear(D, 4, key=key), "tp", axis_size=4, key=key)
    # The xLSTM library's order and names build the same wrapper.
    reference_order = ModelParallelismWrapper(
        model_axis_name="tp", module_fn=lambda key: eqx.nn.Linear(D, 4, key=key), axis_size=4, key=key
    )
    assert_tree_allclose(reference_order, split)
    assert_tree_allclose(ModelParallelismWrapper("tp", lambda key: eqx.nn.Linear(D, 4, key=key), axis_size=4, key=key), split)
    assert not np.array_equal(np.asarray(split.module.weight.value)[0], np.asarray(split.module.weight.value)[1])


def test_wrapper_configuration_errors():
    key = jax.random.key(0)
    with pytest.raises(es.LayerConfigError, match=r"ModelParallelismWrapper: .*pass axis_size"):
        ModelParallelismWrapper(lambda key: eqx.nn.Linear(D, 4, key=key), "tp", key=key)
    with pytest.raises(es.LayerConfigError, match=r"ModelParallelismWrapper: mask_except_model_idx=4"):
        ModelParallelismWrapper(lambda key: eqx.nn.Linear(D, 4, key=key), "tp", 4, axis_size=4, key=key)
