"""`zerojax.interop.llama`: the shipped GPT's parameter names and layouts against Llama's, both ways."""

import numpy as np

from zerojax.interop.llama import from_llama, gpt_shapes, llama_shapes, to_llama
from zerojax.models.gpt import gpt_config


def test_the_mapping_round_trips_every_tensor_bit_for_bit():
    cfg = gpt_config("tiny")
    rng = np.random.default_rng(0)
    params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in gpt_shapes(cfg).items()}
    tensors = to_llama(params)
    assert {k: v.shape for k, v in tensors.items()} == llama_shapes(cfg)
    back = from_llama(tensors, cfg.n_layers)
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])
