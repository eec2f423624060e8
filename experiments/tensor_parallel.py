"""FSDP x tensor parallelism on the tiny GPT: per-device state and traffic by mesh axis.

Stage 3, fp32, Adam, 8 simulated CPU devices, the tiny GPT (2 layers, d_model 64) with a batch of 8
sequences of 64 tokens: for each mesh (fsdp=8, fsdp=4 x tensor=2, data=2 x fsdp=2 x tensor=2),
engine and sequence parallelism on/off, one compile whose partitioned HLO is counted (bytes each
device sends, by collective kind and by the mesh axes its groups span), the state's bytes on one
device, the compiled temporaries, and 5 steps' losses against stage 0 on fsdp=8. Writes
experiments/results/tensor_parallel.{json,md}.

    python -m experiments.tensor_parallel        # 10 runs, ~3 min here
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile

from experiments.common import RESULTS, cpu_devices

cpu_devices(8)

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = {"fsdp=8": {"fsdp": 8}, "fsdp=4 x tensor=2": {"fsdp": 4, "tensor": 2}}
MESHES["data=2 x fsdp=2 x tensor=2"] = {"data": 2, "fsdp": 2, "tensor": 2}
STEPS = 5


def _runs():
    for mesh in MESHES:
        for engine in ("gspmd", "shard_map"):
            yield mesh, engine, False
            if "tensor" in MESHES[mesh] and engine == "gspmd":
                yield mesh, engine, True


def measure(mesh_name: str, engine: str, sequence_parallel: bool, stage: int = 3) -> dict:
    import jax
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.accounting import hlo, partitioned
    from zerojax.accounting.params import tensor_local_params
    from zerojax.core.offload import split_bytes
    from zerojax.models.gpt import GPT, gpt_config

    cfg = gpt_config("tiny")
    tokens = np.random.default_rng(0).integers(0, 256, (8, cfg.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    rules = {**zj.DEFAULT_AXIS_RULES, **(zj.SEQUENCE_PARALLEL_RULES if sequence_parallel else {})}
    mesh = zj.make_mesh(**MESHES[mesh_name])
    trainer = zj.Trainer(
        functools.partial(GPT, cfg), optax.adamw(1e-2), mesh=mesh, stage=stage, engine=engine, axis_rules=rules
    )
    state = trainer.init(jax.random.key(0), batch)
    with tempfile.TemporaryDirectory() as tmp:
        compiled, text = partitioned.compile_partitioned(trainer.lower(state, batch), tmp)
    counted = hlo.collective_bytes(text, mesh=mesh, allow_unknown_trips=True)
    kept = split_bytes((state.params, state.opt_state), jax.devices()[0])["device"]
    losses = []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return {
        "mesh": mesh_name,
        "engine": engine,
        "sequence_parallel": sequence_parallel,
        "stage": stage,
        "slice_params": tensor_local_params(trainer.layout.leaves),
        "state_bytes_per_device": kept,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "bytes_by_kind_axis": counted["by_kind_axis"],
        "unknown_trip_counts": counted["unknown_trip_counts"],
        "losses": losses,
    }


def _axis_bytes(by: dict, name: str) -> float:
    return sum(v for k in by for a, v in by[k].items() if a == name)


def table(rows: list[dict], reference: list[float]) -> str:
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    lines = [
        "| mesh | engine | seq. parallel | state / device | temp | fsdp bytes | tensor bytes | tensor by kind "
        "| loss vs stage 0 (max rel.) |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        by = r["bytes_by_kind_axis"]
        tensor_kinds = ", ".join(f"{k} {by[k]['tensor']:,.0f}" for k in kinds if by.get(k, {}).get("tensor"))
        rel = max(abs(a / b - 1) for a, b in zip(r["losses"], reference))
        lower = " (lower bound)" if r["unknown_trip_counts"] else ""
        lines.append(
            f"| {r['mesh']} | {r['engine']} | {'yes' if r['sequence_parallel'] else 'no'} "
            f"| {r['state_bytes_per_device']:,} | {r['temp_bytes']:,} | {_axis_bytes(by, 'fsdp'):,.0f}{lower} "
            f"| {_axis_bytes(by, 'tensor'):,.0f}{lower} | {tensor_kinds or '-'} | {rel:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    import jax

    reference = measure("fsdp=8", "gspmd", False, stage=0)["losses"]
    rows = [measure(*run) for run in _runs()]
    os.makedirs(RESULTS, exist_ok=True)
    stamp = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "backend": jax.default_backend()}
    with open(os.path.join(RESULTS, "tensor_parallel.json"), "w") as f:
        json.dump({**stamp, "reference_losses": reference, "rows": rows}, f, indent=1)
    text = f"# FSDP x tensor parallelism, tiny GPT, stage 3 fp32 ({stamp['date']}, jax {stamp['jax']}, CPU)\n\n"
    text += "Bytes are what one device sends per step, counted on the partitioned HLO by the mesh axes\n"
    text += "each collective's groups span; state is the params and Adam moments one device keeps.\n\n"
    with open(os.path.join(RESULTS, "tensor_parallel.md"), "w") as f:
        f.write(text + table(rows, reference) + "\n")
    print(table(rows, reference))


if __name__ == "__main__":
    main()
