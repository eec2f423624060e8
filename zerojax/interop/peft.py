"""The shipped GPT's LoRA adapters as the `peft` library stores them for a Llama-family base model:
adapter_model.safetensors and adapter_config.json. Pure functions over flat parameter dicts.

peft's LoRA layer computes `W x + (lora_alpha / r) * lora_B(lora_A(x))` with torch Linear weights
([out, in]): lora_A.weight is [r, in], the GPT's A ([in, r], x @ A) transposed, and lora_B.weight
[out, r], its B transposed. One pair per targeted module and layer.
"""

from __future__ import annotations

import numpy as np

from zerojax.errors import UserError
from zerojax.interop.llama import LAYER
from zerojax.models.gpt import LORA_TARGETS, GPTConfig

# LoRA target -> the Llama module it sits beside ("self_attn.q_proj"), from the weight's Llama name
MODULES = {
    target: LAYER[attr][0].removeprefix("model.layers.{i}.").removesuffix(".weight")
    for target, (attr, _, _) in LORA_TARGETS.items()
}
PREFIX = "base_model.model.model.layers.{i}."


def adapter_tensors(params: dict[str, np.ndarray], cfg: GPTConfig) -> dict[str, np.ndarray]:
    """The adapters of a GPT with `model.lora`, by peft's tensor names, fp32."""
    if cfg.lora is None:
        raise UserError("--format peft writes LoRA adapters; this checkpoint's GPT has none (model.lora).")
    out = {}
    for target in cfg.lora.targets:
        name = PREFIX + MODULES[target] + ".lora_{}.weight"
        for i in range(cfg.n_layers):
            out[name.format("A", i=i)] = np.ascontiguousarray(params[f"blocks/{target}_lora_a"][i].T, np.float32)
            out[name.format("B", i=i)] = np.ascontiguousarray(params[f"blocks/{target}_lora_b"][i].T, np.float32)
    return out


def adapter_config(cfg: GPTConfig) -> dict:
    """adapter_config.json as peft's LoraConfig reads it (the base model is given when loading:
    `PeftModel.from_pretrained(base, OUT)`)."""
    assert cfg.lora is not None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.rank if cfg.lora.alpha is None else cfg.lora.alpha,
        "target_modules": [MODULES[t].split(".")[1] for t in cfg.lora.targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
