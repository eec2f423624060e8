"""`zerojax.core.trees`: one spelling of a parameter path, stack membership, the parameter count."""

import jax
import numpy as np

from zerojax.core.trees import count_params, path_str, under


def test_every_key_path_is_spelled_with_slashes():
    tree = {"blocks": [{"w": np.zeros((2, 3))}], "b": np.zeros(4)}
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == ["b", "blocks/0/w"]
    assert path_str(("blocks", 0, "kernel")) == "blocks/0/kernel"


def test_a_path_under_a_stack_and_the_count_of_a_tree():
    assert under(("blocks", "layers", "w"), [("blocks",)]) and not under(("head", "w"), [("blocks",)])
    assert count_params({"a": np.zeros((2, 3)), "b": jax.ShapeDtypeStruct((5,), np.float32)}) == 11
