"""Rotary position embeddings: the pairs (i, i + head_dim/2) rotated by position x frequency, as
Llama's `rotate_half` does, with the frequencies `base ** (-2i / head_dim)` and, optionally, Llama
3.1's rescaling of the low frequencies (`rope_scaling` of type "llama3")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zerojax.errors import UserError


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's "llama3" rope scaling: wavelengths longer than `original_max_position_embeddings /
    low_freq_factor` are slowed by `factor`, those shorter than `... / high_freq_factor` kept, and
    the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise UserError(f"model.rope_scaling.rope_type={self.rope_type!r}: only 'llama3' is supported.")
        if not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0):
            raise UserError(
                "model.rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
                f"{self.factor}, {self.high_freq_factor}, {self.low_freq_factor}."
            )

    def rescaled(self, inv_freq: jax.Array) -> jax.Array:
        wavelength = 2 * math.pi / inv_freq
        low = self.original_max_position_embeddings / self.low_freq_factor  # longer: slowed by factor
        high = self.original_max_position_embeddings / self.high_freq_factor  # shorter: kept
        smooth = (self.original_max_position_embeddings / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return jnp.where(wavelength > low, inv_freq / self.factor, jnp.where(wavelength < high, inv_freq, between))


def tables(length: int, head_dim: int, base: float, scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each [length, head_dim / 2]."""
    inv_freq_K2 = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is not None:
        inv_freq_K2 = scaling.rescaled(inv_freq_K2)
    angle_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq_K2[None, :]
    return jnp.cos(angle_LxK2), jnp.sin(angle_LxK2)


def apply(x_BxLxHxK: jax.Array, cos_LxK2: jax.Array, sin_LxK2: jax.Array) -> jax.Array:
    x32 = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # rotate (first half, second half) pairs
    cos, sin = cos_LxK2[None, :, None, :], sin_LxK2[None, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)
