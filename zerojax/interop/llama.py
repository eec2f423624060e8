"""The shipped GPT in Hugging Face's Llama convention: tensor names, layouts and config.json.

Pure functions over flat parameter dicts (zerojax paths like "blocks/wq" -> arrays). The GPT's
blocks stack the layers on axis 0; a Llama checkpoint has one tensor per layer. Its matmul weights
are [in, out] (x @ w); torch's Linear stores [out, in], so they are transposed. The heads are the
contiguous column blocks of wq, wk and wv in both conventions. Rotary embeddings need no
permutation: `zerojax.models.gpt` rotates the pairs (i, i + head_dim/2), as Llama's `rotate_half`
does, with the same frequencies (rope_theta ** (-2i/head_dim)). Both RMSNorms multiply by their
weight (no +1 offset) with the epsilon inside the square root.
"""

from __future__ import annotations

import numpy as np

from zerojax.errors import UserError
from zerojax.models.gpt import GPTConfig, gpt_config

NORM_EPS = 1e-6  # the GPT's RMSNorm epsilon (zerojax.models.gpt)

# zerojax path -> (Llama name, transposed); "{i}" is the layer.
TOP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "head": ("lm_head.weight", True),
}
LAYER = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
# Buffers some Llama checkpoints carry that hold no parameter.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _layout(x: np.ndarray, transposed: bool) -> np.ndarray:
    return np.ascontiguousarray(x.T if transposed else x)


def gpt_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The GPT's parameter shapes by zerojax path."""
    d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers
    layer = {"attn_norm": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d)}
    layer |= {"mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    top = {"embed": (cfg.vocab_size, d), "final_norm": (d,), "head": (d, cfg.vocab_size)}
    return top | {f"blocks/{k}": (n, *s) for k, s in layer.items()}


def llama_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The Llama tensors' shapes by name, for a GPT of `cfg`."""
    shapes = gpt_shapes(cfg)
    out = {name: shapes[k][::-1] if t else shapes[k] for k, (name, t) in TOP.items()}
    for k, (name, t) in LAYER.items():
        shape = shapes[f"blocks/{k}"][1:]
        out |= {name.format(i=i): shape[::-1] if t else shape for i in range(cfg.n_layers)}
    return out


def to_llama(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GPT's params by zerojax path -> Llama tensors by name (layers split, Linear weights [out, in])."""
    out = {name: _layout(params[k], t) for k, (name, t) in TOP.items()}
    for k, (name, t) in LAYER.items():
        out |= {name.format(i=i): _layout(w, t) for i, w in enumerate(params[f"blocks/{k}"])}
    return out


def from_llama(tensors: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
    """`to_llama`'s inverse: Llama tensors by name -> the GPT's params by zerojax path, fp32."""
    params = {k: _layout(tensors[name], t).astype(np.float32) for k, (name, t) in TOP.items()}
    for k, (name, t) in LAYER.items():
        layers = [_layout(tensors[name.format(i=i)], t) for i in range(n_layers)]
        params[f"blocks/{k}"] = np.stack(layers).astype(np.float32)
    return params


def llama_config(cfg: GPTConfig) -> dict:
    """config.json for a GPT of `cfg`, as transformers' LlamaConfig reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "tie_word_embeddings": False,  # the GPT's head is its own parameter
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


SIZES = {  # Llama config key -> the GPT's model.* key
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "d_ff",
    "max_position_embeddings": "seq_len",
    "vocab_size": "vocab_size",  # byte-level 256, or a tokenizer's (model.vocab_size)
}


def gpt_sizes(hf: dict, where: str) -> dict[str, int]:
    """The GPT's model.* sizes for a Llama config.json; a config the GPT cannot hold is one UserError."""
    if "LlamaForCausalLM" not in (hf.get("architectures") or []) and hf.get("model_type") != "llama":
        raise UserError(f"{where} is not a Llama config (architectures {hf.get('architectures')!r}).")
    sizes = {}
    for key, ours in SIZES.items():
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}.")
        sizes[ours] = value
    heads = sizes["n_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise UserError(
            f"{where} uses grouped-query attention (num_key_value_heads={kv_heads} < num_attention_heads="
            f"{heads}); the shipped GPT has a key/value head per query head."
        )
    _check_fixed(hf, where, sizes["d_model"] // heads)
    return sizes


def _check_fixed(hf: dict, where: str, head_dim: int) -> None:
    """The keys the GPT has no setting for hold the GPT's values."""
    rope = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    base = gpt_config("tiny")
    wanted = [
        ("hidden_act", hf.get("hidden_act", "silu"), "silu", "its MLP is SwiGLU"),
        ("attention_bias", bool(hf.get("attention_bias")), False, "it has no biases"),
        ("mlp_bias", bool(hf.get("mlp_bias")), False, "it has no biases"),
        ("rope_scaling", hf.get("rope_scaling") or rope.get("rope_type", "default"), "default", "plain RoPE"),
        ("head_dim", hf.get("head_dim") or head_dim, head_dim, "hidden_size / num_attention_heads"),
        ("rms_norm_eps", hf.get("rms_norm_eps"), NORM_EPS, "its RMSNorm's epsilon"),
        ("rope_theta", theta, base.rope_base, "its rotary base"),
    ]
    for key, got, want, why in wanted:
        if got != want:
            raise UserError(f"{where}: {key}={got!r} does not map to the shipped GPT ({why}: {want!r}).")
