"""`zerojax plan`: per-device memory, traffic and step time of ZeRO stages 0-3, and which to use.

`--params N --devices P` is pure arithmetic (`zerojax.accounting.analytic`, no JAX import). `plan
CONFIG` counts the config's model parameters with `jax.eval_shape` (nothing is allocated, so a 70B
config plans in seconds) and takes the shape, sequence length, per-device micro-batch, precision and
optimizer from the config; flags given explicitly override it.

Below the stage table, every combination of stage x `train.grad_accum` x `zero.offload` x `model.remat`
is ranked against the device budget (`--memory`, default the hardware's, less `--headroom`), with
device and host bytes apart, and the best one's `--set` overrides are printed
(`zerojax.accounting.picks`; docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import math
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
    from zerojax.accounting.hardware import HARDWARE
    from zerojax.optim import OPTIMIZERS
    from zerojax.precision import DTYPES

    p = subparsers.add_parser("plan", help="memory, traffic and time per device for ZeRO stages 0-3, and which to use")
    p.add_argument("config", nargs="?", help="experiment YAML: plan its model (or pass --params instead)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of CONFIG, e.g. --set model.preset=7b (repeatable)",
    )
    p.add_argument("--params", help="parameter count, e.g. 7e9 or 125M")
    p.add_argument(
        "--devices",
        type=int,
        help="devices in all; the state is sharded over those not on mesh.data (default: "
        "CONFIG's mesh.data x mesh.fsdp)",
    )
    p.add_argument("--hardware", default="h100", help=", ".join(HARDWARE))
    p.add_argument("--seq", type=int, help="sequence length (default: CONFIG's model.seq_len, else 2048)")
    p.add_argument(
        "--micro-batch",
        type=int,
        help="sequences per device per micro-batch (default: CONFIG's train.batch_size / devices / "
        "train.grad_accum, else 1)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        help="micro-batches per step (default: CONFIG's train.grad_accum, else 1); stage 3 "
        "gathers and reduces once per micro-batch",
    )
    p.add_argument("--optimizer", help=f"{', '.join(OPTIMIZERS)} (default: CONFIG's, else adamw)")
    p.add_argument(
        "--precision", help=f"{' or '.join(DTYPES)}, bf16 with an fp32 master (default: CONFIG's, else bf16)"
    )
    p.add_argument("--mfu", type=float, default=1.0, help="assumed fraction of peak FLOP/s (default 1.0)")
    p.add_argument(
        "--memory",
        help="device memory budget per device, e.g. 80GB, 24GiB or 8e9 bytes (default: "
        "--hardware's); combinations are ranked against it",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of the device memory left free for the estimate's error and the allocator "
        "(default 0.1): combinations must fit in (1 - headroom) x memory",
    )
    p.add_argument(
        "--host-memory",
        help="host memory per device for offloaded state and activations, e.g. 250GB "
        "(default: unbounded, only reported)",
    )
    p.add_argument("--top", type=int, default=8, help="combinations to print, best first (default 8)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from zerojax.accounting import picks as picks_lib
    from zerojax.accounting import planning
    from zerojax.accounting.hardware import get_hardware
    from zerojax.optim import get_optimizer
    from zerojax.precision import get_precision

    _check_args(args)
    hardware = get_hardware(args.hardware)
    if args.memory is not None:
        hardware = dataclasses.replace(hardware, hbm_bytes=picks_lib.parse_bytes(args.memory))
    host_memory = math.inf if args.host_memory is None else picks_lib.parse_bytes(args.host_memory, "--host-memory")
    if args.config is not None:
        inputs = _from_config(args)
    else:
        if args.params is None:
            raise UserError("--params is required, e.g. `zerojax plan --params 7e9 --devices 8`, or give a CONFIG.")
        if args.devices is None:
            raise UserError("--devices is required: how many devices share the model state.")
        inputs = {
            "params": parse_count(args.params),
            "devices": args.devices,
            "seq_len": args.seq or 2048,
            "micro_batch": args.micro_batch or 1,
            "precision": args.precision or "bf16",
            "optimizer": args.optimizer or "adamw",
            "shape": None,
            "remat": "full",
            "replicas": 1,
            "grad_accum": args.grad_accum or 1,
            "reshard_after_forward": True,
            "zeropp": None,
        }
        inputs["rows_per_device"] = inputs["micro_batch"] * inputs["grad_accum"]
    result = planning.plan(
        inputs["params"],
        inputs["devices"],
        hardware,
        seq_len=inputs["seq_len"],
        micro_batch=inputs["micro_batch"],
        precision=get_precision(inputs["precision"]),
        optimizer=get_optimizer(inputs["optimizer"], "--optimizer" if args.optimizer else "optimizer.name"),
        shape=inputs["shape"],
        remat=inputs["remat"],
        mfu=args.mfu,
        grad_accum=inputs["grad_accum"],
        reshard_after_forward=inputs["reshard_after_forward"],
    )
    ranked = picks_lib.rank(
        result.params,
        result.devices,
        hardware,
        rows_per_device=inputs["rows_per_device"],
        seq_len=result.seq_len,
        precision=result.precision,
        optimizer=result.optimizer,
        shape=result.shape,
        mfu=args.mfu,
        reshard_after_forward=result.reshard_after_forward,
        memory=hardware.hbm_bytes * (1 - args.headroom),
        host_memory=host_memory,
    )
    by_axis = _by_axis(result, inputs)
    if args.json:
        out = _json_out(args, result, ranked, inputs, hardware, host_memory)
        out["stage_3_traffic_by_axis"] = by_axis
        print(json.dumps(out, indent=2))
    else:
        _print_table(result, args.config, inputs["remat"], inputs["replicas"])
        if by_axis is not None:
            _print_by_axis(by_axis)
        _print_picks(ranked, args.top, hardware, inputs["rows_per_device"], result.seq_len, args.headroom)
    return 0


def _by_axis(result, inputs: dict) -> dict | None:
    """Stage 3's traffic by mesh axis (`accounting.zeropp`), plain and with the config's ZeRO++
    options; None on a one-axis mesh without them."""
    from zerojax.accounting import zeropp

    options = zeropp.ZeroPP(**inputs["zeropp"]) if inputs["zeropp"] else zeropp.ZeroPP()
    if inputs["replicas"] == 1 and not options.active:
        return None
    return zeropp.plan_section(
        result.params,
        inputs["replicas"],
        result.devices,
        result.precision,
        options,
        result.grad_accum,
        result.shape,
        result.reshard_after_forward,
        result.optimizer,
    )


def _print_by_axis(section: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    chosen = section["with_options"]
    options = ", ".join(f"{k}={v}" for k, v in (section["options"] or {}).items())
    table = Table(
        title=f"Stage 3 traffic by mesh axis (data={section['data']} x fsdp={section['fsdp']}), GB per "
        f"device per step" + (f"; with {options}" if options else ""),
        caption="The fsdp axis stays within a group (a node); what crosses data is the inter-node share. "
        "int8/fp8 moves 1 byte per value plus an fp32 scale per block (docs/zeropp.md).",
    )
    for col in ("collective", "axis", "plain stage 3", *(("with ZeRO++",) if chosen else ())):
        table.add_column(col, justify="left" if col in ("collective", "axis") else "right")
    keys = sorted({(k, a) for tree in (section["plain"], chosen or {}) for k, axes in tree.items() for a in axes})
    for kind, axis in keys:
        cells = [_gb(section["plain"].get(kind, {}).get(axis, 0.0))]
        if chosen:
            cells.append(_gb(chosen.get(kind, {}).get(axis, 0.0)))
        table.add_row(kind, axis, *cells)
    table.add_row("total", "", _gb(section["plain_total"]), *((_gb(section["with_options_total"]),) if chosen else ()))
    console = Console(width=None if Console().is_terminal else 140)
    console.print(table)
    memory = section.get("with_options_memory")
    if memory and memory["secondary_copy"]:
        console.print(
            f"hpZ memory per device: state kept {_gb(memory['kept'])} GB (plain stage 3 on this mesh: "
            f"{_gb(section['plain_memory']['kept'])} GB), plus the secondary copy, "
            f"{_gb(memory['secondary_copy'])} GB, inside the step."
        )


def _check_args(args: argparse.Namespace) -> None:
    if args.config is not None and args.params is not None:
        raise UserError("give either CONFIG or --params, not both.")
    if args.overrides and args.config is None:
        raise UserError("--set needs a CONFIG to override; pass CONFIG or plan with --params alone.")
    for key in ("devices", "seq", "micro_batch", "grad_accum"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise UserError(f"--{key.replace('_', '-')} must be a positive integer, got {value}.")
    if args.top < 1:
        raise UserError(f"--top must be a positive integer, got {args.top}.")
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom must be a fraction in [0, 1), got {args.headroom}.")


def _json_out(args, result, ranked, inputs: dict, hardware, host_memory: float) -> dict:
    from zerojax.accounting import planning

    out = planning.plan_dict(result)
    out["memory_bytes"] = hardware.hbm_bytes
    out["headroom"] = args.headroom
    out["host_memory_bytes"] = None if math.isinf(host_memory) else host_memory
    out["rows_per_device"] = inputs["rows_per_device"]
    out["picks"] = [p.as_dict() for p in ranked]
    best = ranked[0] if ranked and ranked[0].fits else None
    out["best"] = (
        None
        if best is None
        else {"overrides": best.overrides(), "set_args": " ".join(f"--set {o}" for o in best.overrides())}
    )
    if args.config is not None:
        out["config"] = {
            "path": args.config,
            "overrides": list(args.overrides),
            "remat": inputs["remat"],
            "replicas": inputs["replicas"],
            "model": vars(inputs["shape"]) if inputs["shape"] else None,
            "params_counted_with": "jax.eval_shape",
        }
    return out


def _from_config(args: argparse.Namespace) -> dict:
    """Plan inputs from a config: parameters counted on the abstract model, nothing allocated."""
    import os

    if not os.path.isfile(args.config):
        raise UserError(
            f"config file {args.config!r} does not exist; give an existing YAML config, "
            "or plan with --params N --devices P."
        )
    from zerojax.accounting.analytic import GPTShape
    from zerojax.accounting.params import gpt_params
    from zerojax.config import load_config
    from zerojax.experiment import model_config

    c = load_config(args.config, args.overrides)
    if c.model.target:
        counted = _target_inputs(c, args)
    else:
        gpt = model_config(c)
        counted = {
            "params": float(gpt_params(gpt)),
            "seq_len": args.seq or gpt.seq_len,
            "shape": GPTShape.of(gpt),
            "remat": gpt.remat,
        }
    replicas = c.mesh.data
    if args.devices is not None:
        if args.devices % replicas:
            raise UserError(f"--devices {args.devices} is not divisible by mesh.data = {replicas}.")
        fsdp = args.devices // replicas
    elif c.mesh.fsdp is not None:
        fsdp = c.mesh.fsdp
    else:
        raise UserError(f"--devices is required: {args.config} leaves mesh.fsdp to the device count.")
    dp = c.mesh.data * fsdp
    accum = args.grad_accum or c.train.grad_accum
    micro = args.micro_batch or max(1, c.train.batch_size // dp // accum)
    return {
        "rows_per_device": micro * accum if args.micro_batch else max(1, c.train.batch_size // dp),
        "params": counted["params"],
        "devices": fsdp,
        "seq_len": counted["seq_len"],
        "micro_batch": micro,
        "grad_accum": accum,
        "reshard_after_forward": c.zero.reshard_after_forward,
        "precision": args.precision or c.precision,
        "optimizer": args.optimizer or c.optimizer.name,
        "shape": counted["shape"],
        "remat": counted["remat"],
        "replicas": replicas,
        "zeropp": {
            "quantize_weights": c.zero.quantize_weights,
            "quantize_grads": c.zero.quantize_grads,
            "block": c.zero.quantize_block,
            "hierarchical": c.zero.hierarchical,
        },
    }


def _target_inputs(c, args) -> dict:
    """A model.target's parameters, counted with `jax.eval_shape` on one row of its data's step-0
    batch; the sequence length is that batch's second axis for token-id inputs (else 1)."""
    import jax
    import numpy as np

    from zerojax.accounting.params import count_params
    from zerojax.adapt import functional, param_shapes
    from zerojax.experiment import build_data, build_model
    from zerojax.sources import example_batch

    model, _, _ = build_model(c)
    train, _ = build_data(c, None)
    x = example_batch(train)["inputs"]
    inputs = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
    params = count_params(param_shapes(functional(model), jax.random.key(0), inputs))
    tokens = x.ndim >= 2 and np.issubdtype(x.dtype, np.integer)
    return {
        "params": float(params),
        "seq_len": args.seq or (int(x.shape[1]) if tokens else 1),
        "shape": None,
        "remat": "none",
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _unit(largest: float) -> tuple[str, float]:
    """The decimal unit that shows `largest` (and so a table's column of bytes) with digits to read."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0


def _count(n: float) -> str:
    """A parameter count for people: 7B, 20.7M, 5,000."""
    if n >= 1e9:
        return f"{n / 1e9:g}B"
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,.0f}"


def _time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:,.1f} us"
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


def _print_table(p, config: str | None = None, remat: str = "full", replicas: int = 1) -> None:
    from rich.console import Console
    from rich.table import Table

    from zerojax.accounting import analytic

    hw = p.hardware
    console = Console(width=None if Console().is_terminal else 140)
    source = f" ({config}: {p.shape.n_layers} layers, d_model {p.shape.d_model})" if config and p.shape else ""
    act = p.stages[0].activation_bytes
    kept = {
        r.stage: analytic.kept_state_bytes(p.params, p.devices, r.stage, p.precision, p.optimizer)["total"]
        for r in p.stages
    }
    unit, scale = _unit(
        max(max(r.memory["total"], r.traffic["param_allgather"], r.traffic["grad_reduce"]) for r in p.stages)
    )

    def size(x: float) -> str:
        return f"{x / scale:,.2f}"

    activations = (
        "Activations not included."
        if act is None
        else f"'fits' includes {size(act)} {unit} of activations (remat={remat}), not in the state columns."
    )
    table = Table(
        title=(
            f"ZeRO plan: {_count(p.params)} params{source} on {p.devices * replicas} x {hw.name}"
            f"{f' (state sharded over {p.devices}, {replicas} replicas)' if replicas > 1 else ''} "
            f"({hw.hbm_bytes / 1e9:.0f} GB, {hw.peak_flops / 1e12:.0f} TFLOP/s, "
            f"{hw.link_bytes_per_s / 1e9:.0f} GB/s per direction), {p.precision.name} + {p.optimizer.name}"
        ),
        caption=(
            f"{unit} = {scale:.0e}".replace("e+0", "e")
            + f" bytes per device. model state: the textbook ZeRO accounting (compute params, fp32 "
            f"master, optimizer, gradients); kept: what zerojax keeps between steps (no gradients; stage 3 "
            f"casts each fp32 shard when it gathers it, so no bf16 copy). Traffic per step; "
            f"{p.grad_accum} x {p.micro_batch} x {p.seq_len} tokens per device per step "
            f"(micro-batches x rows x seq; stage 3 gathers per micro-batch"
            f"{', once with reshard_after_forward=false' if not p.reshard_after_forward else ''}) at "
            f"{p.mfu:g} x peak. {activations}"
            + (
                " Traffic is within one group of the sharding devices; the replicas' gradient all-reduce is not "
                "included."
                if replicas > 1
                else ""
            )
        ),
    )
    for col in (
        "stage",
        "params",
        "master",
        "optim",
        "grads",
        f"model state {unit}",
        f"kept {unit}",
        f"gather {unit}",
        f"reduce {unit}",
        "compute",
        "comm",
        "fits",
        "bound",
    ):
        table.add_column(col, justify="left" if col in ("fits", "bound") else "right")
    for r in p.stages:
        m = r.memory
        table.add_row(
            str(r.stage),
            size(m["compute_params"]),
            size(m["master"]),
            size(m["optimizer"]),
            size(m["grads"]),
            size(m["total"]),
            size(kept[r.stage]),
            size(r.traffic["param_allgather"]),
            size(r.traffic["grad_reduce"]),
            _time(r.time.compute_s),
            _time(r.time.comm_s),
            "yes" if r.fits else "[red]no[/red]",
            r.time.bound,
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


def _print_picks(ranked, top: int, hw, rows: int, seq_len: int, headroom: float) -> None:
    """The best `top` combinations of stage x accumulation x offload x remat, and the best one's
    config overrides."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 140)
    fitting = sum(p.fits for p in ranked)
    unit, scale = _unit(max((max(p.device_peak_bytes, p.host_bytes) for p in ranked[:top]), default=0.0))
    table = Table(
        title=(
            f"Combinations: {fitting} of {len(ranked)} fit in {hw.hbm_bytes * (1 - headroom) / 1e9:,.2f} GB per "
            f"device ({hw.hbm_bytes / 1e9:,.2f} GB less {headroom:.0%} headroom) "
            f"({rows} x {seq_len} tokens per device per step); best {min(top, len(ranked))}"
        ),
        caption=(
            f"device {unit}: kept device state + the step's temporaries (activations of one micro-batch, "
            f"gradients, the update; offloaded state comes back for the update); host {unit}: offloaded state + "
            "offloaded activations. Step: max(compute incl. recompute, collectives, host link "
            f"{hw.host_bytes_per_s / 1e9:.0f} GB/s per direction), a lower bound."
        ),
    )
    for col in (
        "#",
        "stage",
        "accum x rows",
        "offload",
        "remat",
        f"device {unit}",
        f"host {unit}",
        "step",
        "bound",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("offload", "remat", "bound", "fits") else "right")
    for i, p in enumerate(ranked[:top], 1):
        table.add_row(
            str(i),
            str(p.stage),
            f"{p.grad_accum} x {p.micro_batch}",
            p.offload,
            p.remat,
            f"{p.device_peak_bytes / scale:,.2f}",
            f"{p.host_bytes / scale:,.2f}",
            _time(p.step_s),
            p.bound,
            "yes" if p.fits else "[red]no[/red]",
        )
    console.print(table)
    best = ranked[0] if ranked and ranked[0].fits else None
    if best is None:
        console.print(
            f"[bold red]No combination fits[/bold red] in {hw.hbm_bytes * (1 - headroom) / 1e9:,.2f} GB "
            "per device: shard over more devices (mesh.fsdp) or shorten the sequences."
        )
        return
    console.print("[bold]Best combination:[/bold] " + " ".join(f"--set {o}" for o in best.overrides()))
