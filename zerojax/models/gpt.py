"""Decoder-only GPT in Flax NNX: RMSNorm, RoPE, SwiGLU, scanned + rematerialised blocks; byte-level
by default, and wide enough for the Llama family (grouped-query attention, an explicit head size,
rope scaling, q/k/v biases, tied embeddings)."""

from __future__ import annotations

import dataclasses
import math
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
from zerojax.models import rope
from zerojax.models.rope import RopeScaling


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
    "k": ("wk", "embed", "kv_heads"),
    "v": ("wv", "embed", "kv_heads"),
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
    rope_base: float = 10000.0  # rotary base (Hugging Face's rope_theta)
    lora: LoRAConfig | None = None  # adapters beside the blocks' weights (a dict is read as one)
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: n_heads
    head_dim: int | None = None  # the size of a head; None: d_model / n_heads
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    rope_scaling: RopeScaling | None = None  # Llama 3.1's rescaled frequencies (a dict is read as one)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    tie_embeddings: bool = False  # the head is the embedding, transposed (Llama 3.2)

    def __post_init__(self) -> None:
        for key, kind in (("lora", LoRAConfig), ("rope_scaling", RopeScaling)):
            if isinstance(getattr(self, key), dict):
                object.__setattr__(self, key, kind(**getattr(self, key)))
        for key in ("d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_size", "kv_heads", "head_size"):
            if getattr(self, key) < 1:
                raise UserError(f"model.{key} must be a positive integer, got {getattr(self, key)}.")
        if self.head_dim is None and self.d_model % self.n_heads or self.head_size % 2:
            raise UserError(
                f"model.d_model={self.d_model} must split into model.n_heads={self.n_heads} heads "
                "of even size (rotary embeddings rotate pairs), or give model.head_dim."
            )
        if self.n_heads % self.kv_heads:
            raise UserError(f"model.n_kv_heads={self.kv_heads} must divide model.n_heads={self.n_heads}.")
        check_remat(self.remat)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """One block's parameter shapes by attribute, its adapters left out."""
        d, f, q, kv = self.d_model, self.d_ff, self.n_heads * self.head_size, self.kv_heads * self.head_size
        shapes = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
        shapes |= {"mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
        return shapes | ({"bq": (q,), "bk": (kv,), "bv": (kv,)} if self.qkv_bias else {})

    def num_params(self) -> int:
        d = self.d_model
        per_layer = sum(math.prod(s) for s in self.block_shapes().values())
        head = 0 if self.tie_embeddings else d * self.vocab_size
        base = self.vocab_size * d + head + d + self.n_layers * per_layer  # embed + head + final norm
        return base + self.num_lora_params()

    def num_lora_params(self) -> int:
        """The adapters' parameters: rank x (inputs + outputs) per targeted weight and layer."""
        if self.lora is None:
            return 0
        shapes = self.block_shapes()
        return self.n_layers * self.lora.rank * sum(sum(shapes[LORA_TARGETS[t][0]]) for t in self.lora.targets)


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


def _rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32 even when activations are bf16.
    x32 = x_BxLxD.astype(jnp.float32)
    y32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y32 * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def _residual(x_BxLxD: jax.Array) -> jax.Array:
    """The residual stream between blocks: split over the sequence where the axis rules map `seq`
    (sequence parallelism), so the norms run on a slice and each block's tensor all-reduce becomes a
    reduce-scatter here and an all-gather before its matmuls."""
    return with_logical_constraint(x_BxLxD, ("batch", "seq", "embed"))


class Block(nnx.Module):
    """Pre-norm transformer block: causal attention (grouped-query where there are fewer key/value
    heads), then a SwiGLU MLP; biases on q, k and v only where the config asks."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5  # GPT-2: residual writes shrink with depth
        self.n_heads, self.kv_heads, self.head_size, self.eps = cfg.n_heads, cfg.kv_heads, cfg.head_size, cfg.norm_eps
        # Megatron: q/k/v and gate/up split their outputs (heads, mlp) over `tensor`, o and down their
        # inputs, so each block's forward needs one all-reduce after attention and one after the MLP.
        self.attn_norm = _ones(d)
        self.wq = _normal(rngs, (d, q), 0.02, ("embed", "heads"))
        self.wk = _normal(rngs, (d, kv), 0.02, ("embed", "kv_heads"))
        self.wv = _normal(rngs, (d, kv), 0.02, ("embed", "kv_heads"))
        self.wo = _normal(rngs, (q, d), out_std, ("heads", "embed"))
        if cfg.qkv_bias:
            self.bq = _param(jnp.zeros((q,), jnp.float32), ("heads",))
            self.bk = _param(jnp.zeros((kv,), jnp.float32), ("kv_heads",))
            self.bv = _param(jnp.zeros((kv,), jnp.float32), ("kv_heads",))
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

    def _qkv(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        weights = (self.wq[...], self.wk[...], self.wv[...])
        if weights[0].shape == weights[1].shape:
            # One contraction for q, k and v: with heads split over `tensor`, the backward's three
            # partial input gradients are summed before their one all-reduce (three matmuls: three).
            qkv_3xBxLxE = jnp.einsum("bld,tde->tble", x_BxLxD, jnp.stack(weights))
            outs = [qkv_3xBxLxE[i] for i in range(3)]
        else:  # grouped-query attention: k and v are narrower than q
            outs = [x_BxLxD @ w for w in weights]
        outs = [self._lora(t, x_BxLxD, y) for t, y in zip("qkv", outs)]
        if hasattr(self, "bq"):
            outs = [y + b[...].astype(y.dtype) for y, b in zip(outs, (self.bq, self.bk, self.bv))]
        return outs[0], outs[1], outs[2]

    def _attention(self, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, L, _ = x_BxLxD.shape
        H, G, K = self.n_heads, self.kv_heads, self.head_size
        q_BxLxE, k_BxLxE, v_BxLxE = self._qkv(x_BxLxD)
        q_BxLxHxK = rope.apply(q_BxLxE.reshape(B, L, H, K), cos, sin)
        # Each key/value head serves H / G consecutive query heads (Hugging Face's `repeat_kv`).
        k_BxLxHxK = jnp.repeat(rope.apply(k_BxLxE.reshape(B, L, G, K), cos, sin), H // G, axis=2)
        v_BxLxHxK = jnp.repeat(v_BxLxE.reshape(B, L, G, K), H // G, axis=2)
        s_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32) * (K**-0.5)
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, jnp.finfo(jnp.float32).min)
        p_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
        o_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", p_BxHxLxL, v_BxLxHxK)
        o_BxLxE = o_BxLxHxK.reshape(B, L, H * K)
        return self._lora("o", o_BxLxE, o_BxLxE @ self.wo[...])

    def __call__(self, x_BxLxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self._attention(_rms_norm(x_BxLxD, self.attn_norm[...], self.eps), cos, sin)
        h_BxLxD = _rms_norm(x_BxLxD, self.mlp_norm[...], self.eps)
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
        if not cfg.tie_embeddings:
            self.head = _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, ("embed", "vocab"))

    def __call__(
        self, tokens_BxL: jax.Array, *, layer_hook: LayerHook | None = None, layer_loop: LayerLoop | None = None
    ) -> jax.Array:
        cfg = self.cfg
        L = tokens_BxL.shape[1]
        if L > cfg.seq_len:
            raise UserError(f"sequence length {L} exceeds model.seq_len={cfg.seq_len}.")
        x_BxLxD = _residual(jnp.take(self.embed[...], tokens_BxL, axis=0))  # activations in param dtype
        cos, sin = rope.tables(L, cfg.head_size, cfg.rope_base, cfg.rope_scaling)
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
        h_BxLxD = _rms_norm(x_BxLxD, self.final_norm[...], cfg.norm_eps)
        if cfg.tie_embeddings:
            return jnp.einsum("bld,vd->blv", h_BxLxD, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("bld,dv->blv", h_BxLxD, self.head[...], preferred_element_type=jnp.float32)
