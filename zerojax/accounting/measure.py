"""Measure a built `Trainer` beside the analytic model, per device:

persistent bytes   the live state's shards on one device, against `kept_state_bytes` (what zerojax
                   keeps: no gradients, no stage-3 compute copy), not the textbook 16-byte figure;
                   device space and host space (`zero.offload`) apart, the ideal being the sum;
peak / temp bytes  `memory_analysis()` of the compiled step (peak = arguments + outputs - aliased
                   + temporaries), against the kept state plus `step_temp_bytes`;
collective bytes   per step, counted on the HLO right after SPMD partitioning, against
                   `traffic_bytes`; a collective inside a conditional (a pipeline's sends) as often
                   as a profile of one step shows it ran. The CPU's final HLO is also counted
                   (`final_hlo_collective_bytes`):
                   XLA:CPU's float-normalization pass upcasts bf16 collectives to f32 after
                   partitioning, so there bf16 traffic shows twice the bytes a GPU or TPU moves.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import jax

from zerojax.accounting import analytic, zeropp
from zerojax.accounting.activations import GPTShape, gathered_weights_kept, gpt_activation_bytes
from zerojax.accounting.executed import instruction_runs
from zerojax.accounting.hlo import collective_bytes, collectives
from zerojax.accounting.params import tensor_local_params
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.accounting.placed_bytes import compiled_argument_bytes
from zerojax.core.leaf_rule import LeafLayout
from zerojax.core.loss import global_loss
from zerojax.core.mesh import data_parallel_size
from zerojax.core.offload import split_bytes
from zerojax.core.optim import get_optimizer
from zerojax.core.trees import count_params


@dataclass(frozen=True)
class Ideal:
    """The analytic figures for one trainer (bytes per device; traffic per step)."""

    params: int
    devices: int
    persistent_bytes: float  # kept_state_bytes total
    persistent_by_group: dict
    param_allgather_bytes: float
    grad_reduce_bytes: float
    temp_bytes: float | None  # step_temp_bytes; None without a model shape for activations
    activation_bytes: float | None
    by_kind_axis: dict | None = None  # ZeRO++ runs: {kind: {axis: bytes}} (`accounting.zeropp`)

    @property
    def collective_bytes(self) -> float:
        return self.param_allgather_bytes + self.grad_reduce_bytes


@dataclass(frozen=True)
class Measurement:
    stage: int
    engine: str
    precision: str
    ideal: Ideal
    persistent_bytes: int  # the live arrays' shards (or, for an abstract state, their shardings')
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    collective_bytes: float  # post-partitioning HLO, per device per step
    collective_by_kind: dict = field(default_factory=dict)
    collective_by_axis: dict = field(default_factory=dict)  # the mesh axes the groups span -> bytes
    collective_by_kind_axis: dict = field(default_factory=dict)  # kind -> {axes: bytes}
    collective_counts: dict = field(default_factory=dict)
    final_hlo_collective_bytes: float = 0.0  # the CPU's final HLO (bf16 collectives upcast to f32)
    unknown_trip_counts: int = 0
    stage_boundary_bytes: float = 0.0  # collective-permutes between the pair of devices that exchange most
    host_persistent_bytes: int = 0  # the state's shards on that device kept in host memory (offload)
    host_argument_bytes: int = 0  # the compiled step's arguments in host memory space (S(5))

    @property
    def peak_bytes(self) -> int:
        """Everything live at once in the worst case: XLA's own `peak_memory_in_bytes` is not
        reported consistently on CPU, so the usual upper bound is used."""
        return int(analytic.peak_bytes(self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes))

    @property
    def ideal_peak_bytes(self) -> float | None:
        if self.ideal.temp_bytes is None:
            return None
        return self.ideal.persistent_bytes + self.ideal.temp_bytes

    @property
    def persistent_ratio(self) -> float:
        """Device and host space together against the ideal (which does not say where state lives)."""
        return (self.persistent_bytes + self.host_persistent_bytes) / self.ideal.persistent_bytes

    @property
    def collective_ratio(self) -> float | None:
        return _ratio(self.collective_bytes, self.ideal.collective_bytes)

    @property
    def temp_ratio(self) -> float | None:
        return None if self.ideal.temp_bytes is None else _ratio(self.temp_bytes, self.ideal.temp_bytes)

    @property
    def peak_ratio(self) -> float | None:
        ideal = self.ideal_peak_bytes
        return None if ideal is None else _ratio(self.peak_bytes, ideal)

    def row(self) -> dict:
        """Plain JSON-ready values (the `compare --json` row fields, and more)."""
        return {
            "stage": self.stage,
            "engine": self.engine,
            "precision": self.precision,
            "persistent_bytes_per_device": self.persistent_bytes,
            "host_persistent_bytes_per_device": self.host_persistent_bytes,
            "host_argument_bytes_per_device": self.host_argument_bytes,
            "ideal_persistent_bytes_per_device": self.ideal.persistent_bytes,
            "persistent_ratio": self.persistent_ratio,
            "peak_bytes_per_device": self.peak_bytes,
            "ideal_peak_bytes_per_device": self.ideal_peak_bytes,
            "peak_ratio": self.peak_ratio,
            "temp_bytes_per_device": self.temp_bytes,
            "ideal_temp_bytes_per_device": self.ideal.temp_bytes,
            "activation_bytes_per_device": self.ideal.activation_bytes,
            "collective_bytes_per_device_per_step": self.collective_bytes,
            "ideal_collective_bytes_per_device_per_step": self.ideal.collective_bytes,
            "collective_ratio": self.collective_ratio,
            "collective_bytes_by_kind": dict(self.collective_by_kind),
            "collective_bytes_by_axis": dict(self.collective_by_axis),
            "collective_bytes_by_kind_axis": {k: dict(v) for k, v in self.collective_by_kind_axis.items()},
            "ideal_collective_bytes_by_kind_axis": self.ideal.by_kind_axis,
            "final_hlo_collective_bytes_per_device_per_step": self.final_hlo_collective_bytes,
            "unknown_trip_counts": self.unknown_trip_counts,
            "stage_boundary_bytes_per_step": self.stage_boundary_bytes,
        }


def _ratio(measured: float, ideal: float) -> float | None:
    if ideal == 0:
        return 1.0 if measured == 0 else None  # p = 1: nothing should move
    return measured / ideal


_is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731


def param_count(trainer) -> int:
    """Logical (unpadded) parameters of the trainer's model, from its layout."""
    return count_params(trainer.layout.leaves)


def ideal(
    trainer,
    optimizer: str = "adamw",
    shape: GPTShape | None = None,
    seq_len: int = 0,
    micro_batch: int = 0,
    remat: str = "full",
    layout=None,
) -> Ideal:
    """The analytic figures for what `trainer` keeps and moves (over its fsdp axis; replicas on `data`
    are not modelled, except with ZeRO++'s options, `accounting.zeropp`, where every axis is);
    activations need the model's shape. `layout`: the `StateLayout` counted (default: the trainer's
    current one; a compile-only analysis passes `trainer.prepare(...).layout`, nothing initialised)."""
    layout = trainer.layout if layout is None else layout
    # a tensor axis: each device holds, and FSDP moves, one tensor-parallel slice of the model
    psi, p, stage, prec = (tensor_local_params(layout.leaves), layout.fsdp_size, trainer.stage.index, trainer.precision)
    # frozen leaves (`trainable=`): kept as compute params only, never reduced
    trains = tensor_local_params(layout.trained_leaves()) if layout.frozen_leaves() else None
    k, reshard = trainer.grad_accum, trainer.options.reshard_after_forward
    # gspmd reduces each whole micro-batch's gradient (stage 3's are counted per micro-batch anyway)
    each = trainer.engine == "gspmd" and trainer.setup.whole_micro_batches
    kept = _summed(
        layout, lambda n, d, t: analytic.kept_state_bytes(n, d, stage, prec, get_optimizer(optimizer), trainable=t)
    )
    traffic = _summed(
        layout,
        lambda n, d, t: analytic.traffic_bytes(
            n, d, stage, prec.param_bytes, prec.reduce_bytes, k, reshard, t, reduce_each_micro_batch=each
        ),
    )
    by_kind_axis = _zeropp_traffic(trainer, psi, shape, k, trains)
    if by_kind_axis is not None:
        traffic = zeropp.totals(by_kind_axis)
    act = temp = None
    if shape is not None and seq_len and micro_batch:
        act = gpt_activation_bytes(shape, seq_len, micro_batch, prec.param_bytes, remat)
        held = gathered_weights_kept(psi, stage, remat, prec.param_bytes, reshard)
        temp = analytic.step_temp_bytes(
            psi,
            p,
            stage,
            prec,
            act + held,
            grad_accum=k,
            reshard_after_forward=reshard,
            trainable=trains,
            reduce_each_micro_batch=each,
        )
    return Ideal(
        psi, p, kept["total"], kept, traffic["param_allgather"], traffic["grad_reduce"], temp, act, by_kind_axis
    )


def _summed(layout, figures) -> dict[str, float]:
    """`figures(params, devices, trainable params or None)` summed over the leaves grouped by the
    devices a sharded group splits them over: fsdp, and on a pipeline fsdp x pipeline for the
    leaves outside the stack (`zerojax.core.layout.make_layout`)."""
    leaves = jax.tree.leaves(layout.leaves, is_leaf=_is_layout)
    stages = dict(layout.mesh.shape).get("pipeline", 1)
    out: dict[str, float] = {}
    for beside in (False, True):
        group = [l for l in leaves if l.beside_pipeline == beside]
        if not group:
            continue
        trains = tensor_local_params([l for l in group if l.trainable]) if any(not l.trainable for l in group) else None
        part = figures(tensor_local_params(group), layout.fsdp_size * (stages if beside else 1), trains)
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _zeropp_traffic(trainer, psi: int, shape: GPTShape | None, grad_accum: int, trains=None) -> dict | None:
    """ZeRO++'s model of the step's traffic by kind and axis, for a trainer using any of its options
    (stage 3, `shard_map`); None otherwise, and on a pipeline, which it does not model. The GPT's
    embedding and head are gathered once."""
    o = trainer.options
    options = zeropp.ZeroPP(o.quantize_weights, o.quantize_grads, o.quantize_block, o.hierarchical)
    if not options.active or trainer.stage.index != 3 or dict(trainer.mesh.shape).get("pipeline", 1) > 1:
        return None
    axes = dict(trainer.mesh.shape)
    return zeropp.stage_3_traffic_by_axis(
        psi,
        axes.get("data", 1),
        axes.get("fsdp", 1),
        trainer.precision.param_bytes,
        trainer.precision.reduce_bytes,
        options,
        grad_accum,
        zeropp.gathered_once(shape),
        o.reshard_after_forward,
        trains,
    )


def lower_step(trainer, state, batch):
    """The trainer's jitted step lowered for `state` (arrays, or ShapeDtypeStructs with shardings)."""
    # Trainer.compile lowers the same function; the Lowered object is needed here for the dump.
    return trainer.lower(state, batch)


def persistent_bytes(trainer, state, space: str = "device") -> int:
    """Bytes of the state's shards of the first device in its device (or "host") memory: from the
    live arrays or, for an abstract state, from each leaf's sharding (what `init` would place there)."""
    return split_bytes(state, trainer.mesh.devices.flat[0])[space]


def measure_step(
    trainer,
    state,
    batch,
    *,
    optimizer: str = "adamw",
    shape: GPTShape | None = None,
    seq_len: int = 0,
    remat: str = "full",
    dump_dir: str | None = None,
):
    """(Measurement, the compiled step). The compiled step runs as `compiled(state, sharded_batch)`:
    one compile serves the memory analysis, the collective count and training."""
    lowered = lower_step(trainer, state, batch)
    if trainer.mesh.devices.size == 1:  # XLA skips SPMD partitioning: there is nothing to dump or move
        compiled = lowered.compile()
        text = compiled.as_text()
    else:
        with tempfile.TemporaryDirectory(prefix="zerojax-hlo-") as tmp:
            compiled, text = compile_partitioned(lowered, dump_dir or tmp)
    runs = _branch_runs(trainer, compiled, text, state, batch)
    counted = collective_bytes(text, mesh=trainer.mesh, runs=runs)
    final = collective_bytes(compiled.as_text(), runs=runs)
    ma = compiled.memory_analysis()
    first = jax.tree.leaves(batch["inputs"])[0]  # an array, or a pytree's first leaf
    rows = first.shape[0]
    micro = rows // data_parallel_size(trainer.mesh) // trainer.grad_accum  # activations are one micro-batch's
    m = Measurement(
        stage=trainer.stage.index,
        engine=trainer.engine,
        precision=trainer.precision.name,
        ideal=ideal(trainer, optimizer, shape, seq_len or first.shape[-1], micro, remat),
        persistent_bytes=persistent_bytes(trainer, state),
        host_persistent_bytes=persistent_bytes(trainer, state, "host"),
        host_argument_bytes=compiled_argument_bytes(compiled)["host"],
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes),
        temp_bytes=int(ma.temp_size_in_bytes),
        collective_bytes=float(counted["total"]),
        collective_by_kind={k: v for k, v in counted["bytes"].items() if v},
        collective_by_axis={k: v for k, v in counted["by_axis"].items() if v},
        collective_by_kind_axis=counted["by_kind_axis"],
        collective_counts={k: v for k, v in counted["counts"].items() if v},
        final_hlo_collective_bytes=float(final["total"]),
        unknown_trip_counts=int(counted["unknown_trip_counts"]),
        stage_boundary_bytes=float(counted["busiest_link"]),
    )
    return m, compiled


def _branch_runs(trainer, compiled, text: str, state, batch) -> dict[str, int] | None:
    """How often the collectives inside the step's conditionals ran (a pipeline's stage-to-stage
    sends), from a profile of one step on a copy of `state` (the step donates what it is given);
    None when there are none."""
    pending = {c.name for c in collectives(text) if not c.known}
    if not pending:
        return None
    copied = jax.tree.map(lambda a: a.copy(), state)
    sharded = trainer.shard_batch(batch)
    local = sum(d.process_index == jax.process_index() for d in trainer.mesh.devices.flat)
    return instruction_runs(lambda: jax.block_until_ready(compiled(copied, sharded)), pending, local)


def activation_temp_bytes(trainer, batch, key=None) -> int:
    """Temporaries of the forward + backward alone at stage 0 (replicated compute params): its
    gradients are outputs, not temporaries, so this is the activation memory the planner models,
    free of the optimizer update's parameter-sized buffers. `batch` may be abstract; `key` (default
    0) only picks the preparation: activation memory does not depend on the values."""
    prepared = trainer.prepare(jax.random.key(0) if key is None else key, batch)
    layout, static = prepared.layout, prepared.static
    shapes = layout.compute_shapes(layout.replicated)
    batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding), batch)

    def loss(params, model_state, batch):
        out, _ = trainer.model.apply(params, model_state, static, batch["inputs"])
        return global_loss(trainer.loss_fn(out, batch))

    model_state = prepared.abstract.model_state or {}
    compiled = jax.jit(jax.value_and_grad(loss)).lower(shapes, model_state, batch).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)  # type: ignore[union-attr]


def human_bytes(n: float | None) -> str:
    """'1.32 MiB'; '-' for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: the last unit always returns")
