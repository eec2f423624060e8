"""`WrapRule(remat=...)`: which activations a user model's FSDP unit keeps for its backward pass.

Models of L residual blocks (x + fc2(gelu(fc1(x)))), width 128, 512 rows per device, stage 3 on
8 devices, fp32, compiled only. One activation is 512 x 128 x 4 bytes = 256 KiB per device, twice a
block's full weights (128 KiB), so any policy that kept the gathered weights would show. Per block
the backward needs, without recomputing anything: the block's input (for fc1's weight gradient), fc1's
output (for gelu's derivative) and gelu's output (for fc2's weight gradient), and the policies keep
  full  the input only (1 activation): the unit is re-run in the backward;
  dots  the input and fc1's matmul output (2): gelu's output is recomputed from it;
  none  everything the forward made (4 or more, as XLA fuses it).
The gathered weights are gathered again in the backward pass under every policy.
"""

import functools

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.models import unrolled_blocks
from tests.unit_models import DEEP, SHALLOW, LinenDeep
from zerojax.adapt.units import WrapRule
from zerojax.errors import UserError

DEVICES, WIDTH, ROWS = 8, 128, 4096
ACTIVATION = (ROWS // DEVICES) * WIDTH * 4
BLOCK = 2 * (WIDTH * WIDTH + WIDTH) * 4
SAVED_PER_BLOCK = {"full": 1, "dots": 2}


def _batch(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        "targets": rng.integers(0, 10, size=(ROWS,)).astype(np.int32),
    }


def _trainer(kind, engine, depth, remat, prefetch=False):
    model = unrolled_blocks(WIDTH, depth) if kind == "nnx" else LinenDeep(WIDTH, depth)
    return zj.Trainer(
        model,
        optax.sgd(1e-2),
        mesh=zj.make_mesh(fsdp=DEVICES),
        stage=3,
        engine=engine,
        engine_options={"wrap": WrapRule(remat=remat), "prefetch": prefetch},
    )


@functools.cache
def _temp_and_step(kind, engine, depth, remat, prefetch=False):
    """(compiled temp bytes per device, the state after one step as numpy leaves)"""
    trainer = _trainer(kind, engine, depth, remat, prefetch)
    state = trainer.init(jax.random.key(0), _batch())
    temp = trainer.compile(state, _batch()).memory_analysis().temp_size_in_bytes  # `step` runs this program
    state, metrics = trainer.step(state, _batch())
    assert trainer.gather_report().route == "units"
    return temp, float(metrics["loss"]), [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.parametrize(
    "kind,engine",
    [("nnx", "shard_map")]
    + [
        pytest.param(k, e, marks=pytest.mark.slow)
        for k, e in [("linen", "gspmd"), ("nnx", "gspmd"), ("linen", "shard_map")]
    ],
)
def test_policies_keep_what_they_name_and_never_the_gathered_weights(kind, engine):
    temps = {r: _temp_and_step(kind, engine, DEEP, r)[0] for r in ("none", "dots", "full")}
    assert temps["none"] > temps["dots"] > temps["full"]
    added = DEEP - SHALLOW
    grown = temps["none"] - _temp_and_step(kind, engine, SHALLOW, "none")[0]
    assert grown >= added * 3 * ACTIVATION  # at least fc1's and gelu's outputs beside the input
    for remat, saved in SAVED_PER_BLOCK.items():
        grown = temps[remat] - _temp_and_step(kind, engine, SHALLOW, remat)[0]
        # Each added block: its saved activations plus at most 0.15 of a block (no gathered block
        # kept; the new master shards alone are 1/8 of a block, see tests/test_units.py).
        assert added * saved * ACTIVATION <= grown <= added * (saved * ACTIVATION + 0.15 * BLOCK), (remat, grown)


@pytest.mark.parametrize("kind,engine", [("nnx", "shard_map"), ("linen", "gspmd")])
def test_policies_change_memory_not_values(kind, engine):
    _, loss, params = _temp_and_step(kind, engine, DEEP, "full")
    for remat in ("none", "dots"):
        other_loss, other = _temp_and_step(kind, engine, DEEP, remat)[1:]
        assert other_loss == pytest.approx(loss, rel=1e-6)
        for a, b in zip(params, other):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def _dots_policy(prim, *args, **params):  # a policy of the user's own: dots' decisions, another function
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


def test_a_checkpoint_policy_works_as_its_name():
    named = _temp_and_step("nnx", "shard_map", SHALLOW, "dots")
    given = _temp_and_step("nnx", "shard_map", SHALLOW, _dots_policy)
    assert given[0] == named[0] and given[1] == named[1]
    assert given[0] > _temp_and_step("nnx", "shard_map", SHALLOW, "full")[0]


@pytest.mark.slow
def test_dots_with_prefetch_trains_like_without_and_costs_the_same_at_every_depth():
    """Prefetch holds a fixed extra (here about 2.3 activations with dots, 1.75 with full): it must
    not grow with depth."""
    extra = {}
    for depth in (4, 8):
        plain = _temp_and_step("nnx", "shard_map", depth, "dots")
        ahead = _temp_and_step("nnx", "shard_map", depth, "dots", prefetch=True)
        assert ahead[1] == pytest.approx(plain[1], rel=1e-6)
        extra[depth] = ahead[0] - plain[0]
    assert abs(extra[8] - extra[4]) <= 0.15 * 4 * BLOCK, extra


def test_unknown_policies_are_refused_when_the_rule_is_made():
    with pytest.raises(UserError, match="WrapRule.remat must be one of"):
        WrapRule(remat="most")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is the CPU backend's")
def test_offload_is_refused_on_cpu_when_traced():
    trainer = _trainer("nnx", "shard_map", 2, "offload")  # the backend is only asked when the step is traced
    with pytest.raises(UserError, match="host memory"):
        trainer.init(jax.random.key(0), _batch())
