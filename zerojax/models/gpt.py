"""Decoder-only byte-level GPT in Flax NNX: RMSNorm, RoPE, SwiGLU, scanned + rematerialised blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.core import remat as remat_lib
from zerojax.core.constraints import with_logical_constraint
from zerojax.core.remat import check as check_remat
from zerojax.errors import UserError

_NORM_EPS = 1e-6


class LayerHook(Protocol):
    """Called on each layer's stored params inside the scanned, rematerialised body; returns the
    params the layer computes with (FSDP: the gathered weights)."""

    def __call__(self, layer_state: nnx.State, /) -> nnx.State: ...


class LayerLoop(Protocol):
    """Runs the layer loop in the model's place: `layer(x, layer_params) -> x` over the stacked
    params (the shard_map engine's prefetch carries layer i+1's gathered weights through it)."""

    def __call__(
        self, layer: Callable[[jax.Array, nnx.State], jax.Array], x: jax.Array, stacked: nnx.State, /
    ) -> jax.Array: ...


# The weights a LoRA adapter may sit beside, by target name (`LoRAConfig.targets`): the block's
# attribute and the logical names of its input and output axes (A keeps the input's, B the output's).
LORA_TARGETS = {
    "q": ("wq", "embed", "heads"),
    "k": ("wk", "embed", "heads"),
    "v": ("wv", "embed", "heads"),
    "o": ("wo", "heads", "embed"),
    "gate": ("w_gate", "embed", "mlp"),
    "up": ("w_up", "embed", "mlp"),
    "down": ("w_down", "mlp", "embed"),
}


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters beside the blocks' weights: `W x + (alpha / rank) B A x`, A random and B zero
    at init, so step 0 computes the base model. The adapters are `nnx.LoRAParam`s: they alone train
    unless `trainable=` says otherwise."""

    rank: int
    alpha: float | None = None  # None: the rank (a scale of 1)
    targets: tuple[str, ...] = tuple(LORA_TARGETS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise UserError(f"model.lora.rank must be a positive integer, got {self.rank}.")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise UserError(f"model.lora.targets {list(self.targets)}: each must be one of {list(LORA_TARGETS)}.")

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int  # longest sequence the model accepts
    vocab_size: int = 256
    remat: str = "full"  # see `zerojax.core.remat`: full, dots, none, or offload (dots' residuals on the host)
    rope_base: float = 10000.0
    lora: LoRAConfig | None = None  # adapters beside the blocks' weights (a dict is read as one)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        for key in ("d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_size"):
            if getattr(self, key) < 1:
                raise UserError(f"model.{key} must be a positive integer, got {getattr(self, key)}.")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise UserError(
                f"model.d_model={self.d_model} must split into model.n_heads={self.n_heads} heads "
                "of even size (rotary embeddings rotate pairs)."
            )
        check_remat(self.remat)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        d, f = self.d_model, self.d_ff
        per_layer = 2 * d + 4 * d * d + 3 * d * f  # two norms, q/k/v/o, gate/up/down
        base = 2 * self.vocab_size * d + d + self.n_layers * per_layer  # embed + head + final norm
        return base + self.num_lora_params()

    def num_lora_params(self) -> int:
        """The adapters' parameters: rank x (inputs + outputs) per targeted weight and layer."""
        if self.lora is None:
            return 0
        d, f = self.d_model, self.d_ff
        sides = {"q": 2 * d, "k": 2 * d, "v": 2 * d, "o": 2 * d, "gate": d + f, "up": d + f, "down": f + d}
        return self.n_layers * self.lora.rank * sum(sides[t] for t in self.lora.targets)


# Every parameter dim is a multiple of 8 so any leaf can be sharded over up to 8 devices.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, seq_len=64),  # ~0.115M
    "20m": GPTConfig(d_model=512, n_layers=6, n_heads=8, d_ff=1536, seq_len=128),  # ~20.7M
    "50m": GPTConfig(d_model=640, n_layers=10, n_heads=10, d_ff=1792, seq_len=256),  # ~51.1M
    # GPT-2-small shape; the wider MLP stands in for GPT-2's 50k-token embedding to keep ~124M.
    "124m": GPTConfig(d_model=768, n_layers=12, n_heads=12, d_ff=3456, seq_len=1024),  # ~124.3M
    "1b": GPTConfig(d_model=2048, n_layers=20, n_heads=16, d_ff=5632, seq_len=2048),  # ~1.03B
    "7b": GPTConfig(d_model=4096, n_layers=32, n_heads=32, d_ff=11008, seq_len=2048),  # ~6.48B
    "70b": GPTConfig(d_model=8192, n_layers=80, n_heads=64, d_ff=24576, seq_len=4096),  # ~69.8B
}


def gpt_config(preset: str, **overrides) -> GPTConfig:
    if preset not in PRESETS:
        raise UserError(f"model preset {preset!r} is unknown; valid presets are {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[preset], **overrides)


def _param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """A parameter with its logical axis names (`zerojax.core.axis_rules`: Megatron's split of heads, mlp
    and vocab over `tensor`), created unsharded: zerojax lays it out on the mesh itself."""
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, names: tuple[str, ...]) -> nnx.Param:
    return _param(std * jax.random.normal(rngs.params(), shape, jnp.float32), names)


def _adapter(value: jax.Array, names: tuple) -> nnx.LoRAParam:
    return nnx.LoRAParam(value, out_sharding=names, eager_sharding=False)


def _ones(size: int) -> nnx.Param:
    return _param(jnp.ones((size,), jnp.float32), ("embed",))


def _rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array) -> jax.Array:
    # Statistics in float32 even when activations are bf16.
    x32 = x_BxLxD.astype(jnp.float32)
    y32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + _NORM_EPS)
    return (y32 * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def _rope_tables(length: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    inv_freq_K2 = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angle_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq_K2[None, :]
    return jnp.cos(angle_LxK2), jnp.sin(angle_LxK2)


def _apply_rope(x_BxLxHxK: jax.Array, cos_LxK2: jax.Array, sin_LxK2: jax.Array) -> jax.Array:
    x32 = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # rotate (first half, second half) pairs
    cos, sin = cos_LxK2[None, :, None, :], sin_LxK2[None, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)


def _residual(x_BxLxD: jax.Array) -> jax.Array:
    """The residual stream between blocks: split over the sequence where the axis rules map `seq`
    (sequence parallelism), so the norms run on a slice and each block's tensor all-reduce becomes a
    reduce-scatter here and an all-gather before its matmuls."""
    return with_logical_constraint(x_BxLxD, ("batch", "seq", "embed"))


class Block(nnx.Module):
    """Pre-norm transformer block: causal multi-head attention, then a SwiGLU MLP; no biases."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5  # GPT-2: residual writes shrink with depth
        self.n_heads = cfg.n_heads
        # Megatron: q/k/v and gate/up split their outputs (heads, mlp) over `tensor`, o and down their
        # inputs, so each block's forward needs one all-reduce after attention and one after the MLP.
        self.attn_norm = _ones(d)
        self.wq = _normal(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wk = _normal(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wv = _normal(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wo = _normal(rngs, (d, d), out_std, ("heads", "embed"))
        self.mlp_norm = _ones(d)
        self.w_gate = _normal(rngs, (d, f), 0.02, ("embed", "mlp"))
        self.w_up = _normal(rngs, (d, f), 0.02, ("embed", "mlp"))
        self.w_down = _normal(rngs, (f, d), out_std, ("mlp", "embed"))
        self.lora_scale = cfg.lora.scale if cfg.lora else 0.0
        if cfg.lora is not None:
            self._add_adapters(cfg.lora, rngs)

    def _add_adapters(self, lora: LoRAConfig, rngs: nnx.Rngs) -> None:
        """A (inputs x rank) drawn from a normal scaled by the fan-in, B (rank x outputs) zero."""
        for target in lora.targets:
            attr, in_name, out_name = LORA_TARGETS[target]
            d_in, d_out = getattr(self, attr).shape
            a = jax.random.normal(rngs.params(), (d_in, lora.rank), jnp.float32) * d_in**-0.5
            setattr(self, f"{target}_lora_a", _adapter(a, (in_name, None)))
            setattr(self, f"{target}_lora_b", _adapter(jnp.zeros((lora.rank, d_out), jnp.float32), (None, out_name)))

    def _lora(self, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """`y` (x times the target's weight) plus the target's adapter on `x`, where it has one."""
        if not hasattr(self, f"{target}_lora_a"):
            return y
        a, b = getattr(self, f"{target}_lora_a")[...], getattr(self, f"{target}_lora_b")[...]
        return y + self.lora_scale * ((x @ a.astype(x.dtype)) @ b.astype(x.dtype)).astype(y.dtype)

    def _attention(self, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H = self.n_heads
        K = D // H
        # One contraction for q, k and v: with heads split over `tensor`, the backward's three partial
        # input gradients are summed before their one all-reduce (three separate matmuls: three).
        w_3xDxD = jnp.stack([self.wq[...], self.wk[...], self.wv[...]])
        qkv_3xBxLxD = jnp.einsum("bld,tde->tble", x_BxLxD, w_3xDxD)
        q_BxLxD, k_BxLxD, v_BxLxD = (self._lora(t, x_BxLxD, qkv_3xBxLxD[i]) for i, t in enumerate("qkv"))
        q_BxLxHxK = _apply_rope(q_BxLxD.reshape(B, L, H, K), cos, sin)
        k_BxLxHxK = _apply_rope(k_BxLxD.reshape(B, L, H, K), cos, sin)
        v_BxLxHxK = v_BxLxD.reshape(B, L, H, K)
        s_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32) * (K**-0.5)
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, jnp.finfo(jnp.float32).min)
        p_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
        o_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", p_BxHxLxL, v_BxLxHxK)
        o_BxLxD = o_BxLxHxK.reshape(B, L, D)
        return self._lora("o", o_BxLxD, o_BxLxD @ self.wo[...])

    def __call__(self, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self._attention(_rms_norm(x_BxLxD, self.attn_norm[...]), cos, sin)
        h_BxLxD = _rms_norm(x_BxLxD, self.mlp_norm[...])
        gate_up_2xBxLxF = jnp.einsum("bld,tdf->tblf", h_BxLxD, jnp.stack([self.w_gate[...], self.w_up[...]]))
        gate_BxLxF = self._lora("gate", h_BxLxD, gate_up_2xBxLxF[0])
        up_BxLxF = self._lora("up", h_BxLxD, gate_up_2xBxLxF[1])
        a_BxLxF = jax.nn.silu(gate_BxLxF) * up_BxLxF
        return x_BxLxD + self._lora("down", a_BxLxF, a_BxLxF @ self.w_down[...])


class GPT(nnx.Module):
    # The params whose leaves stack the layers on axis 0 (built by one `nnx.vmap`): zerojax keeps
    # that axis whole and gathers one layer at a time through `layer_hook`.
    layer_stacks = ("blocks",)

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02, ("vocab", "embed"))

        # One vmapped construction: every leaf under `blocks` gets a leading n_layers axis.
        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = _ones(cfg.d_model)
        self.head = _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, ("embed", "vocab"))

    def __call__(
        self, tokens_BxL: jax.Array, *, layer_hook: LayerHook | None = None, layer_loop: LayerLoop | None = None
    ) -> jax.Array:
        cfg = self.cfg
        L = tokens_BxL.shape[1]
        if L > cfg.seq_len:
            raise UserError(f"sequence length {L} exceeds model.seq_len={cfg.seq_len}.")
        x_BxLxD = _residual(jnp.take(self.embed[...], tokens_BxL, axis=0))  # activations in param dtype
        cos, sin = _rope_tables(L, cfg.head_dim, cfg.rope_base)
        graphdef, stacked = nnx.split(self.blocks)

        def body(x_BxLxD: jax.Array, layer_state: nnx.State) -> tuple[jax.Array, None]:
            # Hook runs inside the remat'd body: FSDP all-gathers this layer's shards here, so the
            # backward pass re-gathers them and the gather's transpose reduce-scatters the grads.
            if layer_hook is not None:
                layer_state = layer_hook(layer_state)
            return _residual(nnx.merge(graphdef, layer_state)(x_BxLxD, cos, sin)), None

        if layer_loop is not None:  # it materialises each layer's params itself
            x_BxLxD = layer_loop(
                lambda x, layer_state: _residual(nnx.merge(graphdef, layer_state)(x, cos, sin)), x_BxLxD, stacked
            )
        else:
            x_BxLxD, _ = jax.lax.scan(remat_lib.remat(body, cfg.remat), x_BxLxD, stacked)
        h_BxLxD = _rms_norm(x_BxLxD, self.final_norm[...])
        return jnp.einsum("bld,dv->blv", h_BxLxD, self.head[...], preferred_element_type=jnp.float32)
