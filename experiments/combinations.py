"""Every combination of ZeRO stage x gradient accumulation x host offload x remat policy on the shipped
20M GPT, 8 simulated CPU devices (mesh fsdp=8), fp32 + AdamW: the compiled train step's per-device
bytes per parameter and collective bytes per step, beside the planner's predicted device peak.

Each combination is lowered and compiled, never run. Per device, from the compiled program:
device-space arguments (`compiled_argument_bytes`: an argument in memory space S(5) is host), the
temporaries and the device peak (`Measurement.peak_bytes`, arguments + outputs - aliased + temporaries,
less the host-space arguments, whose outputs alias them); the state's device and host bytes from its
shardings' memory kinds; collectives by kind on the HLO right after SPMD partitioning
(`measure.measure_step`). The prediction is `picks.evaluate`, what `zerojax plan --memory` ranks.

    python -m experiments.combinations       # -> results/combinations.{md,json,png}; about 7 min on 2 cores
"""

from __future__ import annotations

import os

from experiments.common import RESULTS, cpu_devices

cpu_devices(8)

import datetime
import functools
import itertools
import json
import time

import jax
import jax.numpy as jnp
import optax

import zerojax as zj
from zerojax.accounting import measure, picks
from zerojax.accounting.activations import GPTShape
from zerojax.accounting.hardware import get_hardware
from zerojax.core.optim import get_optimizer
from zerojax.core.precision import get_precision
from zerojax.errors import UserError
from zerojax.models.gpt import GPT, gpt_config

HERE = os.path.dirname(os.path.abspath(__file__))
P, ROWS, PRESET, PRECISION = 8, 32, "20m", "fp32"  # 32 sequences: 4 per device per step
STAGES, ACCUMS, OFFLOADS, REMATS = (0, 1, 2, 3), (1, 4), ("none", "optimizer"), ("none", "dots", "full")
SKIP = set()  # (grad_accum, remat) pairs left out when the full grid is too slow to compile
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def predicted_peak(cfg, params: int, stage: int, k: int, offload: str, remat: str) -> float:
    """The planner's device peak for this combination (`picks.evaluate`; the hardware only sets time)."""
    pick = picks.evaluate(
        params,
        P,
        get_hardware("h100"),
        stage=stage,
        grad_accum=k,
        micro_batch=ROWS // P // k,
        offload=offload,
        remat=remat,
        seq_len=cfg.seq_len,
        precision=get_precision(PRECISION),
        optimizer=get_optimizer("adamw"),
        shape=GPTShape.of(cfg),
    )
    return pick.device_peak_bytes


def measure_one(stage: int, k: int, offload: str, remat: str) -> dict:
    """One combination compiled (not run): its per-device bytes and collectives, or the refusal."""
    row = {"stage": stage, "grad_accum": k, "offload": offload, "remat": remat}
    cfg = gpt_config(PRESET, remat=remat)
    batch = {n: jax.ShapeDtypeStruct((ROWS, cfg.seq_len), jnp.int32) for n in ("inputs", "targets")}
    t = time.perf_counter()
    try:
        trainer = zj.Trainer(
            functools.partial(GPT, cfg),
            optax.adamw(1e-3),
            mesh=zj.make_mesh(fsdp=P),
            stage=stage,
            precision=PRECISION,
            grad_accum=k,
            offload=offload,
        )
        state = trainer.init(jax.random.key(0), batch)
    except UserError as e:
        return {**row, "refused": str(e)}
    m, _ = measure.measure_step(trainer, state, batch, optimizer="adamw", shape=GPTShape.of(cfg), remat=remat)
    del state
    params = measure.param_count(trainer)
    device_peak = m.peak_bytes - m.host_argument_bytes
    predicted = predicted_peak(cfg, params, stage, k, offload, remat)
    row.update(
        params=params,
        compile_s=time.perf_counter() - t,
        state_device_bytes=m.persistent_bytes,
        state_host_bytes=m.host_persistent_bytes,
        argument_device_bytes=m.argument_bytes - m.host_argument_bytes,
        argument_host_bytes=m.host_argument_bytes,
        output_bytes=m.output_bytes,
        alias_bytes=m.alias_bytes,
        temp_bytes=m.temp_bytes,
        device_peak_bytes=device_peak,
        predicted_device_peak_bytes=predicted,
        measured_over_predicted=device_peak / predicted,
        collective_bytes=m.collective_bytes,
        collective_bytes_by_kind=dict(m.collective_by_kind),
        collective_counts=dict(m.collective_counts),
    )
    for key in (
        "state_device_bytes",
        "state_host_bytes",
        "argument_device_bytes",
        "temp_bytes",
        "device_peak_bytes",
        "predicted_device_peak_bytes",
    ):
        row[key.replace("_bytes", "_per_param")] = row[key] / params
    return row


def accumulation_traffic(rows: list[dict]) -> list[dict]:
    """Per stage, offload and remat: collective bytes per step by kind at k = 4 over k = 1."""
    by = {(r["stage"], r["offload"], r["remat"], r["grad_accum"]): r for r in rows if "refused" not in r}
    out = []
    for (stage, offload, remat, k), r4 in by.items():
        r1 = by.get((stage, offload, remat, 1))
        if k != 4 or r1 is None:
            continue
        kinds = {
            kind: (r1["collective_bytes_by_kind"].get(kind, 0.0), r4["collective_bytes_by_kind"].get(kind, 0.0))
            for kind in KINDS
        }
        out.append(
            {
                "stage": stage,
                "offload": offload,
                "remat": remat,
                "k1": r1["collective_bytes"],
                "k4": r4["collective_bytes"],
                "ratio": r4["collective_bytes"] / r1["collective_bytes"],
                "by_kind": {kind: {"k1": a, "k4": b, "ratio": b / a if a else None} for kind, (a, b) in kinds.items()},
            }
        )
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| stage | k | offload | remat | state device B/param | state host B/param | args device MiB | "
        "temp MiB | device peak MiB | peak B/param | predicted peak MiB | measured / predicted | "
        "all-gather MiB | reduce-scatter MiB | all-reduce MiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['stage']} | {r['grad_accum']} | {r['offload']} | {r['remat']} |"
        if "refused" in r:
            lines.append(head + f" refused: {r['refused']} |" + " - |" * 11)
            continue
        kinds = r["collective_bytes_by_kind"]
        lines.append(
            head + f" {r['state_device_per_param']:.2f} | {r['state_host_per_param']:.2f} | "
            f"{mib(r['argument_device_bytes'])} | {mib(r['temp_bytes'])} | {mib(r['device_peak_bytes'])} | "
            f"{r['device_peak_per_param']:.2f} | {mib(r['predicted_device_peak_bytes'])} | "
            f"{r['measured_over_predicted']:.3f} | "
            + " | ".join(mib(kinds.get(kind, 0.0)) for kind in KINDS)
            + f" | {r['compile_s']:.0f} |"
        )
    return lines


def accum_table(acc: list[dict]) -> list[str]:
    lines = [
        "| stage | offload | remat | k=1 MiB | k=4 MiB | k=4 / k=1 | all-gather ratio | reduce-scatter ratio | "
        "all-reduce ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for a in acc:
        lines.append(
            f"| {a['stage']} | {a['offload']} | {a['remat']} | {mib(a['k1'])} | {mib(a['k4'])} | "
            f"{a['ratio']:.2f} | " + " | ".join(ratio(a["by_kind"][kind]["ratio"]) for kind in KINDS) + " |"
        )
    return lines


def plot(rows: list[dict], acc: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(STAGES) + 1, figsize=(22, 5.5), gridspec_kw={"width_ratios": [3] * len(STAGES) + [2]}
    )
    ok = [r for r in rows if "refused" not in r]
    ymax = max(max(r["device_peak_per_param"], r["predicted_device_peak_per_param"]) for r in ok) * 1.1
    for ax, stage in zip(axes, STAGES):
        mine = [r for r in ok if r["stage"] == stage]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["state_device_per_param"] for r in mine], 0.4, label="state (device)")
        ax.bar(
            [x - 0.2 for x in xs],
            [r["temp_per_param"] for r in mine],
            0.4,
            bottom=[r["device_peak_per_param"] - r["temp_per_param"] for r in mine],
            label="temp (device)",
        )
        ax.bar(
            [x + 0.2 for x in xs], [r["state_host_per_param"] for r in mine], 0.4, color="grey", label="state (host)"
        )
        ax.scatter(
            [x - 0.2 for x in xs],
            [r["predicted_device_peak_per_param"] for r in mine],
            marker="_",
            s=250,
            color="black",
            zorder=3,
            label="planner's device peak",
        )
        ax.set_xticks(
            list(xs), [f"k{r['grad_accum']} {r['offload'][:3]} {r['remat']}" for r in mine], rotation=70, fontsize=7
        )
        ax.set_ylim(0, ymax)
        ax.set_title(f"stage {stage}")
        ax.set_ylabel("device / host bytes per parameter, per device")
    axes[0].legend(fontsize=7)
    base = [a for a in acc if a["offload"] == "none" and a["remat"] == "full"]
    xs = range(len(base))
    axes[-1].bar([x - 0.2 for x in xs], [a["k1"] / 2**20 for a in base], 0.4, label="k = 1")
    axes[-1].bar([x + 0.2 for x in xs], [a["k4"] / 2**20 for a in base], 0.4, label="k = 4")
    axes[-1].set_xticks(list(xs), [f"stage {a['stage']}" for a in base])
    axes[-1].set_ylabel("collective MiB per device per step")
    axes[-1].set_title("collectives per step, k = 1 vs 4\n(offload none, remat full)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(
        f"GPT {PRESET}, {P} simulated devices, {PRECISION} + AdamW, {ROWS} sequences per step: compiled, per device",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pick(rows: list[dict], **want) -> dict | None:
    return next((r for r in rows if "refused" not in r and all(r[k] == v for k, v in want.items())), None)


def reading(rows: list[dict], acc: list[dict]) -> list[str]:
    """The numbers the reading below the table quotes, all taken from `rows` and `acc`."""
    default = {s: pick(rows, stage=s, grad_accum=1, offload="none", remat="full") for s in STAGES}
    moved = {s: pick(rows, stage=s, grad_accum=1, offload="optimizer", remat="full") for s in STAGES}
    ratios = [r["measured_over_predicted"] for r in rows if "refused" not in r]
    worst = max((r for r in rows if "refused" not in r), key=lambda r: abs(r["measured_over_predicted"] - 1))
    base = {a["stage"]: a for a in acc if a["offload"] == "none" and a["remat"] == "full"}
    remat = {m: pick(rows, stage=3, grad_accum=1, offload="none", remat=m) for m in REMATS}
    remat4 = {m: pick(rows, stage=3, grad_accum=4, offload="none", remat=m) for m in REMATS}
    s3 = default[3]
    return [
        "Default combination (k = 1, offload none, remat full), device state / device peak in bytes per parameter: "
        + "; ".join(
            f"stage {s} {default[s]['state_device_per_param']:.2f} / {default[s]['device_peak_per_param']:.2f}"
            for s in STAGES
            if default[s]
        )
        + ".",
        f"Stage 3 keeps {s3['state_device_per_param']:.3f} B/param per device: fp32 + AdamW keeps 12 bytes per "
        f"parameter (the fp32 params are the master, so no 4-byte compute copy; 16 is the mixed-precision "
        f"textbook figure), and 12/p = {12 / P:.3f}.",
        "Offload `optimizer` moves off the device (state device B/param, none -> optimizer): "
        + "; ".join(
            f"stage {s} {default[s]['state_device_per_param']:.2f} -> {moved[s]['state_device_per_param']:.2f} "
            f"(host {moved[s]['state_host_per_param']:.2f}), peak {default[s]['device_peak_per_param']:.2f} -> "
            f"{moved[s]['device_peak_per_param']:.2f}"
            for s in STAGES
            if default[s] and moved[s]
        )
        + f". At stage 3 that is the whole 12/p = {12 / P:.2f}; at stages 0-2 the fp32 params are the master, so the "
        "replicated 4 bytes move with the Adam moments (12 at stage 0, 4 + 8/p from stage 1).",
        "Accumulation, k = 4 over k = 1, total collective bytes per step (offload none, remat full): "
        + "; ".join(f"stage {s} {base[s]['ratio']:.2f}" for s in STAGES if s in base)
        + ".",
        "Remat at stage 3, k = 1 (k = 4), device peak B/param: "
        + "; ".join(
            f"{m} {remat[m]['device_peak_per_param']:.2f} ({remat4[m]['device_peak_per_param']:.2f})"
            for m in REMATS
            if remat[m] and remat4[m]
        )
        + ".",
        f"Measured / predicted device peak: {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} combinations; "
        f"farthest: stage {worst['stage']}, k = {worst['grad_accum']}, offload {worst['offload']}, remat "
        f"{worst['remat']} ({worst['measured_over_predicted']:.3f}).",
    ]


def caveats(rows: list[dict]) -> list[str]:
    """Where the planner and the compiled CPU program part: offload's streamed copies, stage 3 without remat."""
    ok = [r for r in rows if "refused" not in r]
    by = {(r["stage"], r["grad_accum"], r["offload"], r["remat"]): r for r in ok}
    pairs = [(r, by.get((r["stage"], r["grad_accum"], "none", r["remat"]))) for r in ok if r["offload"] != "none"]
    same = sum(b is not None and r["temp_bytes"] == b["temp_bytes"] for r, b in pairs)
    plain = [r["measured_over_predicted"] for r in ok if r["offload"] == "none" and r["remat"] != "none"]
    worst = sorted(
        (r for r in ok if r["offload"] == "none" and r["remat"] == "full"), key=lambda r: -r["measured_over_predicted"]
    )[:2]
    gathers = {m: by[3, 1, "none", m]["collective_bytes_by_kind"].get("all-gather", 0.0) for m in ("none", "full")}
    excess = {
        k: (by[3, k, "none", "none"]["device_peak_bytes"] - by[3, k, "none", "none"]["predicted_device_peak_bytes"])
        / by[3, k, "none", "none"]["params"]
        for k in ACCUMS
    }
    unaliased = sorted({r["output_bytes"] - r["alias_bytes"] for r in ok})
    refused = [r for r in rows if "refused" in r]
    return [
        f"Offload's temporaries equal the device-resident run's in {same} of {len(pairs)} pairs: XLA:CPU does not "
        "count the copies of the host groups streamed into device memory among its temporaries, so the offload "
        "rows' device peak is the resident peak less the state, and the planner, which counts the offloaded state "
        "back on the device for the update, predicts more (the ratios below 1). Whether a GPU's compiled step "
        "shows that copy is not measured here.",
        f"Without offload and with remat dots or full, measured / predicted is {min(plain):.3f} to {max(plain):.3f} "
        f"({len(plain)} combinations); the largest: "
        + ", ".join(
            f"stage {r['stage']}, k = {r['grad_accum']}, {r['remat']} ({r['measured_over_predicted']:.3f}, temp "
            f"{r['temp_bytes'] / 2**20:,.1f} MiB against dots' "
            f"{by[r['stage'], r['grad_accum'], 'none', 'dots']['temp_bytes'] / 2**20:,.1f})"
            for r in worst
        )
        + ".",
        f"Stage 3 with remat none gathers the weights once, not twice (all-gather {gathers['none'] / 2**20:,.1f} vs "
        f"{gathers['full'] / 2**20:,.1f} MiB per step at k = 1): the backward reuses the forward's gathered weights, "
        "so the whole fp32 weights stay live through the step; the planner counts them (param_bytes per parameter), "
        "and the compiled peak is above its prediction by "
        + ", ".join(f"{excess[k]:.2f} B/param at k = {k}" for k in ACCUMS)
        + ".",
        f"Outputs less aliased bytes: {', '.join(f'{b:,}' for b in unaliased)} bytes in every combination (the step's "
        "metrics), so every host-space output aliases a host-space argument and subtracting the host arguments "
        "leaves the device peak.",
        "Refused by the library: "
        + (
            "none"
            if not refused
            else "; ".join(
                f"stage {r['stage']}, k = {r['grad_accum']}, offload {r['offload']}, remat {r['remat']}: {r['refused']}"
                for r in refused
            )
        )
        + ".",
    ]


def write(rows: list[dict], acc: list[dict], seconds: float) -> None:
    cfg = gpt_config(PRESET)
    params = next(r["params"] for r in rows if "refused" not in r)
    skipped = ", ".join(f"k = {k} with remat {m}" for k, m in sorted(SKIP)) or "none"
    md = [
        "# Stage x accumulation x offload x remat: device bytes per parameter and traffic, compiled",
        "",
        f"Made by `python -m experiments.combinations` on {datetime.date.today().isoformat()}, jax {jax.__version__}, "
        f"XLA:CPU with {P} simulated devices (mesh fsdp={P}, gspmd engine). The shipped GPT preset {PRESET} "
        f"({cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_heads} heads, seq {cfg.seq_len}; "
        f"{params:,} params), {PRECISION}, AdamW, {ROWS} sequences per step ({ROWS // P} per device; k micro-batches "
        f"of {ROWS // P}/k). Every combination is lowered and compiled, not run ({len(rows)} compiles, "
        f"{seconds / 60:.1f} min on {os.cpu_count()} cores). Skipped combinations: {skipped}.",
        "",
        "Per device. State: the train state's shards by memory kind (B/param = bytes / parameters). Args device: "
        "the compiled step's arguments outside memory space S(5). Device peak: arguments + outputs - aliased + "
        "temporaries (`memory_analysis()`) less the host-space arguments (the outputs that replace them alias "
        "them). Predicted: the planner's device peak for the same combination (`picks.evaluate`, what "
        "`zerojax plan --memory` ranks). Collectives: bytes each device sends per step, counted on the HLO "
        "after SPMD partitioning (loops count once per iteration). MiB = 2^20 bytes.",
        "",
        *table(rows),
        "",
        "## Accumulation's traffic per step by stage (k = 4 over k = 1)",
        "",
        *accum_table(acc),
        "",
        "## Reading",
        "",
        *[f"- {s}" for s in reading(rows, acc)],
        "",
        "## Where the planner and the compiled CPU program part",
        "",
        *[f"- {s}" for s in caveats(rows)],
        "",
        "![device bytes per parameter and traffic](combinations.png)",
        "",
    ]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "combinations.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(RESULTS, "combinations.json"), "w") as f:
        json.dump(
            {
                "date": datetime.date.today().isoformat(),
                "jax": jax.__version__,
                "devices": P,
                "rows": ROWS,
                "preset": PRESET,
                "precision": PRECISION,
                "seconds": seconds,
                "skipped": sorted(SKIP),
                "combinations": rows,
                "accumulation": acc,
            },
            f,
            indent=1,
        )
    plot(rows, acc, os.path.join(RESULTS, "combinations.png"))
    print("\n".join(md))


def main() -> None:
    t = time.perf_counter()
    rows = []
    for stage, k, offload, remat in itertools.product(STAGES, ACCUMS, OFFLOADS, REMATS):
        if (k, remat) in SKIP:
            continue
        rows.append(measure_one(stage, k, offload, remat))
        print(
            {
                key: rows[-1].get(key)
                for key in (
                    "stage",
                    "grad_accum",
                    "offload",
                    "remat",
                    "device_peak_per_param",
                    "measured_over_predicted",
                    "compile_s",
                    "refused",
                )
            },
            flush=True,
        )
    write(rows, accumulation_traffic(rows), time.perf_counter() - t)


if __name__ == "__main__":
    main()
