"""ZeRO++ (qwZ, qgZ, hpZ) on the tiny GPT: traffic per mesh axis and loss curves against the plain stage 3.

Every run is configs/tiny.yaml with the shard_map engine at stage 3 on a data=2 x fsdp=4 mesh of
8 simulated CPU devices, in bf16, the same seed and data: one compile (its partitioned HLO counted,
bytes split by the mesh axes each collective spans), then --steps steps. Writes experiments/results/
  zeropp.json   every run's row (bytes by kind and by axis, losses)
  zeropp.md     the per-axis traffic table, the bytes ratios and the last-50-step loss means
  zeropp.png    the loss curves

    python -m experiments.zeropp                # 300 steps, 7 runs: ~8 min here
    python -m experiments.zeropp --runs hpZ     # one run again, the others kept from zeropp.json
    python -m experiments.zeropp --steps 30     # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from experiments.common import RESULTS

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "tiny.yaml")
RUNS = {  # name -> config overrides
    "stage 3 (bf16)": [],
    "qwZ int8": ["zero.quantize_weights=int8"],
    "qgZ int8": ["zero.quantize_grads=int8"],
    "qwZ + qgZ int8": ["zero.quantize_weights=int8", "zero.quantize_grads=int8"],
    "qwZ fp8": ["zero.quantize_weights=fp8"],
    "hpZ": ["zero.hierarchical=true"],
    "hpZ + qwZ + qgZ int8": ["zero.hierarchical=true", "zero.quantize_weights=int8", "zero.quantize_grads=int8"],
}
TAIL = 50  # the acceptance compares the mean of the last 50 losses


def run(steps: int, precision: str, names) -> list[dict]:
    from zerojax.cli.commands.compare_run import run_row
    from zerojax.cli.config import load_config

    rows = []
    for name in names:
        overrides = RUNS[name]
        c = load_config(
            CONFIG,
            [
                "zero.engine=shard_map",
                "zero.stage=3",
                "mesh.data=2",
                "mesh.fsdp=4",
                f"precision={precision}",
                f"train.steps={steps}",
                *overrides,
            ],
        )
        row, params, devices = run_row(c, steps)
        row.update(name=name, overrides=overrides, params=params, devices=devices)
        rows.append(row)
        print(f"{name}: {row['collective_bytes_by_kind']} last-{TAIL} mean loss {_tail(row['losses']):.4f}", flush=True)
    return rows


def _tail(losses) -> float:
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def _on(row, kinds, axes: str) -> float:
    per = row["collective_bytes_by_kind_axis"]
    return sum(per.get(k, {}).get(axes, 0.0) for k in kinds)


def write_markdown(rows: list[dict], steps: int, precision: str, path: str) -> None:
    base = rows[0]
    gather0 = _on(base, ("all-gather",), "fsdp")
    reduce0 = _on(base, ("reduce-scatter", "all-to-all"), "fsdp")
    axes = sorted({a for r in rows for a in r["collective_bytes_by_axis"]}, key=lambda a: (a != "fsdp", a))
    lines = [
        "# ZeRO++ on the tiny GPT: traffic per mesh axis and convergence",
        "",
        f"`python -m experiments.zeropp --steps {steps} --precision {precision}` "
        f"({datetime.date.today().isoformat()}): configs/tiny.yaml ({base['params']:,} params), shard_map "
        f"engine, stage 3, mesh data=2 x fsdp=4 on {base['devices']} simulated CPU devices, {precision}, "
        f"seed 0, {steps} steps, the same batches in every run.",
        "",
        "## Traffic per device per step, by the mesh axes each collective's replica groups span (KiB)",
        "",
        "Counted on the HLO right after SPMD partitioning (`zerojax.accounting.hlo.collective_bytes(..., "
        "mesh=)`). Parameter gather: the all-gathers over fsdp (int8 codes + fp32 scales with qwZ); "
        "gradient reduction: the reduce-scatters and all-to-alls over fsdp. Over `data`: without hpZ the "
        "all-reduce that sums the replicas' gradient shards (in the reduce dtype, not quantized); with hpZ "
        "the once-per-step gather of the secondary copy and the layers' gradient reduce-scatters into the "
        "primary shards.",
        "",
        "| run | " + " | ".join(axes) + " | total | param gather (fsdp) | vs bf16 | grad reduction (fsdp) "
        "| vs bf16 | over data: all-reduce / all-gather / reduce-scatter |",
        "|---|" + "---:|" * (len(axes) + 6),
    ]
    for r in rows:
        gather = _on(r, ("all-gather",), "fsdp")
        reduce = _on(r, ("reduce-scatter", "all-to-all"), "fsdp")
        data = " / ".join(_kib(_on(r, (k,), "data")) for k in ("all-reduce", "all-gather", "reduce-scatter"))
        lines.append(
            f"| {r['name']} | "
            + " | ".join(_kib(r["collective_bytes_by_axis"].get(a, 0.0)) for a in axes)
            + f" | {_kib(r['collective_bytes_per_device_per_step'])} | {_kib(gather)} | "
            f"{gather / gather0:.3f} | {_kib(reduce)} | {reduce / reduce0:.3f} | {data} |"
        )
    lines += [
        "",
        "State kept per device (live shards) and the compiled step's temporaries (`memory_analysis()`), bytes:",
        "",
        "| run | state | vs stage 3 (bf16) | temp | vs stage 3 (bf16) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        state, temp = r["persistent_bytes_per_device"], r["temp_bytes_per_device"]
        lines.append(
            f"| {r['name']} | {state:,} | {state - base['persistent_bytes_per_device']:+,} | "
            f"{temp:,} | {temp - base['temp_bytes_per_device']:+,} |"
        )
    lines += [
        "",
        f"## Convergence: mean of the last {TAIL} losses",
        "",
        "| run | first loss | last loss | mean of last 50 | vs stage 3 (bf16) |",
        "|---|---:|---:|---:|---:|",
    ]
    ref = _tail(base["losses"])
    for r in rows:
        t = _tail(r["losses"])
        lines.append(
            f"| {r['name']} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {t:.4f} | {(t - ref) / ref * 100:+.2f}% |"
        )
    lines += ["", "![loss curves](zeropp.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        steps = range(1, len(r["losses"]) + 1)
        ax.plot(steps, r["losses"], label=r["name"], lw=1)
        zoom.plot(steps, r["losses"], label=r["name"], lw=1)
    n = len(rows[0]["losses"])
    zoom.set_xlim(max(1, n - TAIL * 2), n)
    tail = [x for r in rows for x in r["losses"][-TAIL * 2 :]]
    zoom.set_ylim(min(tail) - 0.02, max(tail) + 0.02)
    for a, title in ((ax, "training loss"), (zoom, f"last {min(n, TAIL * 2)} steps")):
        a.set_xlabel("step")
        a.set_ylabel("loss")
        a.set_title(title)
        a.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("ZeRO++ on the tiny GPT (shard_map, stage 3, data=2 x fsdp=4, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--out", default=RESULTS)
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated run names; the others are kept from an earlier zeropp.json",
    )
    args = p.parse_args()
    from zerojax.core.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    new = {r["name"]: r for r in run(args.steps, args.precision, names)}
    os.makedirs(args.out, exist_ok=True)
    old = os.path.join(args.out, "zeropp.json")
    kept = {r["name"]: r for r in json.load(open(old))} if os.path.exists(old) else {}
    kept = {n: r for n, r in kept.items() if len(r["losses"]) == args.steps and "collective_bytes_by_kind_axis" in r}
    rows = [new.get(n) or kept[n] for n in RUNS if n in new or n in kept]
    with open(os.path.join(args.out, "zeropp.json"), "w") as f:
        json.dump(rows, f, indent=1)
    write_markdown(rows, args.steps, args.precision, os.path.join(args.out, "zeropp.md"))
    plot(rows, os.path.join(args.out, "zeropp.png"))
    print(open(os.path.join(args.out, "zeropp.md")).read())


if __name__ == "__main__":
    main()
