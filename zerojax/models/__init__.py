"""Shipped Flax NNX models."""

from zerojax.core.remat import REMAT_POLICIES
from zerojax.models.gpt import GPT, PRESETS, GPTConfig, LayerHook, gpt_config

__all__ = ["GPT", "GPTConfig", "LayerHook", "PRESETS", "REMAT_POLICIES", "gpt_config"]
