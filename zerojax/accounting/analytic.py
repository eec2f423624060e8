"""Analytic ZeRO model: the bytes each device holds, the bytes it moves per step, and their time.

Pure arithmetic on parameter counts and the stage table in `zerojax.core.stages`; no JAX import, so
`zerojax plan` starts instantly and every number can be checked by hand against the ZeRO paper
(Rajbhandari et al. 2020, table 1 and section 7). Bytes are per device; GB means 1e9 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerojax.accounting.activations import GPTShape
from zerojax.accounting.hardware import Hardware, group_links
from zerojax.core.optim import Optimizer
from zerojax.core.precision import Precision
from zerojax.core.stages import GROUPS, Stage, get_stage, sharded_groups
from zerojax.errors import UserError

# --- optimizer state: bytes per parameter -------------------------------------------------
# Precision (`zerojax.core.precision`) and the optimizer registry (`zerojax.core.optim`) are the library's
# own: the planner reads their bytes per parameter and state slots, it keeps no lists of its own.

# Without leaf shapes, a factored second moment is approximated as 1% of a full fp32 one: an r x c
# matrix keeps r + c statistics, 2/d of its r * c entries for a square d x d matrix, so 1% is the
# d = 200 case and an overestimate for any larger model.
_FACTORED_FRACTION = 0.01
_FACTOR_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor: smaller dims keep full stats


def optimizer_state_bytes(optimizer: Optimizer, params: float, shapes: list[tuple[int, ...]] | None = None) -> float:
    """Unsharded fp32 optimizer state; `shapes` (one per leaf) makes Adafactor exact."""
    if not optimizer.factored:
        return 4.0 * optimizer.slots * params
    if shapes is None:
        return 4.0 * _FACTORED_FRACTION * params
    return 4.0 * sum(_factored_numel(tuple(s)) for s in shapes)


def _factored_numel(shape: tuple[int, ...]) -> int:
    if len(shape) < 2 or min(shape[-2:]) < _FACTOR_MIN_DIM:
        return math.prod(shape)
    rows, cols = shape[:-1], shape[:-2] + shape[-1:]  # v_row and v_col of the last two axes
    return math.prod(rows) + math.prod(cols)


# --- memory and traffic per stage ----------------------------------------------------------


def check_inputs(params: float, devices: int) -> None:
    if not params > 0:
        raise UserError(f"the parameter count must be positive, got {params!r}.")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserError(f"the device count must be a positive integer, got {devices!r}.")


def trained(params: float, trainable: float | None) -> float:
    """The parameters that train: `trainable` of `params` (None: all of them)."""
    if trainable is None:
        return params
    if not 0 < trainable <= params:
        raise UserError(f"the trainable parameter count must be in (0, {params:g}], got {trainable!r}.")
    return trainable


def model_state_bytes(
    params: float,
    devices: int,
    stage: int,
    policy: Precision,
    optimizer: Optimizer,
    include_grads: bool = True,
    shapes: list[tuple[int, ...]] | None = None,
    trainable: float | None = None,
) -> dict[str, float]:
    """Persistent bytes one device holds, by group (and `total`), for a ZeRO stage.

    `trainable` of the `params` train (None: all); the frozen rest is held only as compute params
    (in the compute dtype, sharded where they are: stage 3), with no master, optimizer state or
    gradient. Sharding is taken as exact 1/devices; `zerojax.core.stages` pads uneven leaves, which
    adds at most one row per leaf.
    """
    check_inputs(params, devices)
    trains = trained(params, trainable)
    full = {
        "compute_params": float(policy.param_bytes * params),
        "master": float(policy.master_bytes * trains),
        "optimizer": optimizer_state_bytes(optimizer, trains, shapes if trainable is None else None),
        "grads": float(policy.grad_bytes * trains) if include_grads else 0.0,
    }
    sharded = sharded_groups(get_stage(stage))
    out = {g: full[g] / devices if sharded[g] else full[g] for g in GROUPS}
    out["total"] = sum(out[g] for g in GROUPS)
    return out


def kept_state_bytes(
    params: float,
    devices: int,
    stage: int,
    policy: Precision,
    optimizer: Optimizer,
    shapes: list[tuple[int, ...]] | None = None,
    trainable: float | None = None,
) -> dict[str, float]:
    """The persistent bytes zerojax itself keeps per device, by group (and `total`).

    Unlike the textbook `model_state_bytes`: no gradients (they live only inside the step), and at
    stage 3 no separate compute copy of what trains (each fp32 shard is cast right before it is
    gathered), so bf16 stage 3 keeps 12 bytes per parameter over p, not 14 (or 16 with gradients).
    Frozen parameters are kept as their compute copy alone: `2 * Psi_frozen / p` more in bf16.
    """
    out = model_state_bytes(params, devices, stage, policy, optimizer, False, shapes, trainable)
    if get_stage(stage).compute_params and policy.master_bytes:
        frozen = params - trained(params, trainable)
        kept = policy.param_bytes * frozen / devices
        out["total"] -= out["compute_params"] - kept
        out["compute_params"] = kept
    return out


def traffic_units(
    stage: Stage, grad_accum: int = 1, reshard_after_forward: bool = True, *, reduce_each_micro_batch: bool = False
) -> tuple[int, int]:
    """(param all-gathers, gradient reductions) per step, in units of b * params * (p - 1) / p.

    A ring all-gather or reduce-scatter sends (p - 1)/p of the full tensor from every device; an
    all-reduce is the two back to back, 2 units.

    With `grad_accum` = k micro-batches per step, stages 0-2 still reduce once per step (the local
    gradient is accumulated, then reduced), but stage 3 gathers and reduce-scatters per micro-batch:
    k times the traffic. Stage 3 with `reshard_after_forward=False` gathers once per step and keeps
    the whole weights: 1 gather and 1 reduction, whatever k. `reduce_each_micro_batch` (the gspmd
    engine's whole micro-batches, and its pipelines): stages 0-2 reduce each micro-batch's gradient
    too, k reductions, and still gather once.
    """
    if stage.compute_params and not reshard_after_forward:
        return 1, 1
    # Stage 3 gathers the compute params twice: in the forward and again in the rematerialised
    # backward. Stages 1-2 gather once, to rebuild the replicated params after the sharded update.
    gathers = 2 if stage.compute_params else (1 if stage.master_params else 0)
    # A sharded update needs only the local gradient shard: one reduce-scatter. (An implementation
    # that all-reduces and then slices, as the stage-1 row of the table allows, moves 1 unit more.)
    reductions = 1 if stage.optimizer else 2
    if stage.compute_params:
        return gathers * grad_accum, reductions * grad_accum
    return gathers, reductions * (grad_accum if reduce_each_micro_batch else 1)


def traffic_bytes(
    params: float,
    devices: int,
    stage: int,
    compute_bytes: float,
    reduce_bytes: float | None = None,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    trainable: float | None = None,
    *,
    reduce_each_micro_batch: bool = False,
) -> dict[str, float]:
    """Bytes one device sends per optimizer step (ring collectives; `grad_accum` micro-batches per
    step, see `traffic_units`, as `reduce_each_micro_batch`).

    Parameters are gathered in the compute dtype (`compute_bytes`), gradients reduced in the reduce
    dtype (`reduce_bytes`, default: the compute dtype). Of `trainable` parameters only (None: all)
    are gradients reduced, and at stages 1-2 the updated params gathered; stage 3 gathers the frozen
    ones too, as any weight.
    """
    check_inputs(params, devices)
    trains = trained(params, trainable)
    st = get_stage(stage)
    ring = (devices - 1) / devices
    gathers, reductions = traffic_units(
        st, grad_accum, reshard_after_forward, reduce_each_micro_batch=reduce_each_micro_batch
    )
    reduce_bytes = compute_bytes if reduce_bytes is None else reduce_bytes
    gathered = params if st.compute_params else trains
    out = {
        "param_allgather": gathers * compute_bytes * gathered * ring,
        "grad_reduce": reductions * reduce_bytes * trains * ring,
    }
    out["total"] = out["param_allgather"] + out["grad_reduce"]
    return out


# --- temporaries and peak ---------------------------------------------------------------


def step_temp_bytes(
    params: float,
    devices: int,
    stage: int,
    policy: Precision,
    activations: float,
    streamed: float = 0.0,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    trainable: float | None = None,
    *,
    reduce_each_micro_batch: bool = False,
) -> float:
    """Temporaries of one train step per device (beside the kept state): the activations, the
    gradients (whole at stages 0-1, only this device's shard at 2-3) and one fp32 update-sized buffer
    on the optimizer's layout (whole at stage 0, sharded from stage 1).

    `streamed`: kept bytes that live in host memory between steps (`zero.offload`) and are brought
    into device memory for the update, at most all at once. The update runs after the backward has
    freed the activations, so the larger of the two counts, not their sum.

    `grad_accum` > 1 (docs/engines.md, "Gradient accumulation"): stages 0-2 reduce once after the
    micro-batch loop, so each device holds its whole unreduced micro-batch gradient and a whole fp32
    accumulator through the step; stage 3 reduces per micro-batch, so both are shards, unless
    `reshard_after_forward=False`, which also keeps the whole compute-dtype weights gathered.
    `reduce_each_micro_batch` (`traffic_units`): stage 2 then holds both as shards too.

    A rough sum, not a schedule: XLA overlaps some of these (activations are freed before the update)
    and keeps others this does not model (the scan's stacked gradient accumulators; bf16 matmul
    operands upcast to f32 on CPU). `zerojax compare` prints measured / this ratio beside it.
    """
    st = get_stage(stage)
    trains = trained(params, trainable)  # gradients, updates and accumulators: of these only
    grads = policy.grad_bytes * trains / (devices if st.gradients else 1)
    update = 4.0 * trains / (devices if st.optimizer else 1)
    accumulate = 0.0
    if grad_accum > 1:
        # reduced inside the loop, to shards
        per_micro_batch = (st.compute_params and reshard_after_forward) or (st.gradients and reduce_each_micro_batch)
        grads = policy.grad_bytes * trains / (devices if per_micro_batch else 1)
        accumulate = 4.0 * trains / (devices if per_micro_batch else 1)
        if st.compute_params and not reshard_after_forward:
            accumulate += policy.param_bytes * params  # the gathered weights, kept across micro-batches
    return max(activations, streamed) + grads + update + accumulate


def peak_bytes(arguments: float, outputs: float, aliased: float, temporaries: float) -> float:
    """Peak bytes of a compiled program from its `memory_analysis()` sizes: everything live at once in
    the worst case (XLA's own peak figure is not reported consistently on CPU)."""
    return arguments + outputs - aliased + temporaries


# --- time ----------------------------------------------------------------------------------


def flops_per_step(
    params: float, tokens: float, n_layers: int = 0, d_model: int = 0, seq_len: int = 0, trainable: float | None = None
) -> float:
    """Training FLOPs: 6 per parameter per token (forward 2, backward 4: 2 for the input's gradient,
    2 for the weight's, which a frozen parameter skips) plus causal attention's score and value
    matmuls, 12 * n_layers * d_model * seq_len per token (omitted without a shape). Full remat re-runs
    the forward, which this deliberately does not count: MFU conventions don't.
    """
    weights = 4.0 * params + 2.0 * trained(params, trainable)
    return weights * tokens + 12.0 * n_layers * d_model * seq_len * tokens


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float

    @property
    def bound(self) -> str:
        return "communication" if self.comm_s > self.compute_s else "compute"

    @property
    def step_s(self) -> float:
        """With collectives fully overlapped with compute; the sum is the no-overlap bound."""
        return max(self.compute_s, self.comm_s)


def step_time_estimate(
    params: float,
    devices: int,
    stage: int,
    hardware: Hardware,
    tokens_per_device: float,
    compute_bytes: float = 2,
    shape: GPTShape | None = None,
    seq_len: int = 0,
    mfu: float = 1.0,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    trainable: float | None = None,
) -> StepTime:
    """Compute at `mfu` x peak (default 1.0: the ideal, so times are lower bounds) and traffic at
    the per-direction rate of the links a ring over the `devices` runs through: between nodes where
    they span nodes (`hardware.group_links`)."""
    attn = (shape.n_layers, shape.d_model, seq_len) if shape else (0, 0, 0)
    flops = flops_per_step(params, tokens_per_device, *attn, trainable=trainable)
    traffic = traffic_bytes(
        params,
        devices,
        stage,
        compute_bytes,
        grad_accum=grad_accum,
        reshard_after_forward=reshard_after_forward,
        trainable=trainable,
    )["total"]
    link = group_links(hardware, devices).link_bytes_per_s
    return StepTime(flops / (hardware.peak_flops * mfu), traffic / link)


def comm_bound_tokens_per_device(
    hw: Hardware,
    stage: int,
    compute_bytes: float = 2,
    devices: int | None = None,
    mfu: float = 1.0,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
) -> float:
    """Tokens per device per step below which a step is communication-bound.

    compute = 6 * P * t / (F * mfu) and comm = k * b * P * (p - 1) / p / BW, with k the stage's
    traffic units; equal at t* = k * b * (p - 1) / p * F * mfu / (6 * BW). P cancels: the threshold
    depends on the hardware's FLOP-to-byte ratio, not the model size. Without `devices`, the
    large-p limit (p - 1) / p = 1 on one node's links; with them, BW is the rate of the links their
    ring runs through (`hardware.group_links`). Attention FLOPs are ignored, so t* is slightly high.
    """
    k = sum(traffic_units(get_stage(stage), grad_accum, reshard_after_forward))
    ring = (devices - 1) / devices if devices else 1.0
    link = group_links(hw, devices).link_bytes_per_s if devices else hw.link_bytes_per_s
    return k * compute_bytes * ring * hw.peak_flops * mfu / (6.0 * link)
