"""The typed config, the optimizer registry and the precision model: each rule said once."""

import math

import jax
import jax.numpy as jnp
import pytest

from zerojax.accounting import analytic as A
from zerojax.cli.config import OptimizerConfig, load_config
from zerojax.core.optim import OPTIMIZERS, build_optimizer, get_optimizer
from zerojax.core.precision import PRECISIONS, get_precision
from zerojax.errors import UserError

TINY = "configs/tiny.yaml"


def _error(*overrides: str) -> str:
    with pytest.raises(UserError) as e:
        load_config(TINY, list(overrides))
    return str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "zero.stagee=1",
            "unknown config key 'zero.stagee'; valid keys here are: stage, engine, reduce_dtype, prefetch, "
            "reshard_after_forward, offload, quantize_weights, quantize_grads, quantize_block, hierarchical, "
            "checked_update, pipeline_gather, whole_micro_batches.",
        ),
        ("train.log_every=10", "unknown config key 'train.log_every'"),
        (
            "mesh.tensors=1",
            "unknown config key 'mesh.tensors'; valid keys here are: data, fsdp, tensor, pipeline, pipeline_repeats, "
            "rules, sequence_parallel.",
        ),
        ("mesh.tensor=0", "mesh.tensor must be a positive integer, got 0."),
        ("mesh.sequence_parallel=true", "mesh.sequence_parallel splits the sequence over the tensor axis; it needs"),
        ("train.steps=many", "train.steps must be a valid integer, got 'many'."),
        ("train.steps=true", "train.steps must be a valid integer, got True."),
        ("train.steps=2.5", "train.steps must be a valid integer, got 2.5."),
        ("optimizer.lr=-0.1", "optimizer.lr must be greater than 0, got -0.1."),
        ("data.eval_fraction=1", "data.eval_fraction must be less than 1, got 1."),
        ("zero.engine=3", "zero.engine must be a valid string, got 3."),
        ("zero.prefetch=1", "zero.prefetch must be a valid boolean, got 1."),
        ("model=3", "model must be a mapping, got 3."),
        ('xla.flags=["xla_dump_to=/tmp"]', "xla.flags entries must look like --name=value, got 'xla_dump_to=/tmp'."),
        ("train.seed=-1", "train.seed must be greater than or equal to 0, got -1."),
        ("optimizer.b1=1.0", "optimizer.b1 must be less than 1, got 1.0."),
        ("optimizer.b2=-0.5", "optimizer.b2 must be greater than or equal to 0, got -0.5."),
    ],
)
def test_type_and_bound_errors_name_the_dotted_key(override, message):
    assert message in _error(override)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["zero.stage=4"], "zero.stage must be 0, 1, 2 or 3, got 4."),
        (["precision=fp8"], "precision must be 'fp32' or 'bf16', got 'fp8'."),
        (["zero.reduce_dtype=fp16"], "zero.reduce_dtype must be fp32, bf16 or null, got 'fp16'."),
        (["zero.engine=magic"], "zero.engine must be one of gspmd, shard_map, got 'magic'."),
        (
            ["optimizer.name=lion"],
            "optimizer.name must be one of adamw, adam, sgd, sgd_momentum, adafactor, got 'lion'.",
        ),
        (["mesh.data=0"], "mesh.data must be a positive integer, got 0."),
        (["mesh.fsdp=4", "train.batch_size=6"], "train.batch_size=6 is not divisible by the data-parallel size 4"),
    ],
)
def test_rules_are_the_owners_messages(overrides, message):
    assert _error(*overrides) == message or message in _error(*overrides)


def test_numeric_text_and_ints_for_floats_are_accepted():
    c = load_config(TINY, ["optimizer.lr=3e-4", "optimizer.weight_decay=0", "optimizer.grad_clip=null"])
    assert c.optimizer.lr == 3e-4 and isinstance(c.optimizer.weight_decay, float) and c.optimizer.grad_clip is None
    assert c.to_dict()["optimizer"]["lr"] == 3e-4


def _fp32_state_elements(tx, n: int) -> int:
    """fp32 elements of optimizer state per n-element parameter (scalar counters left out)."""
    state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((n, n), jnp.float32)})
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state) if x.shape)


@pytest.mark.parametrize("name", [n for n, o in OPTIMIZERS.items() if not o.factored])
def test_registry_slots_match_the_optax_state(name):
    tx = build_optimizer(OptimizerConfig(name=name, grad_clip=None), total_steps=10)
    assert _fp32_state_elements(tx, 256) == OPTIMIZERS[name].slots * 256 * 256


def test_factored_state_matches_the_planner():
    tx = build_optimizer(OptimizerConfig(name="adafactor"), total_steps=10)
    elements = _fp32_state_elements(tx, 256)
    planned = A.optimizer_state_bytes(get_optimizer("adafactor"), 256 * 256, [(256, 256)])
    assert planned == 4 * (256 + 256)
    assert elements - 1 == 256 + 256  # optax also keeps a 1-element placeholder for the unused full moment


def test_planner_reads_the_same_registry_and_precision():
    assert OPTIMIZERS is OPTIMIZERS and PRECISIONS is PRECISIONS
    with pytest.raises(UserError, match="--optimizer must be one of"):
        get_optimizer("lion", "--optimizer")


def test_precision_bytes_follow_the_dtypes():
    bf16, fp32 = PRECISIONS["bf16"], PRECISIONS["fp32"]
    assert (bf16.param_bytes, bf16.master_bytes, bf16.grad_bytes) == (2, 4, 2)
    assert (fp32.param_bytes, fp32.master_bytes, fp32.grad_bytes) == (4, 0, 4)
    assert bf16.compute_dtype == jnp.bfloat16 and bf16.master_dtype == jnp.float32
    assert get_precision("bf16", "fp32").reduce_bytes == 4 and get_precision("bf16", "float32").reduce_bytes == 4


def test_traffic_reduces_in_the_reduce_dtype():
    same = A.traffic_bytes(8e6, 8, 3, 2)
    wide = A.traffic_bytes(8e6, 8, 3, 2, 4)
    assert wide["param_allgather"] == same["param_allgather"] == 2 * 2 * 8e6 * 7 / 8
    assert wide["grad_reduce"] == 2 * same["grad_reduce"] == 4 * 8e6 * 7 / 8


def test_a_config_that_is_not_utf8_is_one_sentence(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 3  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.yaml' is not UTF-8 text \(byte 24 cannot be decoded\)"):
        load_config(str(path))
