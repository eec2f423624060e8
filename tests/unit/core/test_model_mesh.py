"""`zerojax.core.model_mesh`: a user's spec in zerojax's mesh axes, outside any shard_map region."""

import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.core.axis_rules import as_rules
from zerojax.core.model_mesh import ModelMesh


@pytest.fixture(scope="module")
def model_mesh():
    return ModelMesh.of(zj.make_mesh(fsdp=4, tensor=2), as_rules({"tp": "tensor", "dp": ["data", "fsdp"]}))


def test_names_go_through_the_rules_and_batch_means_the_data_parallel_axes(model_mesh):
    assert model_mesh.spec(P("dp", None, "tp"), "constraint") == P(("data", "fsdp"), None, "tensor")
    assert model_mesh.spec(P("batch", "tensor"), "constraint") == P(("data", "fsdp"), "tensor")
    assert model_mesh.spec(P(("data", "fsdp"), P.UNCONSTRAINED), "constraint") == P(("data", "fsdp"), P.UNCONSTRAINED)
    assert not model_mesh.notes  # nothing is dropped outside a shard_map region


def test_an_axis_used_twice_is_kept_once(model_mesh):
    assert model_mesh.spec(P("dp", "fsdp"), "constraint") == P(("data", "fsdp"), None)


def test_a_name_no_rule_maps_is_one_sentence_with_the_rule_to_add(model_mesh):
    with pytest.raises(zj.UserError, match="names mesh axis 'model'.*axis_rules=\\{'model': 'tensor'\\}"):
        model_mesh.spec(P(None, "model"), "sharding constraint")
