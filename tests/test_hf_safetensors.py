"""The sharded safetensors reader and the streamed writer (`equishard.train`), on a small
Equinox model with a user-written map."""

import json
import os

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.train import (
    OutTensor,
    Padded,
    Permuted,
    Stacked,
    Tensor,
    Transposed,
    _safetensors,
    load_safetensors,
    write_safetensors,
)

RNG = np.random.default_rng(0)
TENSORS = {
    "fc.weight": RNG.normal(size=(8, 16)).astype(np.float32),  # [out, in]
    "q.weight": RNG.normal(size=(8, 16)).astype(np.float32),
    "k.weight": RNG.normal(size=(8, 16)).astype(np.float32),
    "v.weight": RNG.normal(size=(8, 16)).astype(np.float32),
    "emb.weight": RNG.normal(size=(13, 16)).astype(ml_dtypes.bfloat16),
    "perm.weight": RNG.normal(size=(8, 4)).astype(np.float32),
    "rotary.inv_freq": np.ones(4, np.float32),
}
ORDER = (1, 0, 3, 2, 5, 4, 7, 6)
MAPPING = {
    ".w_in_out": Transposed(Tensor("fc.weight")),  # f32[16, 8]
    ".qkv": Stacked((Tensor("q.weight"), Tensor("k.weight"), Tensor("v.weight"))),  # [3, 8, 16]
    ".emb": Padded(Tensor("emb.weight"), 0, 16),  # [16, 16]
    ".perm": Permuted(Tensor("perm.weight"), 0, ORDER),
}


class Toy(eqx.Module):
    w_in_out: es.Sharded
    qkv: es.Sharded
    emb: es.Sharded
    perm: es.Sharded


def skeleton():
    """The model, abstract (`jax.ShapeDtypeStruct` leaves in their boxes)."""
    return eqx.filter_eval_shape(
        lambda: Toy(
            es.Sharded(jnp.zeros((16, 8)), P("fsdp", "tp")),
            es.Sharded(jnp.zeros((3, 8, 16)), P(None, "tp", "fsdp")),
            es.Sharded(jnp.zeros((16, 16)), P("tp", None)),
            es.Sharded(jnp.zeros((8, 4)), P("tp", None)),
        )
    )


def expected():
    emb = np.zeros((16, 16), np.float32)
    emb[:13] = TENSORS["emb.weight"].astype(np.float32)
    return {
        ".w_in_out": TENSORS["fc.weight"].T,
        ".qkv": np.stack([TENSORS["q.weight"], TENSORS["k.weight"], TENSORS["v.weight"]]),
        ".emb": emb,
        ".perm": TENSORS["perm.weight"][list(ORDER)],
    }


def _write(folder, tensors, max_shard_bytes=2**30):
    out = [OutTensor(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()]
    return write_safetensors(str(folder), out, max_shard_bytes=max_shard_bytes)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    one = tmp_path_factory.mktemp("one")
    two = tmp_path_factory.mktemp("two")
    assert _write(one, TENSORS) == ["model.safetensors"]
    assert len(_write(two, TENSORS, max_shard_bytes=1200)) > 1
    return one, two


@pytest.mark.parametrize("layout", ["fsdp=2,tp=4", "fsdp=1,tp=8", "fsdp=8,tp=1"])
def test_load_fills_every_block_by_slice(folders, layout, monkeypatch):
    mesh = es.make_mesh(layout)
    reads = []
    make_reader = _safetensors._reader

    def counting(infos):
        read = make_reader(infos)

        def wrapped(name, index):
            out = read(name, index)
            reads.append((name, out.size, int(np.prod(infos[name].shape))))
            return out

        return wrapped

    monkeypatch.setattr(_safetensors, "_reader", counting)
    for folder in folders:
        reads.clear()
        model = load_safetensors(skeleton(), MAPPING, str(folder), mesh=mesh, ignore=["rotary.inv_freq"])
        for path, want in expected().items():
            got = _safetensors.model_arrays(model)[path]
            assert got.sharding.spec == _safetensors.array_paths(skeleton())[path][1]
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
        if layout == "fsdp=2,tp=4":
            # fc's [8, 16] is split 4 x 2: its blocks are runs of a few bytes in the file, so
            # one process reads the array once, whole (its blocks' union), in long runs,
            # and places each block from it (an array of long runs: block by block).
            assert [(n, whole) for name, n, whole in reads if name == "fc.weight"] == [(128, 128)]


def test_import_export_round_trip_is_byte_identical(folders, tmp_path):
    model = load_safetensors(
        skeleton(), MAPPING, str(folders[1]), mesh=es.make_mesh("fsdp=2,tp=4"), ignore=["rotary.inv_freq"]
    )
    arrays = _safetensors.model_arrays(model)
    infos = _safetensors.checkpoint_tensors(str(folders[1]))
    shapes = {n: i.shape for n, i in infos.items()}
    out = []
    for path, source in MAPPING.items():
        for name in _safetensors.source_tensors(source):
            dtype = TENSORS[name].dtype
            out.append(OutTensor(name, shapes[name], dtype, lambda s=source, n=name, p=path: _safetensors.tensor_of(s, n, arrays[p], shapes)))
    write_safetensors(str(tmp_path), out)
    again = _safetensors.checkpoint_tensors(str(tmp_path))
    read = _safetensors._reader(again)
    for name, info in again.items():
        full = tuple(slice(0, d) for d in info.shape)
        assert read(name, full).tobytes() == TENSORS[name].tobytes(), name


def test_unused_and_unfilled_are_named_before_reading(folders):
    mapping = dict(MAPPING)
    del mapping[".perm"]
    with pytest.raises(es.CheckpointError) as err:
        load_safetensors(skeleton(), mapping, str(folders[0]), mesh=es.make_mesh("fsdp=8,tp=1"))
    message = str(err.value)
    assert "model array .perm (8, 4) is filled by no tensor" in message
    assert "checkpoint tensor perm.weight (8, 4)" in message
    assert "checkpoint tensor rotary.inv_freq (4,)" in message


def test_bad_folders_get_named_errors(folders, tmp_path):
    mesh = es.make_mesh("fsdp=8,tp=1")
    load = lambda folder, mapping=MAPPING: load_safetensors(  # noqa: E731
        skeleton(), mapping, str(folder), mesh=mesh, ignore=["rotary.inv_freq", "fc.weight"]
    )
    with pytest.raises(es.CheckpointError, match="neither model.safetensors"):
        load(tmp_path)
    # A truncated file.
    bad = tmp_path / "truncated"
    bad.mkdir()
    data = (folders[0] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(es.CheckpointError, match="truncated/model.safetensors is incomplete"):
        load(bad)
    # A file of the index missing, and an index entry missing.
    for what in ("file", "entry"):
        sharded = tmp_path / what
        sharded.mkdir()
        for f in os.listdir(folders[1]):
            (sharded / f).write_bytes((folders[1] / f).read_bytes())
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        if what == "file":
            gone = index["weight_map"]["fc.weight"]
            os.remove(sharded / gone)
            match = f"{gone} does not exist"
        else:
            del index["weight_map"]["q.weight"]
            match = "holds tensor q.weight, which .* does not list"
        (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(es.CheckpointError, match=match):
            load(sharded)
    # A tensor of the wrong shape, and of the wrong dtype.
    with pytest.raises(es.CheckpointError, match=r"model array .w_in_out has shape \(16, 8\) but its tensors q.weight"):
        load(folders[0], {**MAPPING, ".w_in_out": Tensor("q.weight")})
    wrong = tmp_path / "dtype"
    wrong.mkdir()
    _write(wrong, {**TENSORS, "fc.weight": TENSORS["fc.weight"].astype(np.int32)})
    with pytest.raises(es.CheckpointError, match="tensor fc.weight .* has dtype I32"):
        load(wrong)
