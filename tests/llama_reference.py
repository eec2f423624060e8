"""A numpy forward of a Llama-family decoder written from Hugging Face's modeling code
(`LlamaForCausalLM`: `repeat_kv`, `rotate_half`, the "llama3" `rope_scaling`, Qwen2's q/k/v biases,
tied embeddings), independent of `zerojax.models.gpt`, for checking the GPT against it without torch."""

from __future__ import annotations

import math

import numpy as np


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(head_dim, theta, scaling):
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, out)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def forward(params: dict, tokens: np.ndarray, *, n_heads, n_kv_heads, head_dim, eps, theta, scaling=None, tied=False):
    """Logits [B, L, vocab]. `params`: the GPT's flat params ("blocks/wq" stacked over layers), fp64 math."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    B, L = tokens.shape
    x = p["embed"][tokens]
    angles = np.arange(L)[:, None] * _inv_freq(head_dim, theta, scaling)[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # [1, 1, L, head_dim]
    causal = np.tril(np.ones((L, L), bool))
    for i in range(p["blocks/wq"].shape[0]):
        layer = {k.split("/")[1]: v[i] for k, v in p.items() if k.startswith("blocks/")}
        h = _rms_norm(x, layer["attn_norm"], eps)
        q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
        if "bq" in layer:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
        q = q.reshape(B, L, n_heads, head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, n_kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, n_kv_heads, head_dim).transpose(0, 2, 1, 3)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = n_heads // n_kv_heads  # repeat_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, n_heads * head_dim)
        x = x + o @ layer["wo"]
        h = _rms_norm(x, layer["mlp_norm"], eps)
        gate = h @ layer["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["w_up"])) @ layer["w_down"]
    x = _rms_norm(x, p["final_norm"], eps)
    return x @ (p["embed"].T if tied else p["head"])
