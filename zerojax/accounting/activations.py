"""Activation memory of the shipped decoder, per device and micro-batch: the coefficients calibrated
against XLA and the formula the planner adds to the model state. Pure arithmetic, no JAX import."""

from __future__ import annotations

from dataclasses import dataclass

from zerojax.core.remat import REMAT_POLICIES
from zerojax.errors import UserError


@dataclass(frozen=True)
class GPTShape:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int = 256
    kv_dim: int | None = None  # width of k (and of v) per token: key/value heads x head size; None: d_model

    @classmethod
    def of(cls, cfg) -> GPTShape:
        """From the shipped model's `GPTConfig`."""
        kv_dim = cfg.kv_heads * cfg.head_size
        return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size, kv_dim)


@dataclass(frozen=True)
class LayerTerms:
    """Bytes of one layer as d * D + f * F + kv * KV elements per token (compute dtype) + score bytes,
    KV the width of k or v (narrower than D under grouped-query attention)."""

    d: float
    f: float
    score_bytes: float  # per B * H * L * L attention element (scores and softmax are fp32)
    kv: float = 0


@dataclass(frozen=True)
class ActivationModel:
    """Coefficients of `activation_bytes_gpt`, for the SwiGLU / RoPE decoder in `models/gpt.py`.

    Saved per layer across the whole backward, by remat policy (`zerojax.core.remat`):
      full: the layer input only (B*L*D).
      dots: weight-matmul outputs; q, k, v, o, gate, up, down would be 5D + 2F, XLA keeps ~3D + 2F,
        of which k and v (D + 2KV + 2F: measured as a key/value head count falls, 20M GPT).
      none: every internal (norms, q/k/v, attention output, 3-4 SwiGLU tensors, fp32 softmax). Fewer
        key/value heads lowered it by a few KV-widths in all, not per layer: left out (it errs high).
      offload: on the device what `full` keeps (the scan's saved layer inputs); in host memory the
        weight-matmul outputs (`host_saved`: 4D + 2F, counted on the program lowered for a GPU,
        tests/test_remat.py), copied out in the forward and back in the backward. Device side not
        calibrated: XLA:CPU cannot place host memory (see `zerojax.core.remat`).
    Working set: one layer recomputed plus its cotangents during its backward (~2x its internals).
    Logits: B*L*V in fp32 kept for the softmax backward, their fp32 gradient largely written in
    place (6 bytes per element fits better than 4 + 4).
    Calibrated against XLA:CPU memory_analysis().temp_size_in_bytes of the jitted grad step (fp32,
    12 random small shapes): full within 15%, none within 12%, dots only within ~40% (XLA's choice
    of what to recompute varies with shape). All undercount when the batch is so small that
    parameter-sized temporaries (embedding gradients), which this does not model, dominate.
    """

    saved: dict[str, LayerTerms]
    working_set: LayerTerms
    logits_bytes: float  # per B * L * V element
    host_saved: dict[str, LayerTerms]  # per layer, in host memory (remat policies that offload)


ACTIVATION_MODEL = ActivationModel(
    saved={
        "full": LayerTerms(d=1, f=0, score_bytes=0),
        "dots": LayerTerms(d=1, f=2, score_bytes=0, kv=2),
        "none": LayerTerms(d=12, f=5, score_bytes=7),
        "offload": LayerTerms(d=1, f=0, score_bytes=0),
    },
    working_set=LayerTerms(d=14, f=8, score_bytes=8),
    logits_bytes=6,
    host_saved={"offload": LayerTerms(d=2, f=2, score_bytes=0, kv=2)},  # q, k, v, attention out; gate, up
)
assert set(ACTIVATION_MODEL.saved) == set(REMAT_POLICIES), "one set of saved terms per remat policy"


def _layer_bytes(
    t: LayerTerms,
    d_model: int,
    n_heads: int,
    d_ff: int,
    seq_len: int,
    micro_batch: int,
    compute_bytes: float,
    kv_dim: int | None,
) -> float:
    tokens = micro_batch * seq_len
    scores = micro_batch * n_heads * seq_len * seq_len
    kv = d_model if kv_dim is None else kv_dim
    return tokens * (t.d * d_model + t.f * d_ff + t.kv * kv) * compute_bytes + scores * t.score_bytes


def _check_remat(remat: str, model: ActivationModel) -> None:
    if remat not in model.saved:
        raise UserError(f"remat must be one of {', '.join(model.saved)}, got {remat!r}.")


def activation_bytes_gpt(
    d_model: int,
    n_layers: int,
    n_heads: int,
    d_ff: int,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    compute_bytes: float,
    remat: str = "full",
    model: ActivationModel = ACTIVATION_MODEL,
    kv_dim: int | None = None,
) -> int:
    """Peak activation and temporary bytes per device (device memory) for one micro-batch of a
    scanned decoder; `kv_dim` the width of k or v (None: d_model, a key/value head per query head)."""
    _check_remat(remat, model)

    def layer(t: LayerTerms) -> float:
        return _layer_bytes(t, d_model, n_heads, d_ff, seq_len, micro_batch, compute_bytes, kv_dim)

    peak = n_layers * layer(model.saved[remat]) + layer(model.working_set)
    return int(round(peak + micro_batch * seq_len * vocab * model.logits_bytes))


def host_activation_bytes_gpt(
    d_model: int,
    n_layers: int,
    n_heads: int,
    d_ff: int,
    seq_len: int,
    micro_batch: int,
    compute_bytes: float,
    remat: str = "full",
    model: ActivationModel = ACTIVATION_MODEL,
    kv_dim: int | None = None,
) -> int:
    """Saved activations one micro-batch keeps in host memory per device (0 unless `remat` offloads);
    each crosses the host link twice per micro-batch (out in the forward, back in the backward)."""
    _check_remat(remat, model)
    terms = model.host_saved.get(remat)
    if terms is None:
        return 0
    dims = (d_model, n_heads, d_ff, seq_len, micro_batch, compute_bytes, kv_dim)
    return int(round(n_layers * _layer_bytes(terms, *dims)))


def gpt_activation_bytes(shape: GPTShape, seq_len: int, micro_batch: int, compute_bytes: float, remat: str) -> float:
    """`activation_bytes_gpt` of a model shape: device bytes of one micro-batch."""
    dims = (shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff, shape.vocab_size)
    return float(activation_bytes_gpt(*dims, seq_len, micro_batch, compute_bytes, remat, kv_dim=shape.kv_dim))


def gpt_host_activation_bytes(
    shape: GPTShape, seq_len: int, micro_batch: int, compute_bytes: float, remat: str
) -> float:
    """`host_activation_bytes_gpt` of a model shape: host bytes of one micro-batch."""
    dims = (shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff)
    return float(host_activation_bytes_gpt(*dims, seq_len, micro_batch, compute_bytes, remat, kv_dim=shape.kv_dim))


def gpt_layer_saved_bytes(shape: GPTShape, seq_len: int, micro_batch: int, compute_bytes: float, remat: str) -> float:
    """What one layer saves for its backward for one micro-batch (the per-layer term of
    `activation_bytes_gpt`): a pipeline keeps one per layer and iteration in flight."""
    _check_remat(remat, ACTIVATION_MODEL)
    dims = (shape.d_model, shape.n_heads, shape.d_ff, seq_len, micro_batch, compute_bytes, shape.kv_dim)
    return _layer_bytes(ACTIVATION_MODEL.saved[remat], *dims)


def gathered_weights_kept(
    params: float, stage: int, remat: str, param_bytes: float, reshard_after_forward: bool = True
) -> float:
    """Bytes per device of gathered weights the shipped GPT keeps from its forward for its backward:
    at stage 3 without remat each layer's backward reuses the weights its forward gathered, so the
    whole model is held gathered (measured on the 20M GPT: the compiled peak was param_bytes per
    parameter above the estimate without it). With `reshard_after_forward=False` they are kept
    anyway, and counted as such by `analytic.step_temp_bytes`."""
    return param_bytes * params if stage == 3 and remat == "none" and reshard_after_forward else 0.0
