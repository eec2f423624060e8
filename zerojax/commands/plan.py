"""`zerojax plan`: per-device memory, traffic and step time of ZeRO stages 0-3, and which to use.

Pure arithmetic (`zerojax.accounting.analytic`): no JAX import, so it answers instantly.
"""

from __future__ import annotations

import argparse
import json
import re

from zerojax.errors import UserError

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7e9', '7000000000', '7B', '125M', '1.5t' -> a positive parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m or float(m.group(1)) * _SUFFIX[m.group(2)] <= 0:
        raise UserError(f"--params must be a positive number such as 7e9 or 125M, got {text!r}.")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="memory, traffic and time per device for ZeRO stages 0-3, and which to use"
    )
    # CONFIG HOOK: planning from a YAML config (model shape, mesh, precision) is wired in later;
    # until then the positional is accepted and --params is required.
    p.add_argument("config", nargs="?", help="experiment YAML (not yet supported: pass --params)")
    p.add_argument("--params", help="parameter count, e.g. 7e9 or 125M")
    p.add_argument("--devices", type=int, help="devices along the data-parallel (fsdp) axis")
    p.add_argument("--hardware", default="h100", help="a100, h100, h200, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device per step (default 1)")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd_momentum, sgd, adafactor")
    p.add_argument("--precision", default="bf16", help="bf16 (fp32 master) or fp32")
    p.add_argument("--mfu", type=float, default=1.0, help="assumed fraction of peak FLOP/s (default 1.0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from zerojax.accounting import analytic
    from zerojax.accounting.hardware import get_hardware

    if args.params is None:
        if args.config is not None:
            raise UserError(
                f"planning from a config ({args.config}) is not supported yet; pass --params and --devices."
            )
        raise UserError("--params is required, e.g. `zerojax plan --params 7e9 --devices 8`.")
    if args.devices is None:
        raise UserError("--devices is required: how many devices share the model state.")
    if args.devices < 1:
        raise UserError(f"--devices must be a positive integer, got {args.devices}.")
    result = analytic.plan(
        parse_count(args.params),
        args.devices,
        get_hardware(args.hardware),
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        precision=analytic.get_precision_bytes(args.precision),
        optimizer=analytic.get_optimizer(args.optimizer),
        mfu=args.mfu,
    )
    if args.json:
        print(json.dumps(analytic.plan_dict(result), indent=2))
    else:
        _print_table(result)
    return 0


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _time(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


def _print_table(p) -> None:
    from rich.console import Console
    from rich.table import Table

    hw = p.hardware
    console = Console(width=None if Console().is_terminal else 120)
    table = Table(
        title=(
            f"ZeRO plan: {p.params / 1e9:g}B params on {p.devices} x {hw.name} "
            f"({hw.hbm_bytes / 1e9:.0f} GB, {hw.peak_flops / 1e12:.0f} TFLOP/s, "
            f"{hw.link_bytes_per_s / 1e9:.0f} GB/s per direction), {p.precision.name} + {p.optimizer.name}"
        ),
        caption=(
            f"GB = 1e9 bytes per device; traffic per step; {p.micro_batch} x {p.seq_len} tokens per "
            f"device per step at {p.mfu:g} x peak. Activations not included."
        ),
    )
    for col in ("stage", "params", "master", "optim", "grads", "state GB", "gather GB",
                "reduce GB", "compute", "comm", "fits", "bound"):
        table.add_column(col, justify="left" if col in ("fits", "bound") else "right")
    for r in p.stages:
        m = r.memory
        table.add_row(
            str(r.stage), _gb(m["compute_params"]), _gb(m["master"]), _gb(m["optimizer"]),
            _gb(m["grads"]), _gb(m["total"]), _gb(r.traffic["param_allgather"]),
            _gb(r.traffic["grad_reduce"]), _time(r.time.compute_s), _time(r.time.comm_s),
            "yes" if r.fits else "[red]no[/red]", r.time.bound,
        )
    console.print(table)
    rec = p.recommendation
    if rec.stage is None:
        console.print(f"[bold red]Recommendation:[/bold red] {rec.reason}.")
        return
    console.print(
        f"[bold]Recommendation:[/bold] {rec.reason}. Communication stops dominating at "
        f"{rec.comm_bound_below_tokens:,.0f} tokens per device per step "
        f"(micro-batch >= {rec.min_micro_batch} at seq {p.seq_len})."
    )
