"""Planner picks: every combination of ZeRO stage x gradient accumulation x host offload x remat
policy, its predicted per-device memory (device and host separately) and step time, ranked.

Pure arithmetic on the formulas of `analytic` (kept state, temporaries, traffic, FLOPs) and
`activations` (saved activations per remat policy); nothing here restates them. What this adds:

  offload   `zero.offload` moves kept groups to host memory (`host_groups`: those the trainer
            places there, `zerojax.core.offload`): "optimizer" the fp32 master and the optimizer
            state (the 12 bytes per parameter of Adam's master + moments: 12 psi / p from stage 1,
            12 psi at stage 0; with fp32 the params are the master, so they move too),
            "optimizer+params" also the bf16 compute copy stages 0-2 keep. Each step brings them in
            and writes them back: their bytes cross the host link once each way per step, and they
            are on the device during the update (after the backward has freed the activations; see
            `analytic.step_temp_bytes`).
  remat     the activation model's device bytes per policy; `offload` also keeps `dots`' residuals
            in host memory, which cross the host link once each way per micro-batch. Recomputation
            costs FLOPs (`recompute_flops`): `full` re-runs each layer's forward, `dots` and
            `offload` its attention (the score and value matmuls carry a batch dimension, so they are
            not saved), `none` nothing.
  time      roofline: max(compute, collectives, host link), each fully overlapped with the others:
            a lower bound, as in `analytic.step_time_estimate`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from zerojax.accounting import analytic
from zerojax.accounting.activations import (
    ACTIVATION_MODEL,
    GPTShape,
    gathered_weights_kept,
    gpt_activation_bytes,
    gpt_host_activation_bytes,
)
from zerojax.accounting.hardware import Hardware
from zerojax.core.offload import MODES, groups
from zerojax.core.optim import Optimizer
from zerojax.core.precision import Precision
from zerojax.core.remat import REMAT_POLICIES, check
from zerojax.core.stages import GROUP_OF_FIELD, STAGES, Stage
from zerojax.errors import UserError


def device_saved_terms(remat: str) -> tuple[float, float, float]:
    """What a layer saves on the device under `remat` (`ACTIVATION_MODEL.saved`), to compare policies."""
    terms = ACTIVATION_MODEL.saved[remat]
    return terms.d, terms.f, terms.score_bytes


# The order `rank` tries the remat policies in: from the one that saves the most on the device (and
# recomputes the least) to the one that saves the least, so that equal picks list the former first.
REMAT_ORDER = tuple(sorted(REMAT_POLICIES, key=device_saved_terms, reverse=True))


def host_groups(offload: str, precision: Precision) -> tuple[str, ...]:
    """The `analytic.kept_state_bytes` groups that `zero.offload` keeps in host memory. With fp32 the
    params are the master, which `kept_state_bytes` counts under `compute_params`: they move too."""
    moved = tuple(GROUP_OF_FIELD[g] for g in groups(offload, keeps_compute_copy=precision.separate_compute_copy))
    params_are_master = not precision.separate_compute_copy
    return moved + ("compute_params",) if moved and params_are_master else moved


def placed_state_bytes(
    params: float,
    devices: int,
    stage: int,
    precision: Precision,
    optimizer: Optimizer,
    offload: str = "none",
    trainable: float | None = None,
) -> dict[str, float]:
    """Kept bytes per device in device memory (`device`) and host memory (`host`), and of them the
    compute copy on the host (`host_compute`: the forward needs it back on the device)."""
    kept = analytic.kept_state_bytes(params, devices, stage, precision, optimizer, trainable=trainable)
    moved = host_groups(offload, precision)
    host = sum(kept[g] for g in moved)
    compute_on_host = kept["compute_params"] if "compute_params" in moved and precision.master_bytes else 0.0
    return {"device": kept["total"] - host, "host": host, "host_compute": compute_on_host}


def recompute_flops(params: float, tokens: float, remat: str, shape: GPTShape | None = None, seq_len: int = 0) -> float:
    """FLOPs the backward spends recomputing the forward, per step (`tokens` per device). The
    layers' parameters are the model's less the untied embedding and head (2 * vocab * d_model)."""
    check(remat, key="remat")
    attention = 4.0 * shape.n_layers * shape.d_model * seq_len * tokens if shape else 0.0  # QK^T and PV
    layers = params - 2.0 * shape.vocab_size * shape.d_model if shape else params
    return {"none": 0.0, "dots": attention, "offload": attention, "full": 2.0 * layers * tokens + attention}[remat]


@dataclass(frozen=True)
class Pick:
    stage: int
    grad_accum: int  # micro-batches per step
    micro_batch: int  # sequences per device per micro-batch
    offload: str
    remat: str
    device_state_bytes: float  # kept in device memory between steps
    host_state_bytes: float  # kept in host memory between steps
    activation_bytes: float  # device, one micro-batch (0 without a model shape)
    host_activation_bytes: float  # host, one micro-batch (remat=offload)
    device_peak_bytes: float  # kept device state + the step's temporaries
    collective_bytes: float  # sent per device per step
    host_link_bytes: float  # per direction per device per step
    compute_s: float
    comm_s: float
    host_s: float
    memory_bytes: float  # the device budget it is checked against
    host_memory_bytes: float = math.inf  # the host budget per device

    @property
    def host_bytes(self) -> float:
        return self.host_state_bytes + self.host_activation_bytes

    @property
    def fits(self) -> bool:
        return self.device_peak_bytes <= self.memory_bytes and self.host_bytes <= self.host_memory_bytes

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s, self.host_s)

    @property
    def bound(self) -> str:
        return max((self.compute_s, "compute"), (self.comm_s, "collectives"), (self.host_s, "host link"))[1]

    def overrides(self) -> list[str]:
        """The `--set` strings that select this combination (zero.offload only when it is on)."""
        out = [f"zero.stage={self.stage}", f"train.grad_accum={self.grad_accum}", f"model.remat={self.remat}"]
        return out + ([f"zero.offload={self.offload}"] if self.offload != "none" else [])

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "host_bytes": self.host_bytes,
            "fits": self.fits,
            "step_s": self.step_s,
            "bound": self.bound,
            "overrides": self.overrides(),
        }


def micro_batch_activations(
    shape: GPTShape | None, seq_len: int, micro_batch: int, param_bytes: float, remat: str
) -> tuple[float, float]:
    """(device, host) activation bytes of one micro-batch; none counted without a model shape."""
    if shape is None:
        return 0.0, 0.0
    return (
        gpt_activation_bytes(shape, seq_len, micro_batch, param_bytes, remat),
        gpt_host_activation_bytes(shape, seq_len, micro_batch, param_bytes, remat),
    )


def evaluate(
    params: float,
    devices: int,
    hardware: Hardware,
    *,
    stage: int,
    grad_accum: int,
    micro_batch: int,
    offload: str,
    remat: str,
    seq_len: int,
    precision: Precision,
    optimizer: Optimizer,
    shape: GPTShape | None = None,
    mfu: float = 1.0,
    reshard_after_forward: bool = True,
    memory: float | None = None,
    host_memory: float = math.inf,
    trainable: float | None = None,
) -> Pick:
    """One combination's memory and time per device (`memory`: the device budget, default the
    hardware's; `host_memory`: the host budget per device, default unbounded; `trainable`: the
    parameters that train, None: all)."""
    b, tokens = precision.param_bytes, grad_accum * micro_batch * seq_len
    act, host_act = micro_batch_activations(shape, seq_len, micro_batch, b, remat)
    placed = placed_state_bytes(params, devices, stage, precision, optimizer, offload, trainable)
    # A compute copy kept on the host is on the device again for the whole forward and backward.
    held = gathered_weights_kept(params, stage, remat, b, reshard_after_forward) if shape is not None else 0.0
    on_device = act + held + placed["host_compute"]
    temp = analytic.step_temp_bytes(
        params, devices, stage, precision, on_device, placed["host"], grad_accum, reshard_after_forward, trainable
    )
    base = analytic.step_time_estimate(
        params, devices, stage, hardware, tokens, b, shape, seq_len, mfu, grad_accum, reshard_after_forward, trainable
    )
    recompute_s = recompute_flops(params, tokens, remat, shape, seq_len) / (hardware.peak_flops * mfu)
    traffic = analytic.traffic_bytes(params, devices, stage, b, None, grad_accum, reshard_after_forward, trainable)
    host_link = placed["host"] + grad_accum * host_act  # each way: in and out
    return Pick(
        stage=stage,
        grad_accum=grad_accum,
        micro_batch=micro_batch,
        offload=offload,
        remat=remat,
        device_state_bytes=placed["device"],
        host_state_bytes=placed["host"],
        activation_bytes=act,
        host_activation_bytes=host_act,
        device_peak_bytes=placed["device"] + temp,
        collective_bytes=traffic["total"],
        host_link_bytes=host_link,
        compute_s=base.compute_s + recompute_s,
        comm_s=base.comm_s,
        host_s=host_link / hardware.host_bytes_per_s,
        memory_bytes=hardware.hbm_bytes if memory is None else memory,
        host_memory_bytes=host_memory,
    )


def accum_choices(rows_per_device: int) -> list[int]:
    """Micro-batch counts that split a device's rows evenly: the divisors of `rows_per_device`."""
    return [k for k in range(1, rows_per_device + 1) if rows_per_device % k == 0]


def offloads_tried(stage: Stage, offloads, precision: Precision) -> list[str]:
    """`offloads` less "optimizer+params" where it moves no more than "optimizer" (it moves more only
    with the bf16 compute copy of stages 0-2)."""
    copy_too = host_groups("optimizer+params", precision) != host_groups("optimizer", precision)
    return [o for o in offloads if o != "optimizer+params" or (copy_too and not stage.compute_params)]


def rank_key(pick: Pick) -> tuple:
    """Fitting first, fastest first; ties: least traffic, then fewest micro-batches (whose larger
    matmuls the roofline does not reward), then least device memory."""
    return (
        not pick.fits,
        pick.step_s,
        pick.collective_bytes + pick.host_link_bytes,
        pick.grad_accum,
        pick.device_peak_bytes,
    )


def rank(
    params: float,
    devices: int,
    hardware: Hardware,
    *,
    rows_per_device: int,
    seq_len: int,
    precision: Precision,
    optimizer: Optimizer,
    shape: GPTShape | None = None,
    mfu: float = 1.0,
    reshard_after_forward: bool = True,
    memory: float | None = None,
    host_memory: float = math.inf,
    remats=None,
    offloads=None,
    trainable: float | None = None,
) -> list[Pick]:
    """Every combination for a per-device batch of `rows_per_device` sequences per step, in
    `rank_key`'s order. Without a model shape the remat policy changes nothing the planner can
    count, so only `remats` (default `full`) is tried; `remats` and `offloads` narrow the choices
    (e.g. to what a CPU backend runs)."""
    if isinstance(rows_per_device, bool) or not isinstance(rows_per_device, int) or rows_per_device < 1:
        raise UserError(f"rows per device must be a positive integer, got {rows_per_device!r}.")
    remats = tuple(remats or (REMAT_ORDER if shape is not None else ("full",)))
    common: dict[str, Any] = dict(
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        shape=shape,
        mfu=mfu,
        reshard_after_forward=reshard_after_forward,
        memory=memory,
        host_memory=host_memory,
        trainable=trainable,
    )
    evaluated = [
        evaluate(
            params,
            devices,
            hardware,
            stage=st.index,
            grad_accum=k,
            micro_batch=rows_per_device // k,
            offload=offload,
            remat=remat,
            **common,
        )
        for st in STAGES
        for k in accum_choices(rows_per_device)
        for offload in offloads_tried(st, offloads or MODES, precision)
        for remat in remats
    ]
    return sorted(evaluated, key=rank_key)


def parse_bytes(text: str, flag: str = "--memory") -> float:
    """'80GB', '80e9', '24GiB', '512MiB', '1.5T' -> bytes (decimal units, binary with an 'i')."""
    import re

    units = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    value = float(m.group(1)) * units[m.group(2) or ""] if m else 0.0
    if not value > 0 or not math.isfinite(value):
        raise UserError(f"{flag} must be a positive size such as 80GB, 24GiB or 8e9, got {text!r}.")
    return value
