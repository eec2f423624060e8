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

import dataclasses

import numpy as np

from zerojax.errors import UserError
from zerojax.models.gpt import LORA_TARGETS, GPTConfig

# zerojax path -> (Llama name, transposed); "{i}" is the layer.
TOP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "head": ("lm_head.weight", True),  # absent where the embeddings are tied
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
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),  # the q/k/v biases, where the GPT has them
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
}
# Buffers some Llama checkpoints carry that hold no parameter.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _layout(x: np.ndarray, transposed: bool) -> np.ndarray:
    return np.ascontiguousarray(x.T if transposed else x)


def gpt_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The GPT's parameter shapes by zerojax path (adapters left out)."""
    d = cfg.d_model
    top = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        top["head"] = (d, cfg.vocab_size)
    return top | {f"blocks/{k}": (cfg.n_layers, *s) for k, s in cfg.block_shapes().items()}


def _names(cfg_or_params) -> tuple[dict, dict]:
    """The TOP and LAYER entries a GPT has: of a config, or of a flat params dict."""
    have = gpt_shapes(cfg_or_params) if isinstance(cfg_or_params, GPTConfig) else cfg_or_params
    top = {k: v for k, v in TOP.items() if k in have}
    return top, {k: v for k, v in LAYER.items() if f"blocks/{k}" in have}


def llama_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The Llama tensors' shapes by name, for a GPT of `cfg`."""
    shapes, (top, layer) = gpt_shapes(cfg), _names(cfg)
    out = {name: shapes[k][::-1] if t else shapes[k] for k, (name, t) in top.items()}
    for k, (name, t) in layer.items():
        shape = shapes[f"blocks/{k}"][1:]
        out |= {name.format(i=i): shape[::-1] if t else shape for i in range(cfg.n_layers)}
    return out


def to_llama(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GPT's params by zerojax path -> Llama tensors by name (layers split, Linear weights [out, in])."""
    top, layer = _names(params)
    out = {name: _layout(params[k], t) for k, (name, t) in top.items()}
    for k, (name, t) in layer.items():
        out |= {name.format(i=i): _layout(w, t) for i, w in enumerate(params[f"blocks/{k}"])}
    return out


def from_llama(tensors: dict[str, np.ndarray], cfg: GPTConfig) -> dict[str, np.ndarray]:
    """`to_llama`'s inverse: Llama tensors by name -> the GPT's params by zerojax path, fp32."""
    top, layer = _names(cfg)
    params = {k: _layout(tensors[name], t).astype(np.float32) for k, (name, t) in top.items()}
    for k, (name, t) in layer.items():
        layers = [_layout(tensors[name.format(i=i)], t) for i in range(cfg.n_layers)]
        params[f"blocks/{k}"] = np.stack(layers).astype(np.float32)
    return params


def merged(params: dict[str, np.ndarray], cfg: GPTConfig) -> dict[str, np.ndarray]:
    """The GPT's params with its LoRA adapters folded into their weights, `W + alpha/rank * A B` per
    layer in fp32, and the adapters left out: the base model that computes what the adapted one does."""
    out = {k: v for k, v in params.items() if "_lora_" not in k}
    if cfg.lora is None:
        return out
    for target in cfg.lora.targets:
        attr = LORA_TARGETS[target][0]
        a, b = (params[f"blocks/{target}_lora_{s}"].astype(np.float32) for s in "ab")
        delta = cfg.lora.scale * np.einsum("lir,lro->lio", a, b)
        out[f"blocks/{attr}"] = (params[f"blocks/{attr}"].astype(np.float32) + delta).astype(np.float32)
    return out


def llama_config(cfg: GPTConfig) -> dict:
    """config.json for a GPT of `cfg`, as transformers' LlamaConfig reads it; with q/k/v biases, as
    its Qwen2Config does (Llama's attention_bias would bias o_proj too, which the GPT has not)."""
    scaling = None if cfg.rope_scaling is None else dataclasses.asdict(cfg.rope_scaling)
    kind = "qwen2" if cfg.qkv_bias else "llama"
    extra = {"use_sliding_window": False, "sliding_window": None} if cfg.qkv_bias else {}
    return {
        "architectures": [FAMILY[kind]],
        "model_type": kind,
        **extra,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
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


# The family's architectures, all in Llama's tensor names: model_type -> architecture.
FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def family(hf: dict, where: str) -> str:
    """The model_type of a config.json of the Llama family; another model is one UserError."""
    archs = hf.get("architectures") or []
    for model_type, arch in FAMILY.items():
        if arch in archs or hf.get("model_type") == model_type:
            return model_type
    raise UserError(
        f"{where} is not a Llama, Mistral or Qwen2 config "
        f"(architectures {archs!r}, model_type {hf.get('model_type')!r})."
    )


def gpt_sizes(hf: dict, where: str) -> dict:
    """The GPT's model.* settings for a Llama, Mistral or Qwen2 config.json; a field it cannot honour
    is one UserError naming the field and value."""
    kind = family(hf, where)
    sizes: dict = {"qkv_bias": True} if kind == "qwen2" else {}  # Qwen2 always biases q, k and v
    for key, ours in SIZES.items():
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}.")
        sizes[ours] = value
    rope = hf.get("rope_parameters") or {}
    # Left to their defaults where they hold them, as the GPT's own config would
    if (hf.get("num_key_value_heads") or sizes["n_heads"]) != sizes["n_heads"]:
        sizes["n_kv_heads"] = hf["num_key_value_heads"]
    if (hf.get("head_dim") or sizes["d_model"] // sizes["n_heads"]) * sizes["n_heads"] != sizes["d_model"]:
        sizes["head_dim"] = hf["head_dim"]
    sizes["norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    sizes["rope_base"] = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    sizes["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            raise UserError(
                f"{where}: rope_scaling of type {rope_type!r} does not map to the shipped GPT (only 'llama3')."
            )
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        sizes["rope_scaling"] = {k: scaling[k] for k in keys}
    _check_fixed(hf, where, sizes["seq_len"])
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    return {k: v for k, v in sizes.items() if k in SIZES.values() or v != defaults.get(k)}


def _check_fixed(hf: dict, where: str, seq_len: int) -> None:
    """The keys the GPT has no setting for hold the GPT's values. A sliding window (Mistral v0.1,
    Qwen2 with use_sliding_window) is one only where it is shorter than the sequence."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    wanted = [
        ("hidden_act", hf.get("hidden_act", "silu"), "silu", "its MLP is SwiGLU"),
        ("attention_bias", bool(hf.get("attention_bias")), False, "it has no o_proj bias"),
        ("mlp_bias", bool(hf.get("mlp_bias")), False, "it has no MLP biases"),
        ("sliding_window", window if window and window < seq_len else None, None, "it attends to the whole sequence"),
    ]
    for key, got, want, why in wanted:
        if got != want:
            raise UserError(f"{where}: {key}={got!r} does not map to the shipped GPT ({why}: {want!r}).")
