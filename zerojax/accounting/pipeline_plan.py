"""Choosing pipeline x tensor x fsdp on a pod, with the microbatches and accumulation each needs.

For a GPT of `params` parameters on `devices` chips, `global_rows` sequences of `seq_len` tokens a
step, every option splits the devices as p x f x t (pipeline across nodes, the outermost mesh axis;
tensor within a node, the innermost; ZeRO over fsdp between them), runs k accumulation steps of
G / (f k) rows per device and, where p > 1, GPipe (v = 1) or the circular schedule (v chunks of
layers a device) over m microbatches of those rows, gathering a stage's weights once per step or
each layer per microbatch (`zerojax.engines.pipeline`), at ZeRO stage 0-3 (per-microbatch gathers:
stage 3) and, without a pipeline, remat "full", "dots" or "none". A loop runs n = v m + p - 1
iterations, each through a chunk of L / (p v) layers. Per step and device (bf16 compute, bf16 Adam):

  memory    the state of a 1 / (p t) slice as the stage table says over f (`analytic.
            model_state_bytes`; the embedding and head, outside the pipeline, are sharded over
            fsdp x pipeline); what is held whole beyond it (`_whole`);
            p > 1: every layer's input kept for each of the n iterations (each layer recomputed in
            its backward, as remat "full"), and under the circular schedule the m microbatches
            stage 0 holds between repeats; p = 1: the activations `remat` keeps
  compute   (4 + 2 trained + 2 recomputed) params T / (peak x efficiency), T the tokens per device
            (G S / devices), stretched by n / (v m): a stage idles (p - 1) / n of its iterations
  fsdp      stages 0-2: the trained gradient reduced and, at 1-2, the weights gathered back, once a
            step (`analytic.traffic_units`); stage 3, p = 1: two gathers and one reduction per
            accumulation step; p > 1, per step: one gather (kept for the backward) and one
            reduction of the stage's share; per microbatch: the stage's share gathered 2 n / v
            times and reduced n / v times; over the links between nodes where t f spans nodes
  sends     p > 1: each work item's activations to the next stage and their gradient back,
            2 v m b S D bytes (a stage that idles sends nothing), the last stage's outputs summed
            over `pipeline`, and under the circular
            schedule the stage's shards reordered and their gradient back (2 (p - 1) / p of them)
  tensor    Megatron's all-reduces as `tensor_plan` counts them, for every iteration run
  latency   a fixed cost per collective (`tensor_plan.LATENCY_S`)

The step takes max(compute, fsdp, sends, tensor) + latency. A pipeline pays where the fsdp traffic
of a whole model outweighs the compute of the tokens each device sees, and its bubble is the price;
the pick is the fastest option that fits `budget` bytes a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zerojax.accounting.activations import GPTShape, gathered_weights_kept, gpt_activation_bytes, gpt_layer_saved_bytes
from zerojax.accounting.analytic import model_state_bytes, traffic_units
from zerojax.accounting.hardware import Hardware, group_links, node_links
from zerojax.accounting.tensor_plan import LATENCY_S, sizes
from zerojax.core.optim import OPTIMIZERS
from zerojax.core.precision import PRECISIONS
from zerojax.core.stages import STAGES

BYTES = 2  # bf16 weights and activations
# Without a pipeline the search also tries remat "dots" and "none" (no forward recomputed, more kept); a
# pipeline recomputes each layer whatever `model.remat` says (`zerojax.engines.pipeline`).
REMATS = ("full", "dots", "none")


@dataclass(frozen=True)
class Split:
    """One way to lay the devices out and feed them: p x f x t, k accumulation steps, m microbatches,
    v layer chunks a device (`mesh.pipeline_repeats`), the stage's weights gathered `per_step` or
    `per_microbatch` (`zero.pipeline_gather`), at ZeRO `stage` with `remat`."""

    pipeline: int
    tensor: int
    fsdp: int
    grad_accum: int
    microbatches: int  # per accumulation step; 1 without a pipeline
    repeats: int = 1
    gather: str = "per_step"
    stage: int = 3
    remat: str = "full"

    @property
    def iterations(self) -> int:
        """The loop's iterations per accumulation step: v m + p - 1."""
        return self.repeats * self.microbatches + self.pipeline - 1

    @property
    def bubble(self) -> float:
        """The share of iterations a pipeline stage idles: (p - 1) / (v m + p - 1)."""
        return (self.pipeline - 1) / self.iterations


@dataclass(frozen=True)
class PipelineOption:
    split: Split
    state_bytes: float
    whole_bytes: float  # weights and gradients held whole beyond the state (`_whole`)
    activation_bytes: float
    compute_s: float  # bubble included
    fsdp_s: float
    sends_s: float
    tensor_s: float
    latency_s: float

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.whole_bytes + self.activation_bytes

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.fsdp_s, self.sends_s, self.tensor_s) + self.latency_s

    @property
    def bound(self) -> str:
        """What the step waits for: the largest of its overlapped terms."""
        terms = ((self.compute_s, "compute"), (self.fsdp_s, "fsdp traffic"), (self.sends_s, "stage sends"))
        return max((*terms, (self.tensor_s, "tensor traffic")))[1]


@dataclass(frozen=True)
class Pod:
    """What every option shares: the model, the devices and the batch."""

    params: float
    devices: int
    hw: Hardware
    shape: GPTShape
    global_rows: int
    seq_len: int
    efficiency: float
    trainable: float  # fraction of the parameters that train

    @property
    def block_params(self) -> float:
        """One block's parameters: q, k, v, o (q as wide as d_model), the SwiGLU MLP, two norms."""
        d, kv = self.shape.d_model, self.shape.kv_dim or self.shape.d_model
        return d * (d + 2 * kv) + d * d + 3 * d * self.shape.d_ff + 2 * d

    @property
    def stacked_params(self) -> float:
        return min(self.params, self.shape.n_layers * self.block_params)


def _memory(pod: Pod, s: Split) -> tuple[float, float, float]:
    """(state, weights and gradients held whole beyond it, activations) bytes per device."""
    shape, p, t = pod.shape, s.pipeline, s.tensor
    share = (pod.stacked_params / p + pod.params - pod.stacked_params) / t  # one tensor slice of a stage
    # the state as the stage table says: a 1 / (p t) slice of the stack over fsdp, and one tensor
    # slice of the leaves outside it over fsdp x pipeline (whole on every stage where the stage
    # keeps them whole); frozen: bf16 only; trained: + bf16 gradient, fp32 master, Adam
    adam, bf16 = OPTIMIZERS["adam"], PRECISIONS["bf16"]
    parts = ((pod.stacked_params / (p * t), s.fsdp), ((pod.params - pod.stacked_params) / t, s.fsdp * p))
    state = sum(
        model_state_bytes(piece, over, s.stage, bf16, adam, trainable=pod.trainable * piece)["total"]
        for piece, over in parts
        if piece > 0
    )
    rows = pod.global_rows // (s.fsdp * s.grad_accum)  # per device per accumulation step
    whole = _whole(pod, s, share)
    if p == 1:
        return state, whole, gpt_activation_bytes(shape, pod.seq_len, rows, BYTES, s.remat)
    micro, chunk = rows // s.microbatches, shape.n_layers // (p * s.repeats)
    chunk_shape = dataclasses.replace(shape, n_layers=chunk)
    one = gpt_activation_bytes(chunk_shape, pod.seq_len, micro, BYTES, "full")  # a microbatch through a chunk
    kept = (s.iterations - 1) * chunk * gpt_layer_saved_bytes(shape, pod.seq_len, micro, BYTES, "full")
    head = (rows - micro) * pod.seq_len * shape.vocab_size * 6  # the head runs on every row at once
    outputs = 2 * rows * pod.seq_len * shape.d_model * BYTES  # the stack's outputs, and their sum
    held = rows * pod.seq_len * shape.d_model * BYTES if s.repeats > 1 else 0  # stage 0's, between repeats
    return state, whole, one + kept + head + outputs + held


def _whole(pod: Pod, s: Split, share: float) -> float:
    """Bytes of weights and gradients held whole for a step beyond the state. Stage 3 gathers two
    layers at a time (without a pipeline, or per microbatch; without remat every layer's stays for
    the backward), or a pipeline stage's weights once per step, whose trained gradient the loop then
    sums whole over its iterations before the one reduction. At stage 2 a pipeline's loop sums its
    stage's gradient whole too (stages 0-1 hold it whole in the state), and stages 0-2 accumulate
    micro-batches in a whole fp32 gradient (docs/engines.md, "Gradient accumulation")."""
    trained = pod.trainable
    if s.stage == 3:
        if s.pipeline > 1 and s.gather == "per_step":
            return (1 + trained) * BYTES * share
        return gathered_weights_kept(share, 3, s.remat, BYTES) or 2 * BYTES * pod.block_params / s.tensor
    loop = trained * BYTES * share if s.pipeline > 1 and s.stage == 2 else 0.0
    return loop + (trained * 4 * share if s.grad_accum > 1 else 0.0)


def _times(pod: Pod, s: Split) -> tuple[float, float, float, float, float]:
    """(compute, fsdp, sends, tensor, latency) seconds per step and device."""
    node, between = node_links(pod.hw, pod.devices)
    p, t, f, k, m, v = s.pipeline, s.tensor, s.fsdp, s.grad_accum, s.microbatches, s.repeats
    iterations = s.iterations
    tokens = pod.global_rows * pod.seq_len / pod.devices
    recomputes = p > 1 or s.remat == "full"  # the forward again in the backward
    flops = (4 + 2 * pod.trainable + 2 * recomputes) * pod.params * tokens
    compute = flops / (pod.hw.peak_flops * pod.efficiency) * iterations / (v * m)
    stage_share = pod.stacked_params / p / t
    fsdp_bytes, fsdp_collectives = _fsdp(pod, s, stage_share)
    fsdp_link = group_links(pod.hw, t * f).link_bytes_per_s  # a stage's t x f chips, as a ring
    micro_bytes = pod.global_rows // (f * k * m) * pod.seq_len * pod.shape.d_model * BYTES
    reorder = 2 * (p - 1) / p * BYTES * stage_share / f if v > 1 else 0.0
    sends = 0.0 if p == 1 else k * (2 * v * m * micro_bytes + 2 * m * micro_bytes * 2 * (p - 1) / p + reorder)
    sends_link = between if t * f >= node else pod.hw.link_bytes_per_s
    all_reduces = 4 + recomputes  # 2 forward, 2 backward, 1 recomputed
    chunk = pod.shape.n_layers // (p * v)
    tensor_bytes = k * iterations * chunk * all_reduces * micro_bytes * 2 * (t - 1) / t
    latency = fsdp_collectives * (LATENCY_S["between"] if t * f > node else LATENCY_S["node"])
    latency += 0.0 if p == 1 else k * 2 * iterations * LATENCY_S["between" if t * f >= node else "node"]
    latency += k * iterations * chunk * all_reduces * LATENCY_S["node"] if t > 1 else 0.0
    return compute, fsdp_bytes / fsdp_link, sends / sends_link, tensor_bytes / pod.hw.link_bytes_per_s, latency


def _fsdp(pod: Pod, s: Split, stage_share: float) -> tuple[float, float]:
    """(bytes, collectives) a device moves over fsdp a step. Stage 3 gathers every weight and
    reduces its gradient per accumulation step: without a pipeline, regathering for the backward
    (remat "none" keeps the gathered weights instead, `activations.gathered_weights_kept`);
    a pipeline keeps its gather for the step, or gathers each chunk for every iteration, forward
    and backward. Stages 0-2 reduce the trained gradient once a step (stage 0 all-reduces it; gspmd
    accumulating on a pipeline reduces per micro-batch, not modelled here) and,
    at stages 1-2, gather the updated weights back (`analytic.traffic_units`)."""
    p, t, f, k, v = s.pipeline, s.tensor, s.fsdp, s.grad_accum, s.repeats
    rest_share = (pod.params - pod.stacked_params) / t
    layers, chunk = pod.shape.n_layers // p, pod.shape.n_layers // (p * v)
    if f == 1:
        return 0.0, 0.0
    if s.stage < 3:
        gathers, reductions = traffic_units(STAGES[s.stage])
        moved = (gathers + reductions) * pod.trainable * (stage_share + rest_share)
        collectives = layers * (1 + (gathers > 0))  # per leaf: its reduction, and its gather back
        return moved * BYTES * (f - 1) / f, collectives
    if p == 1:  # stage 3 regathers for the backward, but without remat (it keeps every layer's)
        regathers = s.remat != "none"
        moved = (1 + regathers + pod.trainable) * (stage_share + rest_share)
        collectives = layers * (2 + regathers)
    elif s.gather == "per_step":  # a pipeline keeps its gather for the step
        moved, collectives = (1 + pod.trainable) * (stage_share + rest_share), layers * 2
    else:  # every iteration gathers its chunk forward and backward, and reduces it
        moved = (2 + pod.trainable) * s.iterations / v * stage_share + (1 + pod.trainable) * rest_share
        collectives = s.iterations * chunk * 3
    return k * moved * BYTES * (f - 1) / f, k * collectives


def option(pod: Pod, split: Split) -> PipelineOption:
    return PipelineOption(split, *_memory(pod, split), *_times(pod, split))


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def splits(pod: Pod) -> list[Split]:
    """Every layout to try: tensor sizes as `tensor_plan.sizes`, pipeline sizes dividing the layers
    and the devices left, accumulation and microbatches (multiples of p) that split the batch, and
    with a pipeline 1, 2 or 4 repeats that divide the layers, each gathering per step or per microbatch."""
    node, _ = node_links(pod.hw, pod.devices)
    out = []
    for t in sizes(pod.devices, pod.shape, node):
        for p in (p for p in range(1, pod.devices // t + 1) if pod.devices // t % p == 0):
            f = pod.devices // (t * p)
            if pod.shape.n_layers % p or pod.global_rows % f:
                continue
            for k in (k for k in _powers_of_two(pod.global_rows // f) if pod.global_rows // f % k == 0):
                rows = pod.global_rows // (f * k)
                ms = [1] if p == 1 else [p * j for j in _powers_of_two(rows // p) if rows % (p * j) == 0]
                for m in ms:
                    out += [Split(p, t, f, k, m, v, g, *sr) for v, g in _schedules(pod, p, f) for sr in _stages(p, g)]
    return out


def _stages(p: int, gather: str) -> list[tuple[int, str]]:
    """(ZeRO stage, remat) pairs to try: every stage (gathers per microbatch are stage 3's), and
    without a pipeline each of `REMATS`."""
    stages = (3,) if gather == "per_microbatch" else (0, 1, 2, 3)
    return [(st, r) for st in stages for r in (REMATS if p == 1 else ("full",))]


def _schedules(pod: Pod, p: int, f: int) -> list[tuple[int, str]]:
    if p == 1:
        return [(1, "per_step")]
    gathers = ("per_step", "per_microbatch") if f > 1 else ("per_step",)
    return [(v, g) for v in (1, 2, 4) if pod.shape.n_layers % (p * v) == 0 for g in gathers]


def options(pod: Pod) -> list[PipelineOption]:
    return [option(pod, s) for s in splits(pod)]


def best(opts: list[PipelineOption], budget: float, pipelined: bool | None = None) -> PipelineOption | None:
    """The fastest option that fits `budget` bytes a device (None: none does); where two are within
    1%, the smaller pipeline, then less accumulation, then fewer microbatches. `pipelined`: only
    options with (True) or without (False) a pipeline."""
    fits = [o for o in opts if o.memory_bytes <= budget and (pipelined is None or (o.split.pipeline > 1) == pipelined)]
    if not fits:
        return None
    fastest = min(o.step_s for o in fits)
    near = [o for o in fits if o.step_s <= fastest * 1.01]
    return min(near, key=_simplest)


def _simplest(o: PipelineOption):
    """Among near-equal options: the smaller pipeline, less accumulation, fewer microbatches, GPipe
    before the circular schedule, gathers per step before per microbatch, the lower ZeRO stage
    (less sharding), remat "full" before the others, then the faster."""
    s = o.split
    return (
        s.pipeline,
        s.grad_accum,
        s.microbatches,
        s.repeats,
        s.gather != "per_step",
        s.stage,
        s.remat != "full",
        o.step_s,
    )


def smallest(opts: list[PipelineOption], pipelined: bool) -> PipelineOption:
    """The option with (or without) a pipeline that needs the least memory."""
    return min((o for o in opts if (o.split.pipeline > 1) == pipelined), key=lambda o: o.memory_bytes)
