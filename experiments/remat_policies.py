"""Each activation-checkpoint policy (`model.remat`) on a small GPT, 8 simulated CPU devices: the
compiled step's temp bytes, the forward + backward's own temp bytes (stage 0, the activation memory)
beside the planner's estimate, and step time as a paired ratio to `full` (policies interleaved
round by round in one process, so machine load affects them alike).

`offload` is not run: XLA:CPU places no host memory (see zerojax/core/remat.py); its device side is
`full`'s, its host side is in tests/test_remat.py.

    python -m experiments.remat_policies      # a few minutes on 2 cores
"""

from __future__ import annotations

import os

from experiments.common import RESULTS, cpu_devices

cpu_devices(8)

import datetime
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax as zj
from zerojax.accounting import measure
from zerojax.accounting.activations import activation_bytes_gpt
from zerojax.models.gpt import GPT, gpt_config

HERE = os.path.dirname(os.path.abspath(__file__))
P, ROWS, STAGE, ROUNDS = 8, 32, 3, 6
SHAPE = dict(n_layers=4)  # the 20m preset (d_model 512, d_ff 1536, seq 128) with 4 layers instead of 6
POLICIES = ("none", "dots", "full")


def main() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (ROWS, 129), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    runs = {}
    for policy in POLICIES:
        cfg = gpt_config("20m", **SHAPE, remat=policy)
        trainer = zj.Trainer(functools.partial(GPT, cfg), optax.adamw(1e-3), mesh=zj.make_mesh(fsdp=P), stage=STAGE)
        state = trainer.init(jax.random.key(0), batch)
        sharded = trainer.shard_batch(batch)
        t = time.perf_counter()
        compiled = trainer.compile(state, sharded)
        compile_s = time.perf_counter() - t
        abstract = {k: jax.ShapeDtypeStruct(v.shape, jnp.int32) for k, v in batch.items()}
        runs[policy] = {
            "trainer": trainer,
            "state": state,
            "batch": sharded,
            "compiled": compiled,
            "compile_s": compile_s,
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "activation_temp_bytes": measure.activation_temp_bytes(trainer, abstract),
            "estimate_bytes": activation_bytes_gpt(
                cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size, cfg.seq_len, ROWS // P, 4, policy
            ),
            "times": [],
            "losses": [],
        }
        state, metrics = compiled(state, sharded)  # warm up
        runs[policy]["state"] = state
    for _ in range(ROUNDS):
        for policy in POLICIES:
            r = runs[policy]
            t = time.perf_counter()
            r["state"], metrics = r["compiled"](r["state"], r["batch"])
            r["losses"].append(float(metrics["loss"]))  # blocks until done
            r["times"].append(time.perf_counter() - t)
    paired = {p: [a / b for a, b in zip(runs[p]["times"], runs["full"]["times"])] for p in POLICIES}
    ratios = {p: statistics.median(paired[p]) for p in POLICIES}
    load = os.getloadavg()
    cfg = gpt_config("20m", **SHAPE)
    rows = []
    md = [
        "# Activation-checkpoint policies: memory and step time",
        "",
        f"Made by `python -m experiments.remat_policies` on {datetime.date.today().isoformat()}, jax "
        f"{jax.__version__}, XLA:CPU with {P} simulated devices on this machine's shared cores. The 20m GPT preset "
        f"with {cfg.n_layers} layers (d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_heads} heads, seq "
        f"{cfg.seq_len}; {cfg.num_params():,} params), fp32, AdamW, stage {STAGE} (gspmd), {ROWS} sequences "
        f"({ROWS // P} per device). Step time: {ROUNDS} rounds, each running the policies one after the other; "
        "the ratio is the median over rounds of (policy / full) in the same round, its range the smallest and "
        f"largest round's. Load average at the end: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on "
        f"{os.cpu_count()} cores (the run's own 8 simulated devices included); step times are compared within a round.",
        "",
        "| remat | step temp bytes | fwd+bwd temp bytes (stage 0) | planner's estimate | estimate / measured | "
        "median step s | step time / full (paired) | range over rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        r = runs[p]
        row = {
            k: r[k] for k in ("temp_bytes", "activation_temp_bytes", "estimate_bytes", "compile_s", "times", "losses")
        }
        row.update(
            policy=p,
            step_time_ratio_vs_full=ratios[p],
            paired_ratios=paired[p],
            median_step_s=statistics.median(r["times"]),
            load_average=load,
        )
        rows.append(row)
        md.append(
            f"| {p} | {r['temp_bytes']:,} | {r['activation_temp_bytes']:,} | {r['estimate_bytes']:,} | "
            f"{r['estimate_bytes'] / r['activation_temp_bytes']:.2f} | {row['median_step_s']:.3f} | "
            f"{ratios[p]:.3f} | {min(paired[p]):.3f}-{max(paired[p]):.3f} |"
        )
    md += [
        "",
        "`offload` (dots' residuals kept in pinned host memory) is not in the table: XLA:CPU cannot place "
        "host memory, so on CPU it is a UserError. Its device memory is modelled as `full`'s and its host bytes "
        "as the weight-matmul outputs (4 d_model + 2 d_ff per token per layer), counted on the program lowered "
        "for a GPU in tests/test_remat.py. No GPU was available to time it.",
        "",
    ]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "remat_policies.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(RESULTS, "remat_policies.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
