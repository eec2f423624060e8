"""The headline: the largest model that trains 3 steps at ZeRO stage 0 and at stage 3 on this machine,
with 8 simulated CPU devices: the shipped GPT (a scanned stack of blocks), or a user-written NNX
model (`experiments.user_model:DeepClassifier`, an unscanned Python list of residual MLP blocks,
gathered unit by unit at stage 3).

All 8 simulated devices live in one process's memory, so whatever a stage replicates costs 8x:
stage 0 keeps 12 bytes per parameter per device in fp32 + Adam (96 bytes per parameter in all),
stage 3 keeps 12 / 8 per device (12 in all). The step's temporaries add to both.

Each attempt is its own `zerojax train` process (exact command recorded). Its peak resident memory is
the kernel's `ru_maxrss` for that child (os.wait4); a watchdog kills it as soon as its resident
memory crosses the budget, so the machine stays safe and a kill means "does not fit". The model
grows in depth at a fixed width; the search calibrates bytes per layer on two small models, predicts
the largest depth, then steps up until an attempt no longer fits (or down until one does).

    python -m experiments.headline --model gpt --engine gspmd   # ~15 min -> results/headline-gpt-gspmd.{md,json,png}
    python -m experiments.headline --model user --engine shard_map --budget-gib 6

For the user model, XLA:CPU's compiler dominates resident memory (about 4 GB at 16 unrolled blocks,
growing faster than linearly); experiments/headline_compiled.py budgets the compiled step's
per-device peak instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time

from experiments.common import RESULTS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GIB = 2**30


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


def command(stage: int, layers: int, a) -> list[str]:
    if a.model == "gpt":
        config = "configs/tiny.yaml"
        sets = {
            "model.d_model": a.width,
            "model.n_heads": a.width // 64,
            "model.d_ff": a.d_ff,
            "model.n_layers": layers,
            "model.seq_len": a.seq,
        }
    else:
        config = "configs/user-mlp.yaml"
        sets = {
            "model.target": "experiments.user_model:DeepClassifier",
            "model.kwargs.width": a.width,
            "model.kwargs.hidden": a.d_ff,
            "model.kwargs.depth": layers,
            "train.eval_every": 0,
        }
    sets.update(
        {
            "zero.stage": stage,
            "zero.engine": a.engine,
            "precision": "fp32",
            "train.batch_size": a.batch,
            "train.steps": 3,
            "optimizer.warmup_steps": 0,
            "checkpoint.every": 0,
        }
    )
    if a.model == "gpt":
        sets["data.eval_fraction"] = 0
    cmd = ["zerojax", "train", config, "--devices", "8", "--out", "OUT"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def params(layers: int, a) -> int:
    d, f = a.width, a.d_ff
    if a.model == "user":
        from user_model import DeepClassifier  # experiments/ is on the path when run as a script

        return DeepClassifier.num_params(width=d, hidden=f, depth=layers)
    return 2 * 256 * d + d + layers * (2 * d + 4 * d * d + 3 * d * f)


def attempt(stage: int, layers: int, a, budget: int) -> dict:
    cmd = command(stage, layers, a)
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "zerojax.cli.main", *[out if c == "OUT" else c for c in cmd[1:]]]
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        killed, reaped = {"at": 0}, threading.Event()

        def watchdog():  # never reaps the child (poll() would, racing the wait4 below for its rusage)
            while not reaped.is_set():
                rss = _rss(proc.pid)
                if rss > budget:
                    killed["at"] = rss
                    os.kill(proc.pid, 9)  # this child only, by its pid; not yet reaped, so still ours
                    return
                time.sleep(0.05)

        threading.Thread(target=watchdog, daemon=True).start()
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        reaped.set()
        proc.returncode = os.waitstatus_to_exitcode(status)
        summary = {}
        if proc.returncode == 0 and os.path.exists(os.path.join(out, "summary.json")):
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
    ok = proc.returncode == 0 and not killed["at"]
    row = {
        "stage": stage,
        "layers": layers,
        "params": params(layers, a),
        "trained": ok,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "killed_at_rss_bytes": killed["at"] or None,
        "wall_s": round(time.time() - t0, 1),
        "returncode": proc.returncode,
        "final_loss": summary.get("final_loss"),
        "median_step_s": summary.get("median_step_time_s"),
        "state_bytes_per_device": summary.get("persistent_bytes_per_device"),
        "command": shlex.join(cmd).replace("OUT", "runs/headline"),
    }
    if not ok and not killed["at"]:
        row["error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
    status_text = "trained" if ok else (f"killed at {killed['at'] / GIB:.2f} GiB" if killed["at"] else row.get("error"))
    print(
        f"stage {stage} layers {layers:3d} ({row['params'] / 1e6:7.1f}M): peak {row['peak_rss_bytes'] / GIB:5.2f} GiB, "
        f"{row['wall_s']:5.1f} s, {status_text}",
        flush=True,
    )
    return row


def search(
    stage: int,
    a,
    budget: int,
    small: tuple[int, int],
    run=attempt,
    ok: str = "trained",
    peak: str = "peak_rss_bytes",
    step: int | None = None,
) -> list[dict]:
    """Calibrate on two small depths, predict the largest, then step until the edge is found (exactly
    with step=1). `run(stage, layers, a, budget)` makes one attempt: a row whose `ok` key says it fits
    and whose `peak` key holds its peak bytes."""
    rows = [run(stage, small[0], a, budget), run(stage, small[1], a, budget)]
    r0, r1 = rows
    if not r0[ok]:
        return rows
    if not r1[ok]:  # the edge lies between the two: step down from the larger
        for layers in range(small[1] - 1, small[0], -1):
            rows.append(run(stage, layers, a, budget))
            if rows[-1][ok]:
                break
        return rows
    per_layer = max(1, (r1[peak] - r0[peak]) / (small[1] - small[0]))
    guess = int(small[0] + (0.98 * budget - r0[peak]) / per_layer)
    step = step or max(1, guess // 16)
    layers = max(small[1] + 1, guess)
    fitted = small[1]
    while True:
        row = run(stage, layers, a, budget)
        rows.append(row)
        if row[ok]:
            fitted = layers
            if any(r["layers"] == layers + step and not r[ok] for r in rows):
                break
            layers += step
        else:
            if layers - step <= fitted:
                break
            layers -= step
            if any(r["layers"] == layers and r[ok] for r in rows):
                break
    return rows


def write(rows: list[dict], a, budget: int, started: str) -> None:
    best = {
        s: max((r for r in rows if r["stage"] == s and r["trained"]), key=lambda r: r["params"], default=None)
        for s in (0, 3)
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{_name(a)}.json"), "w") as f:
        json.dump(
            {"budget_bytes": budget, "started": started, "args": vars(a), "attempts": rows, "largest": best},
            f,
            indent=2,
        )
    lines = [
        f"# Headline: the largest {_TITLE[a.model]} that trains on this machine, stage 0 vs stage 3",
        "",
        f"Run {started} on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB RAM), 8 simulated CPU devices in "
        f"one process, fp32 params + Adam (12 bytes per parameter kept), engine `{a.engine}`, width "
        f"{a.width} ({'d_ff' if a.model == 'gpt' else 'block hidden'} {a.d_ff}), depth searched, global batch "
        f"{a.batch} x {a.seq if a.model == 'gpt' else 32} "
        f"{'tokens' if a.model == 'gpt' else 'features'}, 3 steps each. "
        f"Memory budget {budget / GIB:.1f} GiB of peak resident memory (the smaller of --budget-gib and what was "
        "free at the start less 3 GiB, since other work shares the machine): an attempt whose resident memory "
        f"crosses it is killed and counts as not fitting. The whole search took "
        f"{sum(r['wall_s'] for r in rows) / 60:.1f} min.",
        "",
        f"Made by `python -m experiments.headline --model {a.model} --engine {a.engine} --budget-gib {a.budget_gib:g} "
        f"--width {a.width} --d-ff {a.d_ff} --seq {a.seq} --batch {a.batch}`.",
        "",
        "| stage | largest depth that trains | parameters | peak RSS | state per device | median step |",
        "|---|---|---|---|---|---|",
    ]
    for s, r in best.items():
        if r is None:
            lines.append(f"| {s} | none | - | - | - | - |")
            continue
        lines.append(
            f"| {s} | {r['layers']} | {r['params'] / 1e6:,.1f}M | {r['peak_rss_bytes'] / GIB:.2f} GiB | "
            f"{(r['state_bytes_per_device'] or 0) / GIB:.2f} GiB | {r['median_step_s']:.1f} s |"
        )
    if best[0] and best[3]:
        lines += [
            "",
            f"**Stage 3 trains a {best[3]['params'] / best[0]['params']:.1f}x larger model than stage 0** "
            f"({best[3]['params'] / 1e6:,.0f}M vs {best[0]['params'] / 1e6:,.0f}M parameters) in the same "
            f"{budget / GIB:.1f} GiB. Peak resident bytes per parameter: stage 0 "
            f"{best[0]['peak_rss_bytes'] / best[0]['params']:.0f}, stage 3 "
            f"{best[3]['peak_rss_bytes'] / best[3]['params']:.1f} (kept state alone: 96 and 12).",
        ]
    lines += [
        "",
        "Every attempt:",
        "",
        "| stage | depth | parameters | peak RSS | result | wall |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        result = (
            "trained"
            if r["trained"]
            else (
                f"killed at {r['killed_at_rss_bytes'] / GIB:.2f} GiB"
                if r["killed_at_rss_bytes"]
                else r.get("error", "failed")
            )
        )
        lines.append(
            f"| {r['stage']} | {r['layers']} | {r['params'] / 1e6:,.1f}M | {r['peak_rss_bytes'] / GIB:.2f} GiB | "
            f"{result} | {r['wall_s']:.0f} s |"
        )
    lines += ["", "The commands of the largest runs:", ""]
    for r in best.values():
        if r:
            lines += ["```", r["command"], "```"]
    lines += ["", f"![peak RSS against parameters]({_name(a)}.png)", ""]
    with open(os.path.join(RESULTS, f"{_name(a)}.md"), "w") as f:
        f.write("\n".join(lines))
    _plot(rows, budget, a)


_TITLE = {"gpt": "GPT", "user": "user-written NNX model (unscanned list of blocks)"}


def _name(a) -> str:
    return f"headline-{a.model}-{a.engine}"


def _plot(rows: list[dict], budget: int, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, color in ((0, "tab:red"), (3, "tab:blue")):
        ok = sorted((r for r in rows if r["stage"] == s and r["trained"]), key=lambda r: r["params"])
        bad = [r for r in rows if r["stage"] == s and not r["trained"]]
        ax.plot(
            [r["params"] / 1e6 for r in ok],
            [r["peak_rss_bytes"] / GIB for r in ok],
            "o-",
            color=color,
            label=f"stage {s}: trained",
        )
        ax.plot(
            [r["params"] / 1e6 for r in bad],
            [r["peak_rss_bytes"] / GIB for r in bad],
            "x",
            color=color,
            markersize=10,
            label=f"stage {s}: killed at the budget",
        )
    ax.axhline(budget / GIB, color="black", linestyle="--", label="budget")
    ax.set_xlabel("parameters (millions)")
    ax.set_xlim(left=0)
    ax.set_ylabel("peak resident memory of the process (GiB)")
    ax.set_title(f"8 simulated devices, engine {a.engine}: the largest {a.model} model each stage trains")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{_name(a)}.png"), dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, default=18.0, help="peak resident memory allowed (default 18)")
    p.add_argument("--model", choices=("gpt", "user"), default="gpt")
    p.add_argument("--engine", default="gspmd")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=2816)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--stages", default="0,3")
    p.add_argument("--from-json", action="store_true", help="only re-render the results' .md from their JSON")
    a = p.parse_args()
    if a.from_json:
        with open(os.path.join(RESULTS, f"{_name(a)}.json")) as f:
            saved = json.load(f)
        write(saved["attempts"], argparse.Namespace(**saved["args"]), saved["budget_bytes"], saved["started"])
        return 0
    # Never plan past what is free now, leaving 3 GiB for everything else on the machine.
    budget = int(min(a.budget_gib * GIB, _mem_available() - 3 * GIB))
    started = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"budget {budget / GIB:.2f} GiB", flush=True)
    rows = []
    for stage in (int(s) for s in a.stages.split(",")):
        rows += search(stage, a, budget, (2, 4) if stage == 0 else (4, 16))
        write(rows, a, budget, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
