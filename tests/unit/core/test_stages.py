"""The stage table and the per-leaf rule: exact layouts and shard sizes."""

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from zerojax.core.layout import make_layout
from zerojax.core.leaf_rule import leaf_layout, shard_numel
from zerojax.core.precision import get_precision
from zerojax.core.stages import STAGES, get_stage
from zerojax.errors import UserError


def test_stage_table_shards_more_groups_each_stage():
    groups = [(s.compute_params, s.master_params, s.optimizer, s.gradients) for s in STAGES]
    assert groups == [(0, 0, 0, 0), (0, 1, 1, 0), (0, 1, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("bad", [-1, 4, "3", True, None])
def test_stage_outside_table_is_rejected(bad):
    with pytest.raises(UserError, match="zero.stage"):
        get_stage(bad)


def test_largest_divisible_dimension_is_sharded():
    l = leaf_layout("w", (24, 64), 4, 8)
    assert (l.axis, l.padded_shape) == (1, (24, 64))
    assert leaf_layout("w", (64, 12), 4, 8).axis == 0


def test_no_divisible_dimension_pads_the_largest():
    l = leaf_layout("w", (37, 129), 4, 8)
    assert (l.axis, l.padded_shape) == (1, (37, 136))
    assert shard_numel(l, True, 8) == 37 * 17


def test_tiny_uneven_leaf_replicates_and_says_why():
    l = leaf_layout("b", (10,), 4, 8)
    assert l.axis is None and "replicated" in l.reason and "40 bytes" in l.reason
    assert shard_numel(l, True, 8) == 10


def test_layer_axis_is_never_sharded():
    # Axis 0 (8 layers) is the only one 8 divides, but it is the scan's layer axis: pad another.
    l = leaf_layout("blocks/w", (8, 12, 100), 4, 8, layer_axis=0)
    assert l.axis == 2 and l.padded_shape == (8, 12, 104)


def test_scalars_replicate():
    assert leaf_layout("s", (), 4, 8).axis is None


def test_optimizer_moments_follow_params_and_counters_replicate():
    mesh = zj.make_mesh(fsdp=8)
    shapes = {"w": jax.ShapeDtypeStruct((37, 129), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
    layout = make_layout(mesh, get_stage(1), get_precision("fp32"), shapes)
    tx = optax.adam(1e-3)
    opt_shapes = jax.eval_shape(
        tx.init, {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in layout.shapes(True).items()}
    )
    shardings = layout.opt_state_shardings(opt_shapes)
    adam = shardings[0]
    assert adam.mu["w"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert adam.nu["b"].spec == jax.sharding.PartitionSpec("fsdp")
    assert adam.count.spec == jax.sharding.PartitionSpec()
