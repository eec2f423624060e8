"""The planner's per-stage verdict: memory, traffic and step time of every ZeRO stage for one model
and machine, and which stage to use (`zerojax plan`'s table). Pure arithmetic on `analytic`'s formulas."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerojax.accounting.activations import GPTShape, gathered_weights_kept, gpt_activation_bytes
from zerojax.accounting.analytic import (
    StepTime,
    check_inputs,
    comm_bound_tokens_per_device,
    kept_state_bytes,
    model_state_bytes,
    step_time_estimate,
    traffic_bytes,
    trained,
)
from zerojax.accounting.hardware import Hardware, group_links
from zerojax.core.optim import OPTIMIZERS, Optimizer
from zerojax.core.precision import PRECISIONS, Precision
from zerojax.core.stages import GROUPS, STAGES
from zerojax.errors import UserError


@dataclass(frozen=True)
class StagePlan:
    stage: int
    memory: dict[str, float]  # persistent bytes per device by group, and "total"
    activation_bytes: float | None  # None without a model shape
    traffic: dict[str, float]  # param_allgather, grad_reduce, total
    time: StepTime
    fits: bool
    comm_bound_below_tokens: float  # per device per step


@dataclass(frozen=True)
class Recommendation:
    stage: int | None  # None: no stage fits
    reason: str
    comm_bound_below_tokens: float | None  # per device per step, for the recommended stage
    min_micro_batch: int | None  # sequences per device per step to be compute-bound


@dataclass(frozen=True)
class Plan:
    params: float
    devices: int
    hardware: Hardware
    precision: Precision
    optimizer: Optimizer
    seq_len: int
    micro_batch: int  # sequences per device per micro-batch
    mfu: float
    shape: GPTShape | None
    stages: tuple[StagePlan, ...]
    recommendation: Recommendation
    grad_accum: int = 1  # micro-batches per step
    reshard_after_forward: bool = True
    trainable: float | None = None  # the parameters that train; None: all


def check_plan_inputs(params: float, devices: int, seq_len: int, micro_batch: int, grad_accum: int, mfu: float) -> None:
    """A `UserError` for a count that is not positive or an `mfu` outside (0, 1]."""
    check_inputs(params, devices)
    for key, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{key} must be a positive integer, got {value!r}.")
    if not 0 < mfu <= 1:
        raise UserError(f"mfu must be in (0, 1], got {mfu!r}.")


def stage_plan(
    stage: int,
    params: float,
    devices: int,
    hardware: Hardware,
    *,
    seq_len: int,
    micro_batch: int,
    precision: Precision,
    optimizer: Optimizer,
    shape: GPTShape | None,
    remat: str,
    mfu: float,
    grad_accum: int,
    reshard_after_forward: bool,
    trainable: float | None = None,
) -> StagePlan:
    """One stage's memory, traffic and time, and whether its state and one micro-batch's activations
    (with the gathered weights the shipped GPT keeps for its backward) fit the device."""
    b = precision.param_bytes
    act = gpt_activation_bytes(shape, seq_len, micro_batch, b, remat) if shape is not None else None
    held = gathered_weights_kept(params, stage, remat, b, reshard_after_forward) if shape is not None else 0.0
    memory = model_state_bytes(params, devices, stage, precision, optimizer, trainable=trainable)
    tokens = grad_accum * micro_batch * seq_len
    return StagePlan(
        stage=stage,
        memory=memory,
        activation_bytes=act,
        traffic=traffic_bytes(
            params,
            devices,
            stage,
            b,
            grad_accum=grad_accum,
            reshard_after_forward=reshard_after_forward,
            trainable=trainable,
        ),
        time=step_time_estimate(
            params,
            devices,
            stage,
            hardware,
            tokens,
            b,
            shape,
            seq_len,
            mfu,
            grad_accum,
            reshard_after_forward,
            trainable,
        ),
        fits=memory["total"] + (act or 0.0) + held <= hardware.hbm_bytes,
        comm_bound_below_tokens=comm_bound_tokens_per_device(
            hardware, stage, b, devices, mfu, grad_accum, reshard_after_forward
        ),
    )


def plan(
    params: float,
    devices: int,
    hardware: Hardware,
    seq_len: int,
    micro_batch: int,
    precision: Precision = PRECISIONS["bf16"],
    optimizer: Optimizer = OPTIMIZERS["adamw"],
    shape: GPTShape | None = None,
    remat: str = "full",
    mfu: float = 1.0,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    trainable: float | None = None,
) -> Plan:
    """Every stage side by side, and the one to use. `micro_batch` sequences per device per
    micro-batch, `grad_accum` micro-batches per step: activations are one micro-batch's, compute is
    the whole step's, and stage 3's traffic is per micro-batch (see `traffic_units`)."""
    check_plan_inputs(params, devices, seq_len, micro_batch, grad_accum, mfu)
    rows = tuple(
        stage_plan(
            st.index,
            params,
            devices,
            hardware,
            seq_len=seq_len,
            micro_batch=micro_batch,
            precision=precision,
            optimizer=optimizer,
            shape=shape,
            remat=remat,
            mfu=mfu,
            grad_accum=grad_accum,
            reshard_after_forward=reshard_after_forward,
            trainable=trainable,
        )
        for st in STAGES
    )
    recommendation = _recommend(rows, params, hardware, precision, optimizer, seq_len, trainable)
    return Plan(
        params,
        devices,
        hardware,
        precision,
        optimizer,
        seq_len,
        micro_batch,
        mfu,
        shape,
        rows,
        recommendation,
        grad_accum,
        reshard_after_forward,
        trainable,
    )


def _recommend(
    rows: tuple[StagePlan, ...],
    params: float,
    hardware: Hardware,
    precision: Precision,
    optimizer: Optimizer,
    seq_len: int,
    trainable: float | None = None,
) -> Recommendation:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        # Stage 3 shards everything, so its state shrinks as 1/p: that many devices would hold it.
        full = model_state_bytes(params, 1, 0, precision, optimizer, trainable=trainable)["total"]
        need = math.ceil(full / hardware.hbm_bytes)
        return Recommendation(
            None,
            f"no stage fits in {hardware.hbm_bytes / 1e9:.1f} GB per device; stage 3 needs at "
            f"least {need} devices for its model state alone",
            None,
            None,
        )
    # Lowest traffic first; among equal traffic the lower stage (less sharding, simpler program).
    best = min(fitting, key=lambda r: (r.traffic["total"], r.stage))
    t_star = best.comm_bound_below_tokens
    return Recommendation(
        best.stage,
        f"stage {best.stage} is the lowest-traffic stage that fits in {hardware.hbm_bytes / 1e9:.1f} GB per device",
        t_star,
        max(1, math.ceil(t_star / seq_len)),
    )


def plan_dict(p: Plan) -> dict:
    """The plan as plain JSON-ready values (what `zerojax plan --json` prints)."""
    hw = p.hardware
    group = group_links(hw, p.devices)
    return {
        "params": p.params,
        "trainable_params": trained(p.params, p.trainable),
        "devices": p.devices,
        "hardware": {
            "name": hw.name,
            "peak_flops": hw.peak_flops,
            "hbm_bytes": hw.hbm_bytes,
            "link_bytes_per_s": hw.link_bytes_per_s,
            "interconnect": hw.interconnect,
            # the links the state's group runs its collectives over (between nodes once it spans them)
            "collective_link_bytes_per_s": group.link_bytes_per_s,
            "collective_interconnect": group.interconnect,
        },
        "precision": p.precision.name,
        "optimizer": p.optimizer.name,
        "seq_len": p.seq_len,
        "micro_batch": p.micro_batch,
        "grad_accum": p.grad_accum,
        "reshard_after_forward": p.reshard_after_forward,
        "mfu": p.mfu,
        "stages": [
            {
                "stage": r.stage,
                "persistent_bytes_per_device": r.memory["total"],  # textbook model state, grads included
                "kept_bytes_per_device": kept_state_bytes(
                    p.params, p.devices, r.stage, p.precision, p.optimizer, trainable=p.trainable
                )["total"],  # what zerojax keeps
                "persistent_bytes_by_group": {g: r.memory[g] for g in GROUPS},
                "activation_bytes_per_device": r.activation_bytes,
                "param_allgather_bytes_per_device_per_step": r.traffic["param_allgather"],
                "grad_reduce_bytes_per_device_per_step": r.traffic["grad_reduce"],
                "traffic_bytes_per_device_per_step": r.traffic["total"],
                "compute_time_s": r.time.compute_s,
                "comm_time_s": r.time.comm_s,
                "bound": r.time.bound,
                "comm_bound_below_tokens_per_device": r.comm_bound_below_tokens,
                "fits": r.fits,
            }
            for r in p.stages
        ],
        # the lowest-traffic stage whose state alone fits; `zerojax plan`'s one recommendation is the
        # best combination with activations (its JSON "recommendation")
        "state_alone": {
            "stage": p.recommendation.stage,
            "reason": p.recommendation.reason,
            "comm_bound_below_tokens_per_device": p.recommendation.comm_bound_below_tokens,
            "min_micro_batch": p.recommendation.min_micro_batch,
        },
    }
