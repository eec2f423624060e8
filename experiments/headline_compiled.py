"""The headline with a per-device memory budget, as a GPU's memory would bound it: the largest
user-written NNX model (`experiments.user_model:DeepClassifier`, an unscanned list of residual MLP
blocks, gathered unit by unit at stage 3) that fits and trains 3 steps at ZeRO stage 0 and at stage 3,
8 simulated CPU devices, fp32 + AdamW, both engines.

A model fits a budget B when its compiled train step's per-device peak, `memory_analysis()` arguments
+ outputs - aliased + temporaries (`zerojax.accounting.peak_bytes`), is at most B. Process resident
memory (experiments/headline.py) cannot measure this model on CPU: XLA:CPU's compiler holds
gigabytes for an unrolled stack (about 4 GB at 16 blocks, growing faster than linearly). The model
is built from the same config as headline.py's `zerojax train` command (in this process); the depth
grows at a fixed width. The search calibrates bytes per block on two depths, predicts the largest,
then steps one block at a time to the exact edge, compiling only; the largest model of each stage
then trains 3 steps (one more compile), and its losses must be finite.

    python -m experiments.headline_compiled --budget-mib 110   # ~45 min -> results/headline-user-compiled.{md,json,png}
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
HERE = os.path.dirname(os.path.abspath(__file__))

import jax

from experiments import headline
from zerojax.accounting import peak_bytes
from zerojax.cli.config import load_config
from zerojax.cli.experiment import build_experiment
from zerojax.data import sources

MIB = 2**20
NAME = "headline-user-compiled"


def build(stage: int, layers: int, a):
    """The trainer and first batch of headline.py's `zerojax train` command for this attempt."""
    cmd = headline.command(stage, layers, a)
    exp = build_experiment(
        load_config(os.path.join(headline.REPO, cmd[2]), [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"])
    )
    trainer = exp.trainer
    return trainer, exp.train_data, sources.global_batch(exp.train_data, 0, trainer.batch_sharding), cmd


def attempt(stage: int, layers: int, a, budget: int, train: bool = False) -> dict:
    """Compile the step (from the abstract state: nothing allocated); with `train`, also run 3 steps."""
    t0 = time.time()
    trainer, source, batch, cmd = build(stage, layers, a)
    key = jax.random.key(0)
    if train:
        state = trainer.init(key, batch)
        compiled = trainer.compile(state, batch)  # trainer.step runs this compiled program
    else:
        compiled = trainer.prepare(key, batch).step_fn.lower(trainer.prepare(key, batch).abstract, batch).compile()
    m = compiled.memory_analysis()
    sizes = {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
    }
    peak = int(peak_bytes(*(int(v) for v in sizes.values())))
    row = {
        "engine": a.engine,
        "stage": stage,
        "layers": layers,
        "params": headline.params(layers, a),
        "peak_bytes": peak,
        "fits": peak <= budget,
        **{k: int(v) for k, v in sizes.items()},
        "command": shlex.join(cmd).replace("OUT", "runs/headline"),
    }
    if train:
        losses = []
        for step in range(3):
            state, metrics = trainer.step(state, sources.global_batch(source, step, trainer.batch_sharding))
            losses.append(float(metrics["loss"]))
        row.update(losses=losses, trained=all(map(math.isfinite, losses)))
    row["wall_s"] = round(time.time() - t0, 1)
    print(
        f"{a.engine:9s} stage {stage} depth {layers:3d} ({row['params'] / 1e6:6.2f}M): peak {peak / MIB:8.2f} MiB, "
        f"{'fits' if row['fits'] else 'over'}{', losses ' + str(row['losses']) if train else ''}, "
        f"{row['wall_s']:.0f} s",
        flush=True,
    )
    return row


def largest(rows: list[dict], engine: str, stage: int) -> dict | None:
    return max(
        (r for r in rows if r["engine"] == engine and r["stage"] == stage and r["fits"] and "losses" not in r),
        key=lambda r: r["layers"],
        default=None,
    )


def write(res: dict) -> None:
    a, budget, rows, trained = argparse.Namespace(**res["args"]), res["budget_bytes"], res["attempts"], res["trained"]
    with open(os.path.join(headline.RESULTS, f"{NAME}.json"), "w") as f:
        json.dump(res, f, indent=2)
    block = headline.params(1, a) - headline.params(0, a)
    lines = [
        "# Headline (compiled per-device budget): the largest user-written NNX model, stage 0 vs stage 3",
        "",
        f"Run {res['started']} ({res['minutes']:.1f} min in all), jax {jax.__version__}, 8 simulated CPU devices, "
        f"fp32 params + AdamW, `experiments.user_model:DeepClassifier`: an unscanned `nnx.List` of residual MLP "
        f"blocks (LayerNorm, Linear {a.width}->{a.d_ff}, GELU, Linear {a.d_ff}->{a.width}; {block:,} parameters a "
        f"block), gathered unit by unit at stage 3, grown in depth at width {a.width}; global batch {a.batch} x 32 "
        f"features, 8 classes.",
        "",
        f"**Budget: {budget / MIB:.0f} MiB per device** of the compiled train step's peak, `memory_analysis()` "
        "arguments + outputs - aliased + temporaries, as a GPU's memory would bound it. A depth fits when its "
        "peak is at most the budget (compiled only); the largest depth that fits, whose next depth does not, "
        "then trains 3 steps and must give finite losses.",
        "",
        "Made by `" + res["command"] + "`.",
        "",
        "| engine | stage 0: largest that fits | stage 3: largest that fits | ratio (params) "
        "| losses of the 3 steps (stage 0; stage 3) |",
        "|---|---|---|---|---|",
    ]
    for e in res["engines"]:
        best = {s: largest(rows, e, s) for s in (0, 3)}
        t = {s: next((r for r in trained if r["engine"] == e and r["stage"] == s), None) for s in (0, 3)}
        cell = lambda r: (
            f"{r['layers']} blocks, {r['params'] / 1e6:.2f}M, {r['peak_bytes'] / MIB:.1f} MiB" if r else "none"
        )  # noqa: E731
        ratio = f"**{best[3]['params'] / best[0]['params']:.2f}×**" if best[0] and best[3] else "-"
        loss = "; ".join(", ".join(f"{x:.3f}" for x in t[s]["losses"]) if t[s] else "-" for s in (0, 3))
        lines.append(f"| `{e}` | {cell(best[0])} | {cell(best[3])} | {ratio} | {loss} |")
    lines += [
        "",
        "\n\n".join(res["notes"]),
        "",
        "Every attempt (compile only; the `train` rows are the 3-step runs, compiled again):",
        "",
        "| engine | stage | depth | parameters | arguments | outputs - aliased | temporaries | peak | fits | wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows + trained:
        lines.append(
            f"| {r['engine']} | {r['stage']} | {r['layers']}{' train' if 'losses' in r else ''} | "
            f"{r['params'] / 1e6:.2f}M | {r['argument_bytes'] / MIB:.1f} | "
            f"{(r['output_bytes'] - r['alias_bytes']) / MIB:.1f} | {r['temp_bytes'] / MIB:.1f} | "
            f"{r['peak_bytes'] / MIB:.1f} MiB | {'yes' if r['fits'] else 'no'} | {r['wall_s']:.0f} s |"
        )
    lines += ["", "The equivalent `zerojax train` commands of the largest models:", ""]
    for r in trained:
        lines += ["```", r["command"], "```"]
    lines += ["", f"![compiled peak against parameters]({NAME}.png)", ""]
    with open(os.path.join(headline.RESULTS, f"{NAME}.md"), "w") as f:
        f.write("\n".join(lines))
    _plot(res)


def _plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["engines"]), figsize=(6 * len(res["engines"]), 4.2), sharey=True, squeeze=False)
    for ax, e in zip(axes[0], res["engines"]):
        for s, color in ((0, "tab:red"), (3, "tab:blue")):
            pts = sorted(
                (r["params"] / 1e6, r["peak_bytes"] / MIB, r["fits"])
                for r in res["attempts"]
                if r["engine"] == e and r["stage"] == s
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, alpha=0.5)
            ax.plot(
                [p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], "o", color=color, label=f"stage {s}: fits"
            )
            ax.plot(
                [p[0] for p in pts if not p[2]],
                [p[1] for p in pts if not p[2]],
                "x",
                color=color,
                markersize=9,
                label=f"stage {s}: over",
            )
        ax.axhline(res["budget_bytes"] / MIB, color="black", linestyle="--", label="budget")
        ax.set_title(f"engine {e}")
        ax.set_xlabel("parameters (millions)")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("compiled peak per device (MiB)")
    fig.tight_layout()
    fig.savefig(os.path.join(headline.RESULTS, f"{NAME}.png"), dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--budget-mib",
        type=float,
        default=110.0,
        help="compiled peak allowed per device (more compiles deeper stacks: ~9 GB of host memory at 24)",
    )
    p.add_argument("--engines", default="gspmd,shard_map")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=2048, help="the block's hidden width")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--note", action="append", default=[], help="a sentence for the result file (repeatable)")
    p.add_argument("--from-json", action="store_true", help="only re-render the .md (and notes) from the JSON")
    a = p.parse_args()
    path = os.path.join(headline.RESULTS, f"{NAME}.json")
    if a.from_json:
        with open(path) as f:
            res = json.load(f)
        write({**res, "notes": a.note or res["notes"]})
        return 0
    t0, budget = time.time(), int(a.budget_mib * MIB)
    res = {
        "command": "python -m experiments.headline_compiled " + " ".join(sys.argv[1:]),
        "jax": jax.__version__,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "budget_bytes": budget,
        "engines": a.engines.split(","),
        "attempts": [],
        "trained": [],
        "notes": a.note,
        "minutes": 0.0,
    }
    for engine in res["engines"]:
        ea = argparse.Namespace(**vars(a), model="user", engine=engine)
        res["args"] = {k: v for k, v in vars(ea).items() if k not in ("engine", "note", "from_json")}
        for stage in (0, 3):
            rows = headline.search(
                stage, ea, budget, (2, 3) if stage == 0 else (4, 8), run=attempt, ok="fits", peak="peak_bytes", step=1
            )
            res["attempts"] += rows
            best = largest(rows, engine, stage)
            if best:
                res["trained"].append(attempt(stage, best["layers"], ea, budget, train=True))
            res["minutes"] = (time.time() - t0) / 60
            write(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
