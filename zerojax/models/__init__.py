"""Shipped Flax NNX models."""

from zerojax.models.gpt import GPT, PRESETS, GPTConfig, LayerHook, gpt_config
from zerojax.remat_policies import REMAT_POLICIES

__all__ = ["GPT", "GPTConfig", "LayerHook", "PRESETS", "REMAT_POLICIES", "gpt_config"]
