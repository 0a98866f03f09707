"""The HLO collective reader: kinds, group sizes, shapes, bytes and trip counts.

Real programs are compiled on the 8 simulated CPU devices; literal HLO snippets cover the
forms XLA:CPU never prints (iota and mesh-axes replica groups on the other JAX version,
async pairs, ragged all-to-all, loops without a known trip count).
"""

import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.report import (
    CollectiveOp,
    collective_bytes,
    collective_table,
    count_collectives,
    read_collectives,
)

F32 = 4


def _compile(fn, mesh, in_specs, out_specs, *shapes, dtype=jnp.float32):
    """Compile `shard_map(fn)` for global inputs of the given shapes; no data is made."""
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return mapped.lower(*(jax.ShapeDtypeStruct(s, dtype) for s in shapes)).compile()


def _only(ops, kind):
    """The single op of the program, asserting that it is of `kind`."""
    assert [op.kind for op in ops] == [kind], [str(op) for op in ops]
    return ops[0]


# ------------------------------------------------------------------ compiled programs


@pytest.mark.parametrize(
    "layout, axis, n",
    [("x=8", "x", 8), ("a=4,b=2", "b", 2), ("a=4,b=2", "a", 4), ("a=2,b=2,c=2", ("a", "c"), 4)],
)
def test_all_gather(layout, axis, n):
    mesh = es.make_mesh(layout)
    all_axes = tuple(mesh.axis_names)
    compiled = _compile(
        lambda x: jax.lax.all_gather(x, axis, tiled=True),
        mesh, P(all_axes), P(all_axes), (64, 16),
    )
    op = _only(read_collectives(compiled), "all-gather")
    # f32[64/8, 16] local -> f32[64/8 * n, 16] gathered
    assert op.group_size == n
    assert op.operand_shapes == (("f32", (8, 16)),)
    assert op.result_shapes == (("f32", (8 * n, 16)),)
    assert op.count == 1
    assert op.bytes_per_device == (n - 1) / n * 8 * n * 16 * F32
    assert op.total_bytes == op.bytes_per_device


@pytest.mark.parametrize("layout, axis, n", [("x=8", "x", 8), ("a=4,b=2", ("a", "b"), 8), ("a=4,b=2", "a", 4)])
def test_reduce_scatter(layout, axis, n):
    mesh = es.make_mesh(layout)
    compiled = _compile(
        lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
        mesh, P(), P(axis), (64, 16),
    )
    op = _only(read_collectives(compiled), "reduce-scatter")
    assert op.group_size == n
    assert op.operand_shapes == (("f32", (64, 16)),)
    assert op.result_shapes == (("f32", (64 // n, 16)),)
    assert op.bytes_per_device == (n - 1) / n * 64 * 16 * F32


def test_all_reduce_tuple_and_2d_groups():
    # psum of two arrays over "b" of a (4, 2) mesh: one combined, tuple-shaped all-reduce.
    mesh = es.make_mesh("a=4,b=2")
    compiled = _compile(
        lambda x, y: jax.lax.psum((x, y), "b"),
        mesh, (P("b"), P(("a", "b"))), (P(), P("a")), (64, 16), (8, 4),
    )
    op = _only(read_collectives(compiled), "all-reduce")
    assert op.group_size == 2
    # f32[64/2, 16] and f32[8/8, 4]
    assert op.operand_shapes == (("f32", (32, 16)), ("f32", (1, 4)))
    assert op.result_shapes == op.operand_shapes
    assert op.bytes_per_device == 2 * (2 - 1) / 2 * (32 * 16 + 1 * 4) * F32


def test_all_reduce_single_and_full_mesh():
    mesh = es.make_mesh("a=2,b=2,c=2")
    compiled = _compile(
        lambda x: jax.lax.psum(x, ("a", "b", "c")),
        mesh, P(("a", "b", "c")), P(), (64, 16),
    )
    op = _only(read_collectives(compiled), "all-reduce")
    assert op.group_size == 8
    assert op.operand_shapes == (("f32", (8, 16)),)
    assert op.bytes_per_device == 2 * 7 / 8 * 8 * 16 * F32


@pytest.mark.parametrize("layout, axis, n", [("x=8", "x", 8), ("a=4,b=2", "a", 4), ("a=2,b=2,c=2", ("b", "c"), 4)])
def test_all_to_all(layout, axis, n):
    mesh = es.make_mesh(layout)
    compiled = _compile(
        lambda x: jax.lax.all_to_all(x, axis, 0, 1, tiled=True),
        mesh, P(axis), P(axis), (64, 16),
    )
    op = _only(read_collectives(compiled), "all-to-all")
    local = 64 // n * 16
    assert op.group_size == n
    # XLA:CPU rewrites the array all-to-all into its tuple form (n slices); either way the
    # operands hold the local block.
    assert sum(math.prod(s) for _, s in op.operand_shapes) == local
    assert all(dtype == "f32" for dtype, _ in op.operand_shapes + op.result_shapes)
    assert op.bytes_per_device == (n - 1) / n * local * F32


@pytest.mark.parametrize(
    "layout, axis, n",
    [("x=8", "x", 8), ("a=4,b=2", "b", 2), ("a=4,b=2", ("a", "b"), 8), ("a=2,b=2,c=2", "c", 2)],
)
def test_ppermute(layout, axis, n):
    mesh = es.make_mesh(layout)
    perm = [(i, (i + 1) % n) for i in range(n)]
    all_axes = tuple(mesh.axis_names)
    compiled = _compile(
        lambda x: jax.lax.ppermute(x, axis, perm),
        mesh, P(all_axes), P(all_axes), (64, 16),
    )
    op = _only(read_collectives(compiled), "collective-permute")
    assert op.group_size == n
    assert op.operand_shapes == op.result_shapes == (("f32", (8, 16)),)
    assert op.bytes_per_device == 8 * 16 * F32


def _ring(x, axis="x", n=8):
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def test_scan_multiplies_by_trip_count():
    def fn(x):
        return jax.lax.scan(lambda c, _: (_ring(c), None), x, None, length=5)[0]

    ops = read_collectives(_compile(fn, es.make_mesh("x=8"), P("x"), P("x"), (64, 16)))
    op = _only(ops, "collective-permute")
    assert op.count == 5
    assert op.computation != ""
    assert op.total_bytes == 5 * 8 * 16 * F32
    assert count_collectives(ops) == {"collective-permute": 5}
    assert collective_bytes(ops) == 5 * 8 * 16 * F32


def test_nested_scans_multiply():
    def inner(c, _):
        return _ring(c), None

    def outer(c, _):
        c = jax.lax.scan(inner, c, None, length=3)[0]
        return c + jax.lax.psum(c, "x"), None

    def fn(x):
        return jax.lax.scan(outer, x, None, length=4)[0]

    mesh = es.make_mesh("x=8")
    ops = read_collectives(_compile(fn, mesh, P("x"), P("x"), (64, 16)))
    assert count_collectives(ops) == {"collective-permute": 12, "all-reduce": 4}
    block = 8 * 16 * F32
    assert collective_bytes(ops, "collective-permute") == 12 * block
    assert collective_bytes(ops, ["all-reduce"]) == 4 * 2 * 7 / 8 * block
    assert collective_bytes(ops) == 12 * block + 4 * 2 * 7 / 8 * block


def test_fori_loop_and_cond():
    def fn(x, p):
        x = jax.lax.fori_loop(0, 6, lambda i, c: _ring(c) * 2.0, x)
        return jax.lax.cond(p[0] > 0, lambda y: jax.lax.psum(y, "x"), lambda y: y * 8.0, x)

    mesh = es.make_mesh("x=8")
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False))
    lowered = mapped.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    ops = read_collectives(lowered)  # a Lowered is compiled by the reader
    assert count_collectives(ops) == {"collective-permute": 6, "all-reduce": 1}
    # The same text read as a string gives the same ops.
    assert read_collectives(lowered.compile().as_text()) == ops


def test_xla_cpu_promotes_bf16_collectives():
    # Documented in the module: XLA:CPU runs bf16 collectives in f32 (f16 stays f16).
    mesh = es.make_mesh("x=8")
    ops = read_collectives(
        _compile(_ring, mesh, P("x"), P("x"), (64, 16), dtype=jnp.bfloat16)
    )
    op = _only(ops, "collective-permute")
    assert op.operand_shapes == (("f32", (8, 16)),)
    ops = read_collectives(
        _compile(lambda x: jax.lax.psum(x, "x"), mesh, P("x"), P(), (64, 16), dtype=jnp.float16)
    )
    op = _only(ops, "all-reduce")
    assert op.operand_shapes == (("f16", (8, 16)),)
    assert op.bytes_per_device == 2 * 7 / 8 * 8 * 16 * 2


def test_report_strings():
    ops = read_collectives(
        _compile(lambda x: jax.lax.psum(x, "x"), es.make_mesh("x=8"), P("x"), P(), (64, 16))
    )
    text = str(ops[0])
    assert "all-reduce" in text and "n=8" in text and "f32[8,16]" in text and "896 B" in text
    table = collective_table(ops)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["kind", "n", "count"]
    assert lines[2].split()[:3] == ["all-reduce", "8", "1"]
    assert lines[-1].split()[0] == "total"
    assert collective_table([]).splitlines()[-1].split() == ["total", "0", "0", "B"]


# --------------------------------------------------------------------- literal HLO text


def _module(body: str, header: str = "HloModule m, num_partitions=8") -> str:
    return header + "\n\n" + body


_ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
"""


@pytest.mark.parametrize(
    "groups, n",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", 2),
        ("{{0,2,4,6},{1,3,5,7}}", 4),
        ("[2,4]<=[8]", 4),
        ("[4,2]<=[2,4]T(1,0)", 2),
        ("[1,8]<=[8]", 8),
        ("mesh['a'=4,'b'=2] {'a'}", 4),
        ("mesh['a'=2,'b'=2,'c'=2] {'a','c'}", 4),
        ("mesh[a=4,b=2] {b}", 2),
        ("mesh['a'=8] {'a':(2)4}", 4),
        ("mesh['a'=2,'b'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'b'}", 4),
        ("{}", 8),
    ],
)
def test_replica_group_formats(groups, n):
    text = _module(
        _ADD
        + f"""
ENTRY %main (p: f32[8,16]) -> f32[8,16] {{
  %p = f32[8,16]{{1,0}} parameter(0)
  ROOT %ar = f32[8,16]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""
    )
    op = _only(read_collectives(text), "all-reduce")
    assert op.group_size == n
    assert op.computation == "main"
    assert op.name == "ar"
    assert op.bytes_per_device == 2 * (n - 1) / n * 8 * 16 * F32


def test_old_style_operands_with_shapes():
    # Older printers put each operand's shape before its name.
    text = _module(
        """ENTRY %main (p: bf16[8,16]) -> bf16[16,16] {
  %p = bf16[8,16]{1,0} parameter(0)
  ROOT %ag = bf16[16,16]{1,0} all-gather(bf16[8,16]{1,0} %p), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
}
"""
    )
    op = _only(read_collectives(text), "all-gather")
    assert op.operand_shapes == (("bf16", (8, 16)),)
    assert op.bytes_per_device == 1 / 2 * 16 * 16 * 2


_ASYNC = """ENTRY %main (p: f32[8,16], q: f32[64,16], r: bf16[4]) -> (f32[64,16], f32[8,16], f32[8,16], (f32[64,16], bf16[4])) {
  %p = f32[8,16]{1,0} parameter(0)
  %q = f32[64,16]{1,0} parameter(1)
  %r = bf16[4]{0} parameter(2)
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[64,16]{1,0} all-gather-done(%ags)
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %cpd = f32[8,16]{1,0} collective-permute-done(%cps)
  %ars = (f32[64,16]{1,0}, bf16[4]{0}) all-reduce-start(%q, %r), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ard = (f32[64,16]{1,0}, bf16[4]{0}) all-reduce-done(%ars)
  %rss = ((f32[64,16]{1,0}), f32[8,16]{1,0}) async-start(%q), calls=%rs_async
  %rsd = f32[8,16]{1,0} async-done(%rss), calls=%rs_async
  ROOT %t = (f32[64,16]{1,0}, f32[8,16]{1,0}, f32[8,16]{1,0}, (f32[64,16]{1,0}, bf16[4]{0})) tuple(%agd, %cpd, %rsd, %ard)
}
"""

_RS_ASYNC = """%rs_async (x: f32[64,16]) -> f32[8,16] {
  %x = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[8,16]{1,0} reduce-scatter(%x), channel_id=4, replica_groups=mesh['x'=8] {'x'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}
"""


def test_async_pairs_count_once():
    ops = read_collectives(_module(_ADD + _RS_ASYNC + _ASYNC))
    assert [op.kind for op in ops] == ["reduce-scatter", "all-gather", "collective-permute", "all-reduce"]
    rs, ag, cp, ar = ops
    assert (rs.computation, rs.count, rs.group_size) == ("rs_async", 1, 8)
    assert rs.bytes_per_device == 7 / 8 * 64 * 16 * F32
    assert ag.result_shapes == (("f32", (64, 16)),)
    assert ag.operand_shapes == (("f32", (8, 16)),)
    assert ag.bytes_per_device == 7 / 8 * 64 * 16 * F32
    assert cp.group_size == 4  # two rings of four
    assert cp.result_shapes == (("f32", (8, 16)),)
    assert cp.bytes_per_device == 8 * 16 * F32
    assert ar.operand_shapes == (("f32", (64, 16)), ("bf16", (4,)))
    assert ar.bytes_per_device == 2 * 7 / 8 * (64 * 16 * F32 + 4 * 2)
    assert count_collectives(ops) == {
        "reduce-scatter": 1,
        "all-gather": 1,
        "collective-permute": 1,
        "all-reduce": 1,
    }


_HANDWRITTEN = """
  HloModule handwritten, replica_count=4

  add.1 {
    x = f32[] parameter(0)
    y = f32[] parameter(1)
    ROOT add = f32[] add(x, y)
  }

  ENTRY entry {
    input = f32[8,256] parameter(0)
    ag-start = (f32[8,256], f32[32,256]) all-gather-start(
      f32[8,256] input), replica_groups={{0,1,2,3}}, dimensions={0},
      metadata={op_type="AllGather" op_name="ag0(body=x)"}
    ag-done = f32[32,256] all-gather-done(
      (f32[8,256], f32[32,256]) ag-start)
    rs-start = ((f32[32,256]), (f32[8,256])) reduce-scatter-start(ag-done), replica_groups={}, dimensions={0}, to_apply=add.1
    ROOT ar = f32[8,256] all-reduce(input), replica_groups={}, to_apply=add.1
  }
"""


def test_handwritten_text():
    # XLA's own tests write HLO without `%`, indented, with instructions over several
    # lines; a -start whose -done is missing still gives its results.
    ag, rs, ar = read_collectives(_HANDWRITTEN)
    assert (ag.kind, ag.group_size, ag.computation, ag.name) == ("all-gather", 4, "entry", "ag-start")
    assert ag.operand_shapes == (("f32", (8, 256)),)
    assert ag.result_shapes == (("f32", (32, 256)),)
    assert ag.bytes_per_device == 3 / 4 * 32 * 256 * F32
    assert (rs.kind, rs.group_size) == ("reduce-scatter", 4)  # {}: every replica
    assert rs.operand_shapes == (("f32", (32, 256)),)
    assert rs.result_shapes == (("f32", (8, 256)),)
    assert rs.bytes_per_device == 3 / 4 * 32 * 256 * F32
    assert (ar.kind, ar.group_size) == ("all-reduce", 4)


# Shaped like XLA:GPU output for 8 H100s (JAX 0.11, compiled without devices from a
# topology description): a psum in a scan becomes an all-reduce-start/-done pair whose
# start returns ((operands), result); lone collectives stay synchronous.
_GPU = """HloModule jit_step, is_scheduled=true, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

%step_body (param: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %param = (s32[], f32[8,16]{1,0}) parameter(0), metadata={op_name="jit(step)/shard_map" scheduling_name="param"}
  %v = f32[8,16]{1,0} get-tuple-element(%param), index=1
  %ars = ((f32[8,16]{1,0}), f32[8,16]{1,0}) all-reduce-start(%v), channel_id=2, replica_groups=mesh['x'=8] {'x'}, use_global_device_ids=true, to_apply=%sum, output_to_operand_aliasing={{1}: (0, {})}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %i = s32[] get-tuple-element(%param), index=0
  %ard = f32[8,16]{1,0} all-reduce-done(%ars), metadata={scheduling_name="all-reduce-done"}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ard)
}

%step_cond (param.1: (s32[], f32[8,16])) -> pred[] {
  %param.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %limit = s32[] constant(5)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

ENTRY %main.2_spmd (p: f32[8,16]) -> (f32[8,16], f32[64,16], f32[8,16]) {
  %p = f32[8,16]{1,0} parameter(0), sharding={devices=[8,1]<=[8]}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %p)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%step_cond, body=%step_body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  %ag = f32[64,16]{1,0} all-gather(%out), channel_id=1, replica_groups=mesh['x'=8] {'x'}, dimensions={0}, use_global_device_ids=true, backend_config={"collective_backend_config":{"is_sync":true}}
  %lone = ((f32[8,16]{1,0}), f32[8,16]{1,0}) all-reduce-start(%p), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%sum
  ROOT %r = (f32[8,16]{1,0}, f32[64,16]{1,0}, f32[8,16]{1,0}) tuple(%out, %ag, %p)
}
"""


def test_gpu_style_async_in_loop():
    ar, ag, lone = read_collectives(_GPU)
    assert (ar.kind, ar.group_size, ar.count, ar.computation) == ("all-reduce", 8, 5, "step_body")
    assert ar.operand_shapes == ar.result_shapes == (("f32", (8, 16)),)
    assert ar.total_bytes == 5 * 2 * 7 / 8 * 8 * 16 * F32
    assert (ag.kind, ag.group_size, ag.count) == ("all-gather", 8, 1)
    # A start with no done in the text: the results follow the operands' tuple.
    assert (lone.kind, lone.group_size) == ("all-reduce", 4)
    assert lone.result_shapes == (("f32", (8, 16)),)
    assert lone.bytes_per_device == 2 * 3 / 4 * 8 * 16 * F32
    assert count_collectives([ar, ag, lone]) == {"all-reduce": 6, "all-gather": 1}


def test_ragged_all_to_all():
    text = _module(
        """ENTRY %main (x: f32[32,16], out: f32[64,16], off: s32[8], size: s32[8]) -> f32[64,16] {
  %x = f32[32,16]{1,0} parameter(0)
  %out = f32[64,16]{1,0} parameter(1)
  %off = s32[8]{0} parameter(2)
  %size = s32[8]{0} parameter(3)
  ROOT %r = f32[64,16]{1,0} ragged-all-to-all(%x, %out, %off, %size, %off, %size), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
}
"""
    )
    op = _only(read_collectives(text), "ragged-all-to-all")
    assert op.group_size == 8
    assert len(op.operand_shapes) == 6
    assert op.bytes_per_device == 7 / 8 * 32 * 16 * F32


def _loop_module(trip_config: str, direction: str = "LT", limit: int = 7) -> str:
    return _module(
        f"""%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %s = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[8]{{0}} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %cp = f32[8]{{0}} collective-permute(%v), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%next, %cp)
}}

%cmp (a: s32[], b: s32[]) -> pred[] {{
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction={direction}
}}

%cond (s: (s32[], f32[8])) -> pred[] {{
  %s = (s32[], f32[8]{{0}}) parameter(0)
  %n = s32[] constant({limit})
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %c = pred[] fusion(%i, %n), kind=kLoop, calls=%cmp
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{{0}}) tuple(%zero, %x)
  %w = (s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%body{trip_config}
  ROOT %out = f32[8]{{0}} get-tuple-element(%w), index=1
}}
""",
        header="HloModule loop, num_partitions=2",
    )


@pytest.mark.parametrize(
    "config, direction, count",
    [
        (', backend_config={"known_trip_count":{"n":"3"}}', "LT", 3),  # known beats inferred
        ("", "LT", 7),
        ("", "LE", 8),
        (', backend_config={"known_init_step":{"init":"1","step":"2"}}', "LT", 3),
    ],
)
def test_while_trip_count(config, direction, count):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op = _only(read_collectives(_loop_module(config, direction)), "collective-permute")
    assert op.count == count
    assert op.computation == "body"
    assert op.group_size == 2
    assert op.total_bytes == count * 8 * F32


def test_unknown_trip_count_warns_and_counts_once():
    text = _loop_module("").replace("%n = s32[] constant(7)", "%n = s32[] get-tuple-element(%s), index=0")
    with pytest.warns(UserWarning, match="trip count"):
        op = _only(read_collectives(text), "collective-permute")
    assert op.count == 1


def test_dead_computations_and_non_collectives_ignored():
    text = _module(
        _ADD
        + """%unused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%add, metadata={op_name="all-reduce(x)"}
  ROOT %n = f32[8]{0} negate(%f)
}
"""
    )
    assert read_collectives(text) == []


def test_collective_op_is_frozen():
    op = CollectiveOp("all-reduce", 2, (("f32", (4,)),), (("f32", (4,)),), 3, "main", 16.0)
    assert op.total_bytes == 48.0
    with pytest.raises(AttributeError):
        op.count = 1  # pyright: ignore[reportAttributeAccessIssue]
