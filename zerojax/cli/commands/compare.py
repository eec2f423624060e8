"""`zerojax compare CONFIG [--stages 0,1,2,3] [--engines gspmd,shard_map] [--devices N] [--steps K]
[--set KEY=VALUE]... [--json PATH]`: train every stage x engine K steps from the same init and data,
and print one table of what each really keeps, peaks at and moves, beside the analytic figures."""

from __future__ import annotations

import argparse
import importlib.util
import json

from zerojax.cli.commands import add_devices, add_overrides
from zerojax.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="train each ZeRO stage and engine a few steps; measured vs analytic bytes")
    p.add_argument("config", help="YAML experiment config, e.g. configs/tiny.yaml")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (default 0,1,2,3)")
    p.add_argument("--engines", default="gspmd", help="comma-separated engines: gspmd, shard_map (default gspmd)")
    add_devices(p)
    p.add_argument("--steps", type=int, default=3, help="train steps per combination (default 3)")
    add_overrides(p, "override a config key for every combination (repeatable)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the rows as JSON to PATH")
    p.set_defaults(run=run)


def parse_list(flag: str, text: str, valid: tuple) -> list:
    """'0,3' -> [0, 3] against `valid`; one clear sentence otherwise."""
    items = [t.strip() for t in text.split(",")]
    kind = type(valid[0])
    out = []
    for item in items:
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value not in valid:
            raise UserError(f"{flag} takes a comma-separated list of {', '.join(map(str, valid))}; got {text!r}.")
        if value not in out:
            out.append(value)
    return out


def engine_available(engine: str) -> bool:
    return importlib.util.find_spec(f"zerojax.engines.{engine}") is not None


def run(args: argparse.Namespace) -> int:
    from zerojax.accounting.compare import add_loss_differences
    from zerojax.cli.commands.compare_run import run_row
    from zerojax.cli.config import load_config
    from zerojax.core.mesh import simulate_cpu_devices
    from zerojax.core.stages import STAGE_INDICES
    from zerojax.engines import ENGINES
    from zerojax.train.progress import compiling

    # Every bad argument fails here, before JAX starts.
    stages = parse_list("--stages", args.stages, STAGE_INDICES)
    engines = parse_list("--engines", args.engines, ENGINES)
    missing = [e for e in engines if not engine_available(e)]
    if missing:
        raise UserError(f"engine {missing[0]!r} is not available in this installation; use --engines gspmd.")
    if args.steps < 1:
        raise UserError(f"--steps must be a positive integer, got {args.steps}.")
    for stage in stages:
        for engine in engines:
            load_config(args.config, _overrides(args, stage, engine))
    if args.devices is not None:
        simulate_cpu_devices(args.devices)

    rows, params, devices = [], None, None
    for engine in engines:
        for stage in stages:
            with compiling(f"stage {stage} ({engine}) and running {args.steps} steps"):
                row, params, devices = run_row(load_config(args.config, _overrides(args, stage, engine)), args.steps)
            rows.append(row)
    add_loss_differences(rows)
    result = {
        "config": args.config,
        "overrides": list(args.overrides),
        "steps": args.steps,
        "params": params,
        "devices": devices,
        "rows": rows,
    }
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _overrides(args, stage: int, engine: str) -> list[str]:
    return [*args.overrides, f"zero.stage={stage}", f"zero.engine={engine}", f"train.steps={args.steps}"]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _by_axis(by_axis: dict, b) -> str:
    """'fsdp 1.2 MB, data 300 kB': the collective bytes by the mesh axes their groups span."""
    return ", ".join(f"{axes} {b(v)}" for axes, v in sorted(by_axis.items(), key=lambda kv: -kv[1])) or "-"


CAPTION = (
    "Per device. kept: what zerojax keeps between steps (analytic; no gradients, no stage-3 compute "
    "copy), beside the live arrays' shards in device memory (persistent) and host memory (host: "
    "zero.offload); ratio: both against kept. peak: memory_analysis() arguments + outputs - aliased + "
    "temporaries; est.: kept + activations + gradients + one fp32 update buffer (a rough sum). collective: "
    "bytes sent per step, counted on the HLO after SPMD partitioning; ideal: "
    "ring collectives, 2 x params x bytes x (p-1)/p at stages 0-2, 3 x at stage 3; by axis: the mesh "
    "axes each collective's replica groups span. (XLA:CPU's final "
    "HLO upcasts bf16 reductions to f32, doubling them: not counted.)"
)
COLUMNS = (
    "stage",
    "engine",
    "persistent",
    "host",
    "kept (ideal)",
    "ratio",
    "peak",
    "peak est.",
    "ratio",
    "collective/step",
    "ideal",
    "ratio",
    "by axis",
    "step",
    "final loss",
    "vs stage 0",
)


def table_cells(r: dict, b) -> list[str]:
    """One row of the table, bytes written by `b`."""
    diff = r["final_loss_diff_vs_stage0"]
    return [
        str(r["stage"]),
        r["engine"],
        b(r["persistent_bytes_per_device"]),
        b(r.get("host_persistent_bytes_per_device", 0)),
        b(r["ideal_persistent_bytes_per_device"]),
        _ratio(r["persistent_ratio"]),
        b(r["peak_bytes_per_device"]),
        b(r["ideal_peak_bytes_per_device"]),
        _ratio(r["peak_ratio"]),
        b(r["collective_bytes_per_device_per_step"]),
        b(r["ideal_collective_bytes_per_device_per_step"]),
        _ratio(r["collective_ratio"]),
        _by_axis(r.get("collective_bytes_by_axis") or {}, b),
        f"{r['step_time_s'] * 1e3:,.1f} ms",
        f"{r['final_loss']:.4f}",
        "-" if diff is None else f"{diff:+.2e}",
    ]


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from zerojax.accounting.measure import human_bytes

    rows = result["rows"]
    precision = rows[0]["precision"] if rows else "-"
    table = Table(
        title=f"zerojax compare: {result['params']:,} params, {result['devices']} devices, {precision}, "
        f"{result['steps']} steps each",
        caption=CAPTION,
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "engine" else "right")
    for r in rows:
        table.add_row(*table_cells(r, human_bytes))
    console = Console(width=None if Console().is_terminal else 240)  # a file or pipe: never wrap headers
    console.print(table)
