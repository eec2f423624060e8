"""Collectives inside a conditional's branches: refused without their runs, counted with them, and
their runs read from a profile of the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax.accounting.executed import instruction_runs
from zerojax.accounting.hlo import UnknownTripCount, collective_bytes, collectives
from zerojax.accounting.partitioned import compile_partitioned

# three iterations, each sending from stage 0 alone or from stages 0 and 1, as a conditional picks
BRANCHED = """HloModule m, num_partitions=4

%first (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %cp0 = f32[8]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1}}
}

%both (y: f32[8]) -> f32[8] {
  %y = f32[8]{0} parameter(0)
  ROOT %cp1 = f32[8]{0} collective-permute(%y), channel_id=2, source_target_pairs={{0,1},{1,2}}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %c = f32[8]{0} conditional(%i, %v, %v), branch_computations={%first, %both}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %c)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_conditionals_collectives_are_refused_without_their_runs():
    assert {c.name: c.known for c in collectives(BRANCHED)} == {"cp0": False, "cp1": False}
    with pytest.raises(UnknownTripCount, match="collective-permute %cp0 in %first"):
        collective_bytes(BRANCHED)


def test_with_their_runs_each_device_counts_what_it_sends():
    got = collective_bytes(BRANCHED, runs={"cp0": 1, "cp1": 2}, mesh={"pipeline": 4})
    # device 0 sends in all three iterations, device 1 in two; the link 0-1 carries three
    assert got["bytes"]["collective-permute"] == 3 * 32 and got["counts"]["collective-permute"] == 3
    assert got["by_kind_axis"]["collective-permute"] == {"pipeline": 3 * 32}
    assert got["busiest_link"] == 3 * 32
    # as if every branch ran in every iteration: the upper bound, only when asked for
    assert collective_bytes(BRANCHED, allow_unknown_trips=True)["bytes"]["collective-permute"] == 6 * 32


def test_the_runs_come_from_a_profile_of_the_program(tmp_path):
    """A loop of 5 iterations picking one of three shifts by a table: the profile shows each
    shift's runs as the table has them, and the count follows."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("pipeline",))
    table = np.array([0, 1, 1, 2, 1], np.int32)
    shifts = [[(0, 1)], [(0, 1), (1, 2), (2, 3)], [(2, 3)]]

    def local(x):
        def step(h, k):
            branches = [lambda h, s=s: jax.lax.ppermute(h, "pipeline", s) for s in shifts]
            return jax.lax.switch(k, branches, jnp.tanh(h)), None

        return jax.lax.scan(step, x, jnp.asarray(table))[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("pipeline"), out_specs=P("pipeline"), check_vma=False))
    x = jnp.ones((4, 64))
    compiled, text = compile_partitioned(f.lower(x), str(tmp_path))
    names = {c.name for c in collectives(text) if not c.known}
    runs = instruction_runs(lambda: jax.block_until_ready(compiled(x)), names, 4)
    assert sorted(runs.values()) == [1, 1, 3]
    got = collective_bytes(text, runs=runs)
    assert got["bytes"]["collective-permute"] == 4 * 64 * 4  # device 0 (or 2): 4 of the 5 iterations
    assert got["counts"]["collective-permute"] == 5
