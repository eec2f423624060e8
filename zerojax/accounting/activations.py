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

    @classmethod
    def of(cls, cfg) -> GPTShape:
        """From anything with these attributes, e.g. the shipped model's `GPTConfig`."""
        return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size)


@dataclass(frozen=True)
class LayerTerms:
    """Bytes of one layer as d * D + f * F elements per token (compute dtype) + score bytes."""

    d: float
    f: float
    score_bytes: float  # per B * H * L * L attention element (scores and softmax are fp32)


@dataclass(frozen=True)
class ActivationModel:
    """Coefficients of `activation_bytes_gpt`, for the SwiGLU / RoPE decoder in `models/gpt.py`.

    Saved per layer across the whole backward, by remat policy (`zerojax.core.remat`):
      full: the layer input only (B*L*D).
      dots: weight-matmul outputs; q, k, v, o, gate, up, down would be 5D + 2F, XLA keeps ~3D + 2F.
      none: every internal (norms, q/k/v, attention output, 3-4 SwiGLU tensors, fp32 softmax).
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
        "dots": LayerTerms(d=3, f=2, score_bytes=0),
        "none": LayerTerms(d=12, f=5, score_bytes=7),
        "offload": LayerTerms(d=1, f=0, score_bytes=0),
    },
    working_set=LayerTerms(d=14, f=8, score_bytes=8),
    logits_bytes=6,
    host_saved={"offload": LayerTerms(d=4, f=2, score_bytes=0)},  # q, k, v, attention out; gate, up
)
assert set(ACTIVATION_MODEL.saved) == set(REMAT_POLICIES), "one set of saved terms per remat policy"


def _layer_bytes(
    t: LayerTerms, d_model: int, n_heads: int, d_ff: int, seq_len: int, micro_batch: int, compute_bytes: float
) -> float:
    tokens = micro_batch * seq_len
    scores = micro_batch * n_heads * seq_len * seq_len
    return tokens * (t.d * d_model + t.f * d_ff) * compute_bytes + scores * t.score_bytes


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
) -> int:
    """Peak activation and temporary bytes per device (device memory) for one micro-batch of a
    scanned decoder."""
    _check_remat(remat, model)

    def layer(t: LayerTerms) -> float:
        return _layer_bytes(t, d_model, n_heads, d_ff, seq_len, micro_batch, compute_bytes)

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
) -> int:
    """Saved activations one micro-batch keeps in host memory per device (0 unless `remat` offloads);
    each crosses the host link twice per micro-batch (out in the forward, back in the backward)."""
    _check_remat(remat, model)
    terms = model.host_saved.get(remat)
    if terms is None:
        return 0
    return int(round(n_layers * _layer_bytes(terms, d_model, n_heads, d_ff, seq_len, micro_batch, compute_bytes)))


def gpt_activation_bytes(shape: GPTShape, seq_len: int, micro_batch: int, compute_bytes: float, remat: str) -> float:
    """`activation_bytes_gpt` of a model shape: device bytes of one micro-batch."""
    dims = (shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff, shape.vocab_size)
    return float(activation_bytes_gpt(*dims, seq_len, micro_batch, compute_bytes, remat))


def gpt_host_activation_bytes(
    shape: GPTShape, seq_len: int, micro_batch: int, compute_bytes: float, remat: str
) -> float:
    """`host_activation_bytes_gpt` of a model shape: host bytes of one micro-batch."""
    dims = (shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff)
    return float(host_activation_bytes_gpt(*dims, seq_len, micro_batch, compute_bytes, remat))


def gathered_weights_kept(
    params: float, stage: int, remat: str, param_bytes: float, reshard_after_forward: bool = True
) -> float:
    """Bytes per device of gathered weights the shipped GPT keeps from its forward for its backward:
    at stage 3 without remat each layer's backward reuses the weights its forward gathered, so the
    whole model is held gathered (measured on the 20M GPT: the compiled peak was param_bytes per
    parameter above the estimate without it). With `reshard_after_forward=False` they are kept
    anyway, and counted as such by `analytic.step_temp_bytes`."""
    return param_bytes * params if stage == 3 and remat == "none" and reshard_after_forward else 0.0
