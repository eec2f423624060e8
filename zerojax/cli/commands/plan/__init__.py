"""`zerojax plan`: per-device memory, traffic and step time of ZeRO stages 0-3, and which to use.

`--params N --devices P` is pure arithmetic (`zerojax.accounting.analytic`, no JAX import). `plan
CONFIG` counts the config's model parameters with `jax.eval_shape` (nothing is allocated, so a 70B
config plans in seconds) and takes the shape, sequence length, per-device micro-batch, precision and
optimizer from the config; flags given explicitly override it.

Below the stage table, every combination of stage x `train.grad_accum` x `zero.offload` x `model.remat`
is ranked against the device budget (`--memory`, default the hardware's, less `--headroom`), with
device and host bytes apart, and the best one's `--set` overrides are printed
(`zerojax.accounting.picks`; docs/planner.md).

What is planned comes from `plan.inputs`; the tables are printed by `plan.tables` and the FSDP x
tensor section by `plan.tensor`, the pipeline x tensor x fsdp one by `plan.pipeline`.
"""

from __future__ import annotations

import argparse
import json
import math

from zerojax.cli.commands import add_overrides
from zerojax.cli.commands.plan import pipeline as plan_pipeline
from zerojax.cli.commands.plan import tensor as plan_tensor
from zerojax.cli.commands.plan.inputs import inputs_from_config, inputs_from_flags
from zerojax.errors import UserError


def add_model_arguments(p) -> None:
    """What is planned on what: a CONFIG (with overrides) or a parameter count, the devices, the hardware."""
    from zerojax.accounting.hardware import HARDWARE

    p.add_argument("config", nargs="?", help="experiment YAML: plan its model (or pass --params instead)")
    add_overrides(p, "override a key of CONFIG, e.g. --set model.preset=7b (repeatable)")
    p.add_argument("--params", help="parameter count, e.g. 7e9 or 125M")
    p.add_argument(
        "--devices",
        type=int,
        help="devices in all; the state is sharded over those not on mesh.data (default: "
        "CONFIG's mesh.data x mesh.fsdp)",
    )
    p.add_argument("--hardware", default="h100", help=", ".join(HARDWARE))


def add_step_arguments(p) -> None:
    """The step's sizes, precision, optimizer and assumed efficiency."""
    from zerojax.core.optim import OPTIMIZERS
    from zerojax.core.precision import DTYPES

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
    p.add_argument(
        "--trainable",
        type=float,
        help="fine-tuning: the fraction of the parameters that train, the rest frozen (default: "
        "CONFIG's model.lora adapters, else all)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        help="fine-tuning: LoRA adapters of this rank on all seven block weights of CONFIG's shipped GPT",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="assumed fraction of peak FLOP/s (default 0.45, the published MFU of FSDP runs; 1.0 gives lower bounds)",
    )


def add_budget_arguments(p) -> None:
    """The memory budgets the combinations are ranked against, and what to print."""
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


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory, traffic and time per device for ZeRO stages 0-3, and which to use")
    add_model_arguments(p)
    add_step_arguments(p)
    add_budget_arguments(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    hardware, host_memory = _budgets(args)
    inputs = inputs_from_config(args) if args.config is not None else inputs_from_flags(args)
    result = _plan(args, inputs, hardware)
    ranked = _rank(args, result, inputs, hardware, host_memory)
    by_axis = _by_axis(result, inputs)
    tensor = plan_tensor.section(inputs, hardware, _mfu(args))
    pipeline = plan_pipeline.section(inputs, hardware, _mfu(args), args.headroom)
    if args.json:
        out = _json_out(args, result, ranked, inputs, hardware, host_memory)
        out["stage_3_traffic_by_axis"] = by_axis
        out["tensor_parallel"] = tensor
        out["pipeline_parallel"] = pipeline
        out["recommendation"] = out["best"]  # the one recommendation: the best combination that fits
        print(json.dumps(out, indent=2))
        return 0
    from zerojax.cli.commands.plan.tables import print_by_axis, print_picks, print_stage_table

    print_stage_table(result, args.config, inputs["remat"], inputs["replicas"])
    if by_axis is not None:
        print_by_axis(by_axis)
    print_picks(ranked, args.top, hardware, inputs["rows_per_device"], result.seq_len, args.headroom)
    if tensor is not None:
        plan_tensor.print_section(tensor)
    if pipeline is not None:
        plan_pipeline.print_section(pipeline)
    return 0


def _mfu(args: argparse.Namespace) -> float:
    from zerojax.accounting.hardware import DEFAULT_MFU

    return DEFAULT_MFU if args.mfu is None else args.mfu


def _budgets(args: argparse.Namespace):
    """(the hardware with `--memory` as its device memory, the host memory per device)."""
    import dataclasses

    from zerojax.accounting.hardware import get_hardware
    from zerojax.accounting.picks import parse_bytes

    hardware = get_hardware(args.hardware)
    if args.memory is not None:
        hardware = dataclasses.replace(hardware, hbm_bytes=parse_bytes(args.memory))
    host_memory = math.inf if args.host_memory is None else parse_bytes(args.host_memory, "--host-memory")
    return hardware, host_memory


def _plan(args: argparse.Namespace, inputs: dict, hardware):
    """Every stage side by side (`accounting.planning.plan`)."""
    from zerojax.accounting import planning
    from zerojax.core.optim import get_optimizer
    from zerojax.core.precision import get_precision

    return planning.plan(
        inputs["params"],
        inputs["devices"],
        hardware,
        seq_len=inputs["seq_len"],
        micro_batch=inputs["micro_batch"],
        precision=get_precision(inputs["precision"]),
        optimizer=get_optimizer(inputs["optimizer"], "--optimizer" if args.optimizer else "optimizer.name"),
        shape=inputs["shape"],
        remat=inputs["remat"],
        mfu=_mfu(args),
        grad_accum=inputs["grad_accum"],
        reshard_after_forward=inputs["reshard_after_forward"],
        trainable=inputs["trainable"],
    )


def _rank(args: argparse.Namespace, result, inputs: dict, hardware, host_memory: float) -> list:
    """Every combination against the device budget less `--headroom` (`accounting.picks.rank`)."""
    from zerojax.accounting import picks

    return picks.rank(
        result.params,
        result.devices,
        hardware,
        rows_per_device=inputs["rows_per_device"],
        seq_len=result.seq_len,
        precision=result.precision,
        optimizer=result.optimizer,
        shape=result.shape,
        mfu=_mfu(args),
        reshard_after_forward=result.reshard_after_forward,
        memory=hardware.hbm_bytes * (1 - args.headroom),
        host_memory=host_memory,
        trainable=result.trainable,
    )


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
        result.trainable,
    )


def _check_args(args: argparse.Namespace) -> None:
    if args.config is not None and args.params is not None:
        raise UserError("give either CONFIG or --params, not both.")
    if args.overrides and args.config is None:
        raise UserError("--set needs a CONFIG to override; pass CONFIG or plan with --params alone.")
    if args.trainable is not None and not 0 < args.trainable <= 1:
        raise UserError(f"--trainable is the fraction of the parameters that train, in (0, 1]; got {args.trainable}.")
    if args.trainable is not None and args.lora_rank is not None:
        raise UserError("give either --trainable or --lora-rank, not both.")
    for key in ("devices", "seq", "micro_batch", "grad_accum", "lora_rank"):
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
