"""Shipped Flax NNX models."""

from zerojax.models.gpt import GPT, PRESETS, REMAT_POLICIES, GPTConfig, LayerHook, gpt_config

__all__ = ["GPT", "GPTConfig", "LayerHook", "PRESETS", "REMAT_POLICIES", "gpt_config"]
