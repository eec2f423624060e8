"""Collective traffic and memory of the step as XLA:GPU compiles it for 8 GPUs, beside XLA:CPU's figures.

The CPU tables count the HLO right after SPMD partitioning because XLA:CPU's later passes upcast
bf16 collectives to f32. A GPU compiler runs other passes after partitioning (collective
combiners, async collectives, its own scheduler), so this compiles each (model, engine, stage) row
for 8 GPUs and counts both programs: the partitioned HLO (what the CPU tables show) and XLA:GPU's
final HLO (what would run). On a machine with one GPU the 8 devices come from JAX's mock GPU
topology (`jax_mock_gpu_topology`, as ahead-of-time compilation for a pod uses): the step is
compiled, never run, and nothing is allocated. Elsewhere the same rows come from 8 simulated CPU
devices, so the script can be checked where no GPU is.

Writes experiments/results/gpu_traffic.{md,json} when it ran on a GPU (or with --out elsewhere).

    python -m experiments.gpu_traffic [--models tiny,20m] [--precisions bf16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback

from experiments.common import RESULTS, cpu_devices, sweep_config

DEVICES = 8


def start_jax(mock: str, devices: int = DEVICES):
    """`jax` with `devices` devices to compile for: mock GPUs where a CUDA plugin is installed (`mock`:
    "topology" sets `jax_mock_gpu_topology`, "processes" `mock_num_gpu_processes`), else simulated CPUs."""
    import importlib.util

    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        # autotuning would time kernels on the one real GPU for 8 mock ones; the bytes do not depend on it
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0 --xla_gpu_shard_autotuning=false".strip()
        import jax

        if mock == "topology":
            jax.config.update("jax_mock_gpu_topology", f"1x{devices}x1")  # 8 hosts of one GPU each
        else:
            jax.config.update("mock_num_gpu_processes", devices)
        return jax
    cpu_devices(devices)
    import jax

    return jax


def row(jax, model: str, precision: str, engine: str, stage: int, dump: str | None = None) -> dict:
    import jax.numpy as jnp

    from zerojax.accounting.activations import GPTShape
    from zerojax.accounting.hlo import collective_bytes
    from zerojax.accounting.measure import ideal, persistent_bytes
    from zerojax.accounting.partitioned import compile_partitioned
    from zerojax.cli.experiment import build_experiment

    c = sweep_config(model, precision, engine, stage)
    exp = build_experiment(c, devices=jax.devices()[:DEVICES])
    trainer, gpt = exp.trainer, exp.model
    batch = {
        k: jax.ShapeDtypeStruct((c.train.batch_size, gpt.seq_len), jnp.int32, sharding=trainer.batch_sharding)
        for k in ("inputs", "targets")
    }
    prep = trainer.prepare(jax.random.key(0), batch)
    state = prep.abstract  # the whole state `init` would place, compute copy included: nothing allocated
    with tempfile.TemporaryDirectory(prefix="zerojax-hlo-") as tmp:
        compiled, text = compile_partitioned(prep.step_fn.lower(state, batch), tmp)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for name, hlo in (("partitioned", text), ("final", compiled.as_text())):
            with open(os.path.join(dump, f"{model}-{precision}-{engine}-{stage}.{name}.txt"), "w") as f:
                f.write(hlo)
    part = collective_bytes(text, mesh=trainer.mesh, allow_unknown_trips=True)
    final = collective_bytes(compiled.as_text(), allow_unknown_trips=True)
    ma = compiled.memory_analysis()
    micro = c.train.batch_size // DEVICES
    want = ideal(trainer, c.optimizer.name, GPTShape.of(gpt), gpt.seq_len, micro, gpt.remat, layout=prep.layout)
    return {
        "model": model,
        "precision": precision,
        "engine": engine,
        "stage": stage,
        "params": want.params,
        "persistent_bytes": persistent_bytes(trainer, state),
        "ideal_persistent_bytes": want.persistent_bytes,
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "ideal_collective_bytes": want.collective_bytes,
        "partitioned": {k: part[k] for k in ("bytes", "counts", "total", "unknown_trip_counts")},
        "final": {k: final[k] for k in ("bytes", "counts", "total", "unknown_trip_counts")},
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def _counts(counts: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


def render(rows: list[dict], header: str) -> str:
    out = [
        "# Collective traffic and memory as XLA:GPU compiles the step for 8 GPUs",
        "",
        header,
        "",
        "- **partitioned**: bytes each device sends per step on the HLO right after SPMD partitioning, counted "
        "as in `traffic_by_stage.md` (`zerojax.accounting.hlo`); **final**: the same count on the compiler's "
        "final program, after its combiners and scheduler. **ideal**: `traffic_bytes`.",
        "- **collectives**: how many each program issues per step (a loop body's once per iteration).",
        "- **temp**: `memory_analysis()` temporaries per device; **kept**: the state's shards per device.",
        "",
        "| model | precision | stage | engine | partitioned MiB | final MiB | ideal MiB | partitioned collectives "
        "| final collectives | temp MiB | kept MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['model']} | {r['precision']} | {r['stage']} | {r['engine']} | failed: {r['error']} | | | | | | |"
            )
            continue
        p, f = r["partitioned"], r["final"]
        out.append(
            f"| {r['model']} | {r['precision']} | {r['stage']} | {r['engine']} | {_mib(p['total'])} | "
            f"{_mib(f['total'])} | {_mib(r['ideal_collective_bytes'])} | {_counts(p['counts'])} | "
            f"{_counts(f['counts'])} | {_mib(r['temp_bytes'])} | {_mib(r['persistent_bytes'])} |"
        )
    unknown = sum(r["final"]["unknown_trip_counts"] for r in rows if "final" in r)
    if unknown:
        out += ["", f"{unknown} collective(s) of the final programs sit in loops of unread trip count: counted once."]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,20m")
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--engines", default="gspmd,shard_map")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--mock", choices=("topology", "processes"), default="topology", help="how 8 GPUs are mocked")
    p.add_argument("--dump", default=None, help="folder for each row's partitioned and final HLO text")
    p.add_argument("--out", default=None, help="folder for the results (default: experiments/results on a GPU)")
    a = p.parse_args()
    jax = start_jax(a.mock)
    platform = jax.devices()[0].platform
    if len(jax.devices()) < DEVICES:
        sys.stderr.write(f"error: {len(jax.devices())} {platform} device(s), not {DEVICES}; try --mock processes\n")
        return 3
    out_dir = a.out or (RESULTS if platform == "gpu" else None)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for model in a.models.split(","):
        for precision in a.precisions.split(","):
            for engine in a.engines.split(","):
                for stage in (int(s) for s in a.stages.split(",")):
                    try:
                        r = row(jax, model, precision, engine, stage, a.dump)
                        print(
                            f"{model} {precision} {engine} stage {stage}: partitioned {_mib(r['partitioned']['total'])}"
                            f" MiB, final {_mib(r['final']['total'])} MiB, final {_counts(r['final']['counts'])}",
                            flush=True,
                        )
                    except Exception as e:  # one failed row must not lose the others' figures
                        traceback.print_exc()
                        r = {"model": model, "precision": precision, "engine": engine, "stage": stage}
                        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(r)
    kind = jax.devices()[0].device_kind
    header = (
        f"Made by `python -m experiments.gpu_traffic {' '.join(sys.argv[1:])}` on {started}: {DEVICES} x {kind} "
        f"({platform}{', mock topology: compiled, not run' if platform == 'gpu' else ''}), jax {jax.__version__}, "
        "fsdp = 8, Adam, global batch 16."
    )
    text = render(rows, header)
    print(text)
    if out_dir is None:
        print("(no GPU: nothing written; pass --out to keep the CPU figures)")
        return 0
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_traffic.json"), "w") as f:
        json.dump({"started": started, "device_kind": kind, "jax": jax.__version__, "rows": rows}, f, indent=2)
    with open(os.path.join(out_dir, "gpu_traffic.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
