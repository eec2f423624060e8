"""Gathering a pipeline stage's weights once per step or each layer per microbatch: compiled peak and
the bytes moved over `fsdp`, per device per step.

    python -m experiments.pipeline_gather [--engine gspmd]

A 6.6M-parameter GPT (8 layers, width 256, sequence 128, batch 32), stage 3, bf16 with Adam, on
`pipeline=2 x fsdp=4` (8 simulated CPU devices); compiled only, nothing initialised. Collectives are
counted on the HLO right after SPMD partitioning, by the mesh axes their groups span: "fsdp" alone
(a pipeline stage's layers), and "pipeline+fsdp" (the embedding, head and final norm, sharded over
both). Writes experiments/results/pipeline_gather.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from experiments.common import RESULTS, cpu_devices

cpu_devices(8)

import jax
import numpy as np
import optax

import zerojax as zj
from zerojax.accounting.groups import axes_spanned
from zerojax.accounting.hlo import collectives
from zerojax.accounting.partitioned import compile_partitioned
from zerojax.models.gpt import GPT, gpt_config

CFG = gpt_config("tiny", d_model=256, n_heads=4, n_layers=8, d_ff=1024, seq_len=128, remat="full")
ROWS = 32
SCHEDULES = [("GPipe, m = 2", 2, 1), ("GPipe, m = 4", 4, 1), ("circular, m = 4, v = 2", 4, 2)]


def row(engine: str, name: str, microbatches: int, repeats: int, gather: str) -> str:
    trainer = zj.Trainer(
        lambda rngs: GPT(CFG, rngs),
        optax.adam(1e-3),
        mesh=zj.make_mesh(pipeline=2, fsdp=4),
        stage=3,
        engine=engine,
        precision="bf16",
        microbatches=microbatches,
        pipeline_repeats=repeats,
        engine_options={"pipeline_gather": gather},
    )
    tokens = np.zeros((ROWS, CFG.seq_len), np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    prepared = trainer.prepare(jax.random.key(0), batch)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    lowered = prepared.step_fn.lower(prepared.abstract, abstract)
    compiled, hlo = compile_partitioned(lowered, tempfile.mkdtemp(prefix="zerojax-hlo-"))
    memory = compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    peak += memory.temp_size_in_bytes
    moved: dict[tuple[str, str], float] = {}
    for c in collectives(hlo):
        key = (c.kind, axes_spanned(c.groups, dict(trainer.mesh.shape)))
        moved[key] = moved.get(key, 0.0) + c.sent * c.runs
    mb = lambda kind, axes: f"{moved.get((kind, axes), 0.0) / 1e6:.1f} MB"  # noqa: E731
    return (
        f"| {name} | {gather} | {peak / 1e6:.1f} MB | {mb('all-gather', 'fsdp')} | {mb('reduce-scatter', 'fsdp')} "
        f"| {mb('all-gather', 'pipeline+fsdp')} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="gspmd", choices=["gspmd", "shard_map"])
    args = ap.parse_args()
    rows = [
        row(args.engine, name, m, v, gather) for name, m, v in SCHEDULES for gather in ("per_step", "per_microbatch")
    ]
    lines = [
        f"Stage 3, bf16 Adam, pipeline=2 x fsdp=4, `{args.engine}` engine, jax {jax.__version__}, 8 simulated "
        f"CPU devices; GPT of {CFG.num_params():,} parameters (8 layers, width 256, sequence 128, batch {ROWS}). "
        "Per device per step; fsdp: a pipeline stage's layers; pipeline+fsdp: the embedding, head and final norm.",
        "",
        "| schedule | `pipeline_gather` | peak | fsdp gathers | fsdp gradient | pipeline+fsdp gathers |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    with open(os.path.join(RESULTS, f"pipeline_gather-{args.engine}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
