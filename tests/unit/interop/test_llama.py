"""`zerojax.interop.llama`: the shipped GPT's parameter names and layouts against Llama's, both ways."""

import dataclasses

import numpy as np
import pytest

from zerojax.interop.llama import from_llama, gpt_shapes, gpt_sizes, llama_config, llama_shapes, to_llama
from zerojax.models.gpt import LORA_TARGETS, gpt_config

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


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_config_json_reads_back_as_the_same_gpt(name):
    cfg = gpt_config("tiny", **FAMILY[name])
    config = llama_config(cfg)
    assert config["architectures"] == (["Qwen2ForCausalLM"] if cfg.qkv_bias else ["LlamaForCausalLM"])
    back = gpt_config("tiny", **gpt_sizes(config, "config.json"))
    assert back == cfg


MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2}
MISTRAL |= {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
MISTRAL |= {"max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None}


def test_mistral_and_qwen2_configs_map_and_a_short_sliding_window_is_refused():
    from zerojax.errors import UserError

    sizes = gpt_sizes(MISTRAL, "config.json")
    assert (sizes["n_kv_heads"], sizes["norm_eps"], sizes["rope_base"], sizes.get("qkv_bias")) == (2, 1e-5, 1e6, None)
    assert gpt_sizes({**MISTRAL, "sliding_window": 64}, "c")["seq_len"] == 64  # as long as the sequence: no window
    with pytest.raises(UserError, match="sliding_window=32 does not map"):
        gpt_sizes({**MISTRAL, "sliding_window": 32}, "c")
    qwen2 = {**MISTRAL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 32}
    assert gpt_sizes({**qwen2, "use_sliding_window": False}, "c")["qkv_bias"] is True
    with pytest.raises(UserError, match="is not a Llama, Mistral or Qwen2 config"):
        gpt_sizes({**MISTRAL, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "c")


def test_a_merged_lora_model_gives_the_adapted_models_logits():
    """W + alpha/rank A B per layer: the base GPT with merged weights computes what the GPT with
    adapters does (B drawn non-zero, so the adapters count), within 1e-5."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.core.trees import path_str
    from zerojax.interop.llama import merged
    from zerojax.models.gpt import GPT

    cfg = gpt_config("tiny", n_kv_heads=2, remat="none", lora={"rank": 2, "alpha": 6})
    adapted = GPT(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(adapted, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.default_rng(0)
    flat = {path_str(p): np.asarray(x) for p, x in leaves}
    flat = {k: rng.normal(size=v.shape).astype(np.float32) * 0.1 if "_lora_b" in k else v for k, v in flat.items()}
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, list(flat.values())))
    nnx.update(adapted, state)

    base_cfg = dataclasses.replace(cfg, lora=None)
    base = GPT(base_cfg, rngs=nnx.Rngs(1))
    base_state = nnx.state(base, nnx.Param)
    base_leaves, base_def = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(base_state))
    folded = merged(flat, cfg)
    assert set(folded) == set(gpt_shapes(base_cfg))
    nnx.replace_by_pure_dict(
        base_state, jax.tree_util.tree_unflatten(base_def, [folded[path_str(p)] for p, _ in base_leaves])
    )
    nnx.update(base, base_state)

    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 16)))
    want, got = np.asarray(adapted(tokens)), np.asarray(base(tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(want - np.asarray(GPT(cfg, rngs=nnx.Rngs(0))(tokens))).max() > 1e-3  # the adapters count


def test_peft_adapters_merge_as_the_gpt_merges_them():
    """peft's `W + lora_alpha / r * lora_B.weight @ lora_A.weight` on the exported base ([out, in])
    is the merged export's weight, for every target and layer."""
    from zerojax.interop.llama import merged
    from zerojax.interop.peft import MODULES, adapter_config, adapter_tensors

    cfg = gpt_config("tiny", n_kv_heads=2, lora={"rank": 2, "alpha": 6})
    rng = np.random.default_rng(0)
    shapes = gpt_shapes(cfg) | {
        f"blocks/{t}_lora_{s}": shape
        for t, (attr, _, _) in LORA_TARGETS.items()
        for s, shape in zip("ab", _adapter_shapes(gpt_shapes(cfg)[f"blocks/{attr}"], 2))
    }
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    base, want = to_llama(merged(params, dataclasses.replace(cfg, lora=None))), to_llama(merged(params, cfg))
    peft, config = adapter_tensors(params, cfg), adapter_config(cfg)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for module in MODULES.values():
        for i in range(cfg.n_layers):
            a = peft[f"base_model.model.model.layers.{i}.{module}.lora_A.weight"]
            b = peft[f"base_model.model.model.layers.{i}.{module}.lora_B.weight"]
            name = f"model.layers.{i}.{module}.weight"
            got = base[name] + config["lora_alpha"] / config["r"] * b @ a
            np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-5)


def _adapter_shapes(weight_shape, rank):
    layers, d_in, d_out = weight_shape
    return (layers, d_in, rank), (layers, rank, d_out)
