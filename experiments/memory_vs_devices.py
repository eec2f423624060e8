"""Memory per device against the device count p = 1, 2, 4, 8, 16, beside the ideal curves.

One process simulates 16 CPU devices; each p builds its mesh over the first p of them. For every
stage it measures the live state's shards on one device and the compiled step's peak
(memory_analysis), against `kept_state_bytes` (what zerojax keeps) as p grows: stage 0 stays flat,
stages 1-2 approach the replicated part (fp32: 4Ψ), stage 3 falls as 12Ψ/p.

    python -m experiments.memory_vs_devices     # ~5 min here; writes results/memory_vs_devices.{md,json,png}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from experiments.common import RESULTS
from zerojax.core.optim import get_optimizer
from zerojax.core.precision import get_precision
from zerojax.core.stages import STAGE_INDICES

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "tiny.yaml")
COUNTS = (1, 2, 4, 8, 16)
STAGES = STAGE_INDICES


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="20m")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--engine", default="shard_map")
    a = p.parse_args()
    from zerojax.core.mesh import simulate_cpu_devices

    simulate_cpu_devices(max(COUNTS))
    import jax

    from zerojax.cli.config import load_config
    from zerojax.cli.experiment import model_config

    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows = _measure(a)
    psi = rows[0]["params"]
    seq = model_config(load_config(CONFIG, [f"model.preset={a.model}"])).seq_len
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "memory_vs_devices.json"), "w") as f:
        json.dump({"started": started, "args": vars(a), "rows": rows}, f, indent=2)
    _write_table(a, rows, psi, seq, started, jax.__version__)
    _plot(a, rows, psi)
    return 0


def _measure(a) -> list[dict]:
    """One row per stage x device count: the first `count` simulated devices."""
    import jax

    from zerojax.cli.commands.compare_run import run_row
    from zerojax.cli.config import load_config

    rows = []
    for stage in STAGES:
        for count in COUNTS:
            c = load_config(
                CONFIG,
                [
                    f"model.preset={a.model}",
                    f"precision={a.precision}",
                    f"zero.stage={stage}",
                    f"zero.engine={a.engine}",
                    "train.steps=1",
                    "train.batch_size=16",
                ],
            )
            row, params, _ = run_row(c, 1, devices=jax.devices()[:count])
            row.update(p=count, params=params)
            rows.append(row)
            print(
                f"stage {stage} p={count:2d}: persistent {row['persistent_bytes_per_device'] / 2**20:8.2f} MiB "
                f"(x{row['persistent_ratio']:.4f} ideal), peak {row['peak_bytes_per_device'] / 2**20:8.2f} MiB",
                flush=True,
            )
    return rows


def _write_table(a, rows: list[dict], psi: float, seq: int, started: str, jax_version: str) -> None:
    lines = [
        "# Memory per device against device count",
        "",
        f"Made by `python -m experiments.memory_vs_devices` on {started}: the {a.model} GPT ({psi / 1e6:.2f}M "
        f"parameters), {a.precision} + Adam, engine `{a.engine}`, global batch 16 x {seq} tokens, "
        f"meshes over the first p of 16 simulated CPU devices (jax {jax_version}).",
        "",
        "**persistent**: the live state's shards on one device; **ideal**: `kept_state_bytes` (what zerojax keeps; "
        "no gradients); **peak**: `memory_analysis()` of the step (arguments + outputs - aliased + temporaries). "
        "MiB per device.",
        "",
        "| stage | " + " | ".join(f"p={n} persistent / ideal / peak" for n in COUNTS) + " |",
        "|---|" + "---|" * len(COUNTS),
    ]
    for stage in STAGES:
        cells = []
        for n in COUNTS:
            r = next(r for r in rows if r["stage"] == stage and r["p"] == n)
            cells.append(
                f"{r['persistent_bytes_per_device'] / 2**20:,.1f} / "
                f"{r['ideal_persistent_bytes_per_device'] / 2**20:,.1f} / {r['peak_bytes_per_device'] / 2**20:,.1f}"
            )
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    worst = max(abs(r["persistent_ratio"] - 1) for r in rows)
    s3 = {r["p"]: r for r in rows if r["stage"] == 3}
    lines += [
        "",
        f"Largest persistent deviation from the ideal: {worst:.4%}. Stage 3 from p=1 to p=16: persistent "
        f"x{s3[1]['persistent_bytes_per_device'] / s3[16]['persistent_bytes_per_device']:.2f} smaller "
        f"(ideal 16), peak x{s3[1]['peak_bytes_per_device'] / s3[16]['peak_bytes_per_device']:.2f} smaller "
        "(the global batch is fixed, so activations shrink with p too; one layer's gathered weights and their "
        "gradient do not).",
        "",
        "![memory per device against p](memory_vs_devices.png)",
        "",
    ]
    with open(os.path.join(RESULTS, "memory_vs_devices.md"), "w") as f:
        f.write("\n".join(lines))


def _plot(a, rows: list[dict], psi: float) -> None:
    import matplotlib

    from zerojax.accounting import analytic as A

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policy, adam = get_precision(a.precision), get_optimizer("adamw")
    fig, ax = plt.subplots(figsize=(7.5, 5))
    every = range(1, max(COUNTS) + 1)
    for stage, color in zip(STAGES, ("tab:red", "tab:orange", "tab:green", "tab:blue")):
        sel = [next(r for r in rows if r["stage"] == stage and r["p"] == n) for n in COUNTS]
        ideal = [A.kept_state_bytes(psi, q, stage, policy, adam)["total"] for q in every]
        ax.plot(every, [y / 2**20 for y in ideal], "-", color=color, alpha=0.5, label=f"stage {stage} ideal (kept)")
        ax.plot(
            COUNTS,
            [r["persistent_bytes_per_device"] / 2**20 for r in sel],
            "o",
            color=color,
            label=f"stage {stage} persistent",
        )
        ax.plot(
            COUNTS,
            [r["peak_bytes_per_device"] / 2**20 for r in sel],
            "^--",
            color=color,
            alpha=0.7,
            label=f"stage {stage} peak",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(COUNTS, [str(n) for n in COUNTS])
    ax.set_xlabel("devices p")
    ax.set_ylabel("MiB per device")
    ax.set_title(f"{a.model} GPT ({psi / 1e6:.1f}M), {a.precision} + Adam: memory per device")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "memory_vs_devices.png"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
