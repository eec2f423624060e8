"""Collective byte counts from HLO: hand-written modules, then real programs on 8 CPU devices."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.accounting.hlo import (
    UnknownTripCount,
    axes_spanned,
    collective_bytes,
    collectives,
    replica_groups,
    shape_bytes,
)
from zerojax.accounting.partitioned import compile_partitioned, partitioned_hlo_text

# --- hand-written HLO: each construct the parser must handle --------------------------------

NESTED = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%reduce_grads (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %ar = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
}

%inner_body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %c = f32[256]{0} call(%v), to_apply=%reduce_grads
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %c)
}

%inner_cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%outer_body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %w = (s32[], f32[256]{0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %g = bf16[64,32]{1,0} parameter(1)
  %ag = bf16[512,32]{1,0} all-gather(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %r = (s32[], f32[256]{0}) copy(%w)
}

%outer_cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: (s32[], f32[256])) -> (s32[], f32[256]) {
  %x = (s32[], f32[256]{0}) parameter(0)
  ROOT %w = (s32[], f32[256]{0}) while(%x), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_nested_whiles_and_calls_multiply():
    got = collective_bytes(NESTED)
    # all-reduce: 1 KiB x 2(8-1)/8, run 3 x 4 times through a call from the inner body.
    assert got["counts"]["all-reduce"] == 12
    assert got["bytes"]["all-reduce"] == 12 * 1024 * 2 * 7 / 8
    # all-gather: 32 KiB result x 7/8, once per outer iteration.
    assert got["counts"]["all-gather"] == 3
    assert got["bytes"]["all-gather"] == 3 * 32768 * 7 / 8
    assert got["total"] == got["bytes"]["all-reduce"] + got["bytes"]["all-gather"]
    assert got["unknown_trip_counts"] == 0


FORMS = """HloModule m, num_partitions=8

%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (x: bf16[16,1024], y: f32[8,128]) -> bf16[64,1024] {
  %x = bf16[16,1024]{1,0} parameter(0)
  %y = f32[8,128]{1,0} parameter(1)
  %ags = (bf16[16,1024]{1,0}, bf16[64,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = bf16[64,1024]{1,0} all-gather-done(%ags)
  %rs = bf16[8,1024]{1,0} reduce-scatter(%x), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%sum
  %ar = (f32[8,128]{1,0}, bf16[16,1024]{1,0}) all-reduce(%y, %x), channel_id=3, replica_groups={}, to_apply=%sum
  %a2a = f32[8,128]{1,0} all-to-all(%y), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %cps = (f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) collective-permute-start(%y), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,128]{1,0} collective-permute-done(%cps)
  %rss = ((bf16[16,1024]{1,0}, f32[8,128]{1,0}), (bf16[2,1024]{1,0}, f32[1,128]{1,0})) reduce-scatter-start(%x, %y), channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%sum
  %rsd = (bf16[2,1024]{1,0}, f32[1,128]{1,0}) reduce-scatter-done(%rss)
  %ars = ((f32[8,128]{1,0}), f32[8,128]{1,0}) all-reduce-start(%y), channel_id=7, replica_groups=[1,8]<=[8], to_apply=%sum
  %ard = f32[8,128]{1,0} all-reduce-done(%ars)
  %ars2 = f32[8,128]{1,0} all-reduce-start(%y), channel_id=8, replica_groups=[1,8]<=[8], to_apply=%sum
  %ard2 = f32[8,128]{1,0} all-reduce-done(%ars2)
  ROOT %out = bf16[64,1024]{1,0} copy(%agd)
}
"""


def test_async_tuple_iota_mesh_and_empty_replica_groups():
    got = collective_bytes(FORMS)
    b = got["bytes"]
    assert b["all-gather"] == 131072 * 3 / 4  # iota [2,4]: groups of 4; -done not counted again
    # groups of 2: (g-1) x result; XLA:GPU's start tuple (operands, results): its results, 7 x
    assert b["reduce-scatter"] == 16384 * 1 + (4096 + 512) * 7
    # a tuple; {} = all 8 devices; XLA:GPU's ((operands), results) and the older results-only start
    assert b["all-reduce"] == (4096 + 32768) * 2 * 7 / 8 + 2 * 4096 * 2 * 7 / 8
    assert b["all-to-all"] == 4096 * 3 / 4  # mesh form: axis_0 of size 4
    assert b["collective-permute"] == 4096  # the result element of the start tuple
    assert got["counts"] == {k: 1 for k in b} | {"reduce-scatter": 2, "all-reduce": 3}


def test_shape_bytes():
    assert shape_bytes("bf16[8,1024]{1,0}") == 16384
    assert shape_bytes("(f32[2,3]{1,0}, s8[4], pred[])") == 24 + 4 + 1
    assert shape_bytes("f8e4m3fn[10]") == 10 and shape_bytes("s4[6]") == 3


# --- frozen post-partitioning HLO from each supported jax release ----------------------------
# The gradient of a 3-layer scanned, rematerialised FSDP stack (4 devices, f32[3,16,16] weights
# sharded 4-ways on dim 1): the forward and backward loops each gather every layer's f32[16,16]
# (1 KiB, 3/4 of it sent), and the backward reduce-scatters each f32[4,16] gradient shard
# (256 B, x 3). jax 0.10 reads the loop counter through get-tuple-element; jax 0.11 and 0.12 write
# it as the operand `%param.1#0`.
SNAPSHOTS = sorted((pathlib.Path(__file__).parents[2] / "data" / "hlo").glob("scan_grad_jax*.txt"))


def test_a_snapshot_from_each_supported_release_is_present():
    names = {p.name for p in SNAPSHOTS}
    assert {"scan_grad_jax0.10.2.txt", "scan_grad_jax0.11.2.txt", "scan_grad_jax0.12.0.1.txt"} <= names


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_scan_trip_counts_from_every_hlo_text_form(path):
    got = collective_bytes(path.read_text())
    assert got["unknown_trip_counts"] == 0
    assert got["counts"]["all-gather"] == 6 and got["bytes"]["all-gather"] == 6 * 1024 * 3 / 4
    assert got["counts"]["reduce-scatter"] == 3 and got["bytes"]["reduce-scatter"] == 3 * 256 * 3
    assert got["total"] == 6 * 768 + 3 * 768


UNREADABLE_LOOP = """HloModule m, num_partitions=4

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %ag = f32[16]{0} all-gather(%x), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %two = s32[] constant(2)
  %j = s32[] multiply(%i, %two)
  ROOT %t = (s32[], f32[16]{0}) tuple(%j, %ag)
}

%cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(100)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[16]) -> (s32[], f32[16]) {
  %x = f32[16]{0} parameter(0)
  %one = s32[] constant(1)
  %init = (s32[], f32[16]{0}) tuple(%one, %x)
  ROOT %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_collective_in_a_loop_of_unknown_trip_count_is_refused_not_undercounted():
    with pytest.raises(UnknownTripCount, match="all-gather %ag in %body"):
        collective_bytes(UNREADABLE_LOOP)
    lower_bound = collective_bytes(UNREADABLE_LOOP, allow_unknown_trips=True)
    assert lower_bound["unknown_trip_counts"] == 1 and lower_bound["total"] == 64 * 3 / 4


def test_a_loop_of_unknown_trip_count_without_collectives_is_fine():
    quiet = UNREADABLE_LOOP.replace(
        "all-gather(%x), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}", "negate(%x)"
    )
    assert collective_bytes(quiet)["total"] == 0


# --- real programs: the post-partitioning HLO of jitted functions ---------------------------


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py should simulate 8 CPU devices"
    return Mesh(np.array(jax.devices()).reshape(1, 8, 1), ("data", "fsdp", "tensor"))


def test_gspmd_gather_of_sharded_input(mesh, tmp_path):
    x = jax.device_put(jnp.ones((64, 1024), jnp.bfloat16), NamedSharding(mesh, P("fsdp")))
    f = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
    lowered = f.lower(x)
    got = collective_bytes(partitioned_hlo_text(lowered, str(tmp_path)))
    assert got["counts"]["all-gather"] == 1 and got["total"] == 64 * 1024 * 2 * 7 / 8
    # Why not the final HLO: XLA:CPU upcasts the bf16 gather to f32, doubling its bytes.
    final = collective_bytes(lowered.compile().as_text())
    assert final["total"] == 2 * got["total"]


def test_psum_inside_scan_counts_every_iteration(mesh, tmp_path):
    def body(c, _):
        return c * 0.5 + jax.lax.psum(c, "fsdp"), None

    def local(x):
        return jax.lax.scan(body, x, None, length=5)[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))
    x = jax.device_put(jnp.ones((64, 1024), jnp.float32), NamedSharding(mesh, P("fsdp")))
    got = collective_bytes(partitioned_hlo_text(f.lower(x), str(tmp_path)))
    # Per device an f32[8,1024] (32 KiB) all-reduce, 2 x 7/8 of it per iteration, 5 iterations.
    assert got["counts"]["all-reduce"] == 5 and got["unknown_trip_counts"] == 0
    assert got["total"] == 5 * 32768 * 2 * 7 / 8


def test_psum_scatter(mesh, tmp_path):
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum_scatter(x, "fsdp", scatter_dimension=0, tiled=True),
            mesh=mesh,
            in_specs=P(),
            out_specs=P("fsdp"),
        )
    )
    got = collective_bytes(partitioned_hlo_text(f.lower(jnp.ones((64, 1024), jnp.bfloat16)), str(tmp_path)))
    # Result bf16[8,1024] (16 KiB) per device, x (8 - 1).
    assert got["counts"]["reduce-scatter"] == 1 and got["total"] == 16384 * 7


# --- bytes per mesh axis, from each collective's replica groups -------------------------------
# One program on a data=2 x fsdp=4 mesh in the three forms XLA prints its replica groups: explicit
# (jax 0.10), iota with and without a transpose (GSPMD's collectives), and the mesh form (jax 0.12).
# The same groups: a gather over fsdp, an all-reduce over data, an all-to-all over both.
AXES_MESH = {"data": 2, "fsdp": 4, "tensor": 1}
PER_AXIS = {
    "explicit": (
        "replica_groups={{0,1,2,3},{4,5,6,7}}",
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        "replica_groups={{0,1,2,3,4,5,6,7}}",
    ),
    "iota": ("replica_groups=[2,4]<=[8]", "replica_groups=[4,2]<=[2,4]T(1,0)", "replica_groups=[1,8]<=[8]"),
    "mesh": (
        "replica_groups=mesh['data'=2,'fsdp'=4,'tensor'=1] {'fsdp'}",
        "replica_groups=mesh['data'=2,'fsdp'=4,'tensor'=1] {'data'}",
        "replica_groups=mesh['data'=2,'fsdp'=4,'tensor'=1] {'data','fsdp'}",
    ),
}
PER_AXIS_HLO = """HloModule m, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[256]) -> f32[256] {
  %x = bf16[256]{0} parameter(0)
  %ag = bf16[1024]{0} all-gather(%x), channel_id=1, FSDP, dimensions={0}, use_global_device_ids=true
  %y = f32[256]{0} convert(%x)
  %ar = f32[256]{0} all-reduce(%y), channel_id=2, DATA, use_global_device_ids=true, to_apply=%sum
  %a2a = f32[256]{0} all-to-all(%ar), channel_id=3, BOTH, dimensions={0}
  %cp = f32[256]{0} collective-permute(%a2a), channel_id=4, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  ROOT %out = f32[256]{0} copy(%cp)
}
"""


@pytest.mark.parametrize("form", list(PER_AXIS))
def test_bytes_per_mesh_axis_from_every_replica_group_form(form):
    fsdp, data, both = PER_AXIS[form]
    text = PER_AXIS_HLO.replace("FSDP", fsdp).replace("DATA", data).replace("BOTH", both)
    got = collective_bytes(text, mesh=AXES_MESH)
    assert got["by_kind_axis"] == {
        "all-gather": {"fsdp": 2048 * 3 / 4},
        "all-reduce": {"data": 1024 * 2 * 1 / 2},
        "all-to-all": {"data+fsdp": 1024 * 7 / 8},
        "collective-permute": {"data": 1024},
    }
    assert got["by_axis"] == {"fsdp": 1536, "data": 1024 + 1024, "data+fsdp": 896}
    assert sum(got["by_axis"].values()) == got["total"]
    assert collective_bytes(text)["by_axis"] == {}  # no mesh: no axes to name


def test_replica_groups_forms():
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("replica_groups={}, to_apply=%sum", 4) == [[0, 1, 2, 3]]
    # a sub-axis: the minor half of fsdp=4 ('fsdp':(pre-size 2) size 2)
    sub = replica_groups("replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp':(2)2}", 8)
    assert sub == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axes_spanned(sub, AXES_MESH) == "fsdp"
    assert axes_spanned([[0], [1]], AXES_MESH) == "none"


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_frozen_snapshots_per_axis(path):
    got = collective_bytes(path.read_text(), mesh={"x": 4})
    assert got["by_axis"] == {"x": got["total"]}


def test_live_data_fsdp_mesh_per_axis(tmp_path):
    """On a real data=2 x fsdp=4 mesh, in whichever form this jax prints the groups."""
    from zerojax.core.mesh import make_mesh

    mesh = make_mesh(2, 4)

    def local(x):
        a = jax.lax.all_gather(x, "fsdp", tiled=True)  # f32[32,16] result
        b = jax.lax.psum(x, "data")
        c = jax.lax.psum(x, ("data", "fsdp"))
        return a.sum() + b.sum() + c.sum()

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P(), check_vma=False))
    got = collective_bytes(partitioned_hlo_text(f.lower(jnp.ones((64, 16))), str(tmp_path)), mesh=mesh)
    shard = 8 * 16 * 4
    assert got["by_kind_axis"]["all-gather"] == {"fsdp": 4 * shard * 3 / 4}
    assert got["by_kind_axis"]["all-reduce"] == pytest.approx({"data": shard * 2 / 2, "data+fsdp": shard * 2 * 7 / 8})


def test_collectives_lists_runs_and_groups():
    found = {c.name: c for c in collectives(NESTED)}
    assert found["ar"].runs == 12 and found["ar"].computation == "reduce_grads" and found["ar"].known
    assert found["ag"].runs == 3 and found["ag"].groups == [list(range(8))]
    assert found["ag"].sent == 32768 * 7 / 8


def test_partitioned_hlo_is_dumped_even_when_the_program_is_cached(tmp_path):
    """The suite runs under a persistent compilation cache (conftest.py), which ignores dump options:
    an identical program compiled before must still be compiled again, and dumped, each time."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")  # what makes this test mean something
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    f = jax.jit(lambda x: jnp.sin(x).sum(0), in_shardings=NamedSharding(mesh, P("fsdp")))
    lowered = f.lower(jnp.ones((64, 48)))
    lowered.compile()  # cached without a dump
    texts = [compile_partitioned(lowered, str(tmp_path / str(i)))[1] for i in range(2)]
    assert texts[0] == texts[1] and "all-reduce" in texts[0]
