"""ZeRO++'s traffic per device per step, by collective kind and mesh axis (docs/zeropp.md).

Stage 3 in the `shard_map` engine on a `data` x `fsdp` mesh; `params` are the parameters of the
sharded leaves (a model's few replicated leaves, norms and biases of odd sizes, are all-reduced over
every device and not counted here). Ring collectives: an all-gather or reduce-scatter over g devices
moves (g - 1) / g of the whole, an all-to-all the same, an all-reduce twice that.

- plain stage 3: each layer's weights are gathered over `fsdp` twice (forward, backward), the `once`
  parameters outside every layer stack or unit (embeddings, head) once and kept for the backward;
  every gradient is reduce-scattered over `fsdp`; with `data` > 1 the gradient shards of the replicas are all-reduced
  over `data`.
- qwZ (`quantize_weights`): the gathers move int8 / fp8 codes plus one fp32 scale per `block`.
- qgZ (`quantize_grads`): the `fsdp` reduce-scatter becomes an all-to-all of int8 codes plus scales
  (the sum over `data` stays in the reduce dtype).
- hpZ (`hierarchical`): the fp32 state is sharded over `data` x `fsdp`; once per step the compute-dtype
  secondary copy is gathered over `data` (not quantized), and the gradient reduce-scattered back over
  `data` in the reduce dtype: no all-reduce over `data`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zerojax.accounting.analytic import kept_state_bytes, trained

CODE_BYTES = {"int8": 1, "fp8": 1}


@dataclass(frozen=True)
class ZeroPP:
    quantize_weights: str | None = None  # "int8", "fp8" or None
    quantize_grads: str | None = None  # "int8" or None
    block: int = 256  # values per fp32 scale
    hierarchical: bool = False

    @property
    def active(self) -> bool:
        return bool(self.quantize_weights or self.quantize_grads or self.hierarchical)


def quantized_bytes(kind: str, block: int) -> float:
    """Bytes per value of a block-quantized array: its code plus its share of the block's fp32 scale."""
    return CODE_BYTES[kind] + 4 / block


def stage_3_traffic_by_axis(
    params: float,
    data: int,
    fsdp: int,
    compute_bytes: float,
    reduce_bytes: float,
    options: ZeroPP = ZeroPP(),
    grad_accum: int = 1,
    once: float = 0.0,
    reshard_after_forward: bool = True,
    trainable: float | None = None,
) -> dict[str, dict[str, float]]:
    """{collective kind: {mesh axis: bytes one device sends per step}}; `once` of the `params` are
    gathered once per micro-batch, the rest twice. Each of `grad_accum` micro-batches gathers and
    reduces (over `fsdp`, and over `data` too; hpZ, which takes one micro-batch, gathers its
    secondary copy over `data` once per step and reduce-scatters each layer's gradient over it);
    `reshard_after_forward=False` gathers and reduces once per step. Of `trainable` parameters only
    (None: all) are gradients reduced; the frozen rest is gathered as any weight."""
    ring_f, ring_d = (fsdp - 1) / fsdp, (data - 1) / data
    trains = trained(params, trainable)
    weights = quantized_bytes(options.quantize_weights, options.block) if options.quantize_weights else compute_bytes
    gathered, k = 2 * params - once, grad_accum
    if not reshard_after_forward:
        gathered, k = params, 1
    out: dict[str, dict[str, float]] = {"all-gather": {"fsdp": k * gathered * weights * ring_f}}
    if options.quantize_grads:
        out["all-to-all"] = {"fsdp": k * trains * quantized_bytes(options.quantize_grads, options.block) * ring_f}
    else:
        out["reduce-scatter"] = {"fsdp": k * trains * reduce_bytes * ring_f}
    if data > 1:
        if options.hierarchical:
            out["all-gather"]["data"] = params / fsdp * compute_bytes * ring_d
            out.setdefault("reduce-scatter", {})["data"] = trains / fsdp * reduce_bytes * ring_d
        else:
            out["all-reduce"] = {"data": k * 2 * trains / fsdp * reduce_bytes * ring_d}
    return out


def totals(by_axis: dict[str, dict[str, float]]) -> dict[str, float]:
    """(parameter gathers, gradient reductions, total) from `stage_3_traffic_by_axis`."""
    gathers = sum(by_axis.get("all-gather", {}).values())
    everything = sum(sum(axes.values()) for axes in by_axis.values())
    return {"param_allgather": gathers, "grad_reduce": everything - gathers, "total": everything}


def gathered_once(shape) -> int:
    """Parameters of the shipped GPT outside its layer stack (embedding, final norm, head): gathered
    once per micro-batch and kept for the backward (0 without a shape)."""
    return 0 if shape is None else 2 * shape.vocab_size * shape.d_model + shape.d_model


def stage_3_memory(
    params: float, data: int, fsdp: int, precision, optimizer, hierarchical: bool, trainable: float | None = None
) -> dict:
    """Stage 3's bytes per device on a `data` x `fsdp` mesh: the state kept between steps (over `fsdp`
    alone, replicated over `data`; hpZ: over both) and hpZ's secondary copy (compute dtype, over
    `fsdp`), which lives inside the step, from its start to the last layer's backward."""
    over = data * fsdp if hierarchical else fsdp
    return {
        "kept": kept_state_bytes(params, over, 3, precision, optimizer, trainable=trainable)["total"],
        "secondary_copy": params / fsdp * precision.param_bytes if hierarchical else 0.0,
    }


def plan_section(
    params: float,
    data: int,
    fsdp: int,
    precision,
    options: ZeroPP,
    grad_accum: int = 1,
    shape=None,
    reshard_after_forward: bool = True,
    optimizer=None,
    trainable: float | None = None,
) -> dict:
    """What `zerojax plan` reports for stage 3 on a `data` x `fsdp` mesh: bytes per device per step by
    kind and axis, plain and with the config's ZeRO++ options (None when it sets none), and with an
    optimizer, the memory each keeps (`stage_3_memory`)."""

    def by_axis(o: ZeroPP):
        return stage_3_traffic_by_axis(
            params,
            data,
            fsdp,
            precision.param_bytes,
            precision.reduce_bytes,
            o,
            grad_accum,
            gathered_once(shape),
            reshard_after_forward,
            trainable,
        )

    plain = by_axis(ZeroPP())
    chosen = by_axis(options) if options.active else None
    out = {
        "data": data,
        "fsdp": fsdp,
        "options": vars(options) if options.active else None,
        "plain": plain,
        "plain_total": totals(plain)["total"],
        "with_options": chosen,
        "with_options_total": None if chosen is None else totals(chosen)["total"],
    }
    if optimizer is not None:
        memory = functools.partial(stage_3_memory, params, data, fsdp, precision, optimizer, trainable=trainable)
        out["plain_memory"] = memory(False)
        out["with_options_memory"] = None if chosen is None else memory(options.hierarchical)
    return out
