"""`zerojax.interop.llama`: the shipped GPT's parameter names and layouts against Llama's, both ways."""

import numpy as np
import pytest

from zerojax.interop.llama import from_llama, gpt_shapes, gpt_sizes, llama_config, llama_shapes, to_llama
from zerojax.models.gpt import gpt_config

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILY = {
    "gpt": {},
    "gqa": {"n_kv_heads": 2, "norm_eps": 1e-5, "rope_base": 500000.0},
    "llama-3.1": {"n_kv_heads": 1, "rope_scaling": SCALING},
    "llama-3.2": {"n_kv_heads": 2, "head_dim": 8, "tie_embeddings": True},
    "biases": {"n_kv_heads": 2, "qkv_bias": True},
}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_mapping_round_trips_every_tensor_bit_for_bit(name):
    cfg = gpt_config("tiny", **FAMILY[name])
    rng = np.random.default_rng(0)
    params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in gpt_shapes(cfg).items()}
    tensors = to_llama(params)
    assert {k: v.shape for k, v in tensors.items()} == llama_shapes(cfg)
    back = from_llama(tensors, cfg)
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])


@pytest.mark.parametrize("name", sorted(set(FAMILY) - {"biases"}))
def test_config_json_reads_back_as_the_same_gpt(name):
    cfg = gpt_config("tiny", **FAMILY[name])
    back = gpt_config("tiny", **gpt_sizes(llama_config(cfg), "config.json"))
    assert back == cfg


def test_q_k_v_biases_have_no_llama_config():
    with pytest.raises(Exception, match="qkv_bias has no Llama layout"):
        llama_config(gpt_config("tiny", qkv_bias=True))
