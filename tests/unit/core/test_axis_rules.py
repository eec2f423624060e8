"""`zerojax.core.axis_rules`: rules, the mesh axes a name means, and each leaf's tensor and fsdp axes."""

import pytest

from zerojax.core.axis_rules import DEFAULT_AXIS_RULES, as_rules, dims, mesh_axes, unknown, unmapped
from zerojax.errors import UserError


def test_rules_take_an_axis_a_list_of_axes_or_none():
    rules = as_rules([("tp", "tensor"), ("dp", ["data", "fsdp"]), ("embed", None)])
    assert rules == {"tp": "tensor", "dp": ("data", "fsdp"), "embed": None}
    assert as_rules(None) == DEFAULT_AXIS_RULES


@pytest.mark.parametrize("target", ["pipeline", ["fsdp", "fsdp"], ["fsdp", None], 3])
def test_a_rule_to_anything_else_is_one_sentence(target):
    with pytest.raises(UserError, match="a rule maps to one of data, fsdp, tensor, a list of them, or None"):
        as_rules({"mlp": target})


def test_a_mesh_axis_means_itself_and_other_names_their_rule():
    rules = as_rules({"dp": ["data", "fsdp"], "tp": "tensor", "embed": None})
    assert mesh_axes("fsdp", rules) == ("fsdp",)
    assert mesh_axes(("dp", "tp"), rules) == ("data", "fsdp", "tensor")
    assert mesh_axes("embed", rules) == mesh_axes(None, rules) == ()
    assert unknown(("tp", "model"), rules) == ["model"] and unmapped(["model", "tp", "x"], rules) == ["model", "x"]


def test_a_leaf_takes_its_tensor_and_fsdp_dimensions_from_its_names():
    rules = as_rules({"tp": "tensor", "dp": ["data", "fsdp"]})
    assert dims("w", ("dp", "tp"), (16, 8), rules, tensor=2) == (1, 0)  # [data, fsdp] is an fsdp dimension
    assert dims("w", ("dp", "tp"), (16, 8), rules, tensor=1) == (None, 0)
    assert dims("w", ("tp",), (3, 16, 8), rules, tensor=2) == (2, None)  # names align to the last axes


@pytest.mark.parametrize(
    "names, match",
    [(("d", None), r"maps axis 0 \('d'\) to \('data',\)"), (("tp", "tp"), "2 dimensions .* to the tensor axis")],
)
def test_a_leaf_the_rules_cannot_lay_out_is_one_sentence(names, match):
    with pytest.raises(UserError, match=match):
        dims("w", names, (16, 8), as_rules({"tp": "tensor", "d": "data"}), tensor=2)
