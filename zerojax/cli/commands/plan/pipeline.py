"""`zerojax plan`'s pipeline x tensor x fsdp section: the best option at each pipeline size, the pick
that fits, its bubble, and why (`zerojax.accounting.pipeline_plan`)."""

from __future__ import annotations

# the inputs that the pick is held against
CONFIG_KEYS = ("pipeline", "microbatches", "pipeline_repeats", "pipeline_gather", "stage")


def _describe(o, **extra) -> dict | None:
    if o is None:
        return None
    terms = ("state_bytes", "whole_bytes", "activation_bytes", "compute_s", "fsdp_s", "sends_s", "tensor_s")
    return {
        **vars(o.split),
        "bubble": o.split.bubble,
        "schedule": _schedule(o.split),
        **{k: getattr(o, k) for k in (*terms, "latency_s", "memory_bytes", "step_s", "bound")},
        **extra,
    }


def _schedule(s) -> str:
    """How a split runs its pipeline, in words: GPipe or the circular schedule, and its gathers."""
    if s.pipeline == 1:
        return "-"
    how = "GPipe" if s.repeats == 1 else f"circular x{s.repeats}"
    return how + (", per-microbatch gathers" if s.gather == "per_microbatch" else "")


def _settings(s) -> str:
    """The config keys that choose a split's schedule, where they differ from the defaults, then its
    ZeRO stage."""
    out = f", mesh.pipeline_repeats={s.repeats}" if s.repeats > 1 else ""
    out += f", zero.pipeline_gather={s.gather}" if s.gather != "per_step" else ""
    return out + f", zero.stage={s.stage}"


def _stage_remat(o: dict) -> str:
    """The ZeRO stage, and the remat where it is a choice (a pipeline recomputes every layer)."""
    return f"{o['stage']}, {o['remat']}" if o["pipeline"] == 1 else str(o["stage"])


def _why(pick, flat, least, budget: float) -> str:
    """One sentence on the pick against the best option on the other side of `pipeline > 1`."""
    from zerojax.cli.commands.plan.tables import duration, gb

    if pick is None:
        return f"Nothing fits in {gb(budget)} GB a device: the least needs {gb(least.memory_bytes)} GB."
    s = pick.split
    said = (
        f"mesh.pipeline={s.pipeline} x tensor={s.tensor} x fsdp={s.fsdp}, train.grad_accum={s.grad_accum}, "
        f"train.microbatches={s.microbatches}{_settings(s)}: bubble {s.bubble:.0%}, step {duration(pick.step_s)}, "
        f"bound by {pick.bound}, {gb(pick.memory_bytes)} GB a device."
    )
    if s.pipeline == 1:
        said = (
            f"No pipeline: every pipelined option is slower or does not fit. Without one: tensor={s.tensor} x "
            f"fsdp={s.fsdp} at zero.stage={s.stage}, model.remat={s.remat}, train.grad_accum={s.grad_accum}: step "
            f"{duration(pick.step_s)}, bound by {pick.bound}."
        )
        return said + " The recommendation above, which weighs offload too, picks the stage, accumulation and remat."
    if flat is None:
        return f"Pipeline: {said} Without a pipeline nothing fits: the least needs {gb(least.memory_bytes)} GB."
    f = flat.split
    because = (
        ": stage 3 gathers every weight twice per accumulation step, a pipeline stage its own share once."
        if f.stage == 3 and flat.bound == "fsdp traffic"
        else "."
    )
    return (
        f"Pipeline: {said} Without one the best (tensor={f.tensor} x fsdp={f.fsdp}, train.grad_accum={f.grad_accum}, "
        f"zero.stage={f.stage}, model.remat={f.remat}) takes {duration(flat.step_s)}, bound by {flat.bound}{because}"
    )


def section(inputs: dict, hardware, efficiency: float, headroom: float) -> dict | None:
    """The section for a GPT-shaped plan (None without a model shape or any option)."""
    from zerojax.accounting import pipeline_plan

    shape = inputs["shape"]
    if shape is None:
        return None
    params = inputs["params"]
    trains = 1.0 if inputs.get("trainable") is None else inputs["trainable"] / params
    devices = inputs["devices"] * inputs["replicas"]
    batch = (inputs["global_rows"], inputs["seq_len"])
    pod = pipeline_plan.Pod(params, devices, hardware, shape, *batch, efficiency, trains)
    opts = pipeline_plan.options(pod)
    if not opts:
        return None
    budget = hardware.hbm_bytes * (1 - headroom)
    pick, flat = pipeline_plan.best(opts, budget), pipeline_plan.best(opts, budget, pipelined=False)
    least = min(opts, key=lambda o: o.memory_bytes)
    by_size = {}
    for size in sorted({o.split.pipeline for o in opts}):
        sized = [o for o in opts if o.split.pipeline == size]
        by_size[size] = pipeline_plan.best(sized, budget) or min(sized, key=lambda o: o.memory_bytes)
    return {
        "devices": devices,
        "global_rows": inputs["global_rows"],
        "seq_len": inputs["seq_len"],
        "budget_bytes": budget,
        "efficiency": efficiency,
        "per_pipeline_size": [_describe(o, fits=o.memory_bytes <= budget) for o in by_size.values()],
        "pick": _describe(pick),
        "best_without_pipeline": _describe(flat),
        "why": _why(pick, flat, least, budget),
        "config": {k: inputs.get(k) for k in CONFIG_KEYS},
    }


def print_section(s: dict) -> None:
    from rich.table import Table

    from zerojax.cli.commands.plan.tables import console, duration, gb

    table = Table(
        title=f"Pipeline x tensor x fsdp, ZeRO stage and remat: {s['devices']} devices, "
        f"{s['global_rows']:,} sequences of {s['seq_len']:,} tokens a step, compute at {s['efficiency']:.0%} of peak; "
        "the best at each pipeline size",
        caption="step = max(compute incl. bubble, fsdp traffic, stage sends, tensor traffic) + latency; "
        f"memory against {gb(s['budget_bytes'])} GB",
    )
    columns: tuple[str, ...] = ("pipeline x tensor x fsdp", "ZeRO", "accum", "microbatches", "schedule", "bubble")
    columns += ("memory (GB)", "compute")
    for col in (*columns, "fsdp traffic", "stage sends", "tensor traffic", "step"):
        table.add_column(col, justify="left" if col == columns[0] else "right")
    for o in s["per_pipeline_size"]:
        times = (o["compute_s"], o["fsdp_s"], o["sends_s"], o["tensor_s"], o["step_s"])
        memory = gb(o["memory_bytes"]) + ("" if o["fits"] else " (over)")
        split = f"{o['pipeline']} x {o['tensor']} x {o['fsdp']}"
        micro = str(o["microbatches"]) if o["pipeline"] > 1 else "-"
        row = (split, _stage_remat(o), str(o["grad_accum"]), micro, o["schedule"], f"{o['bubble']:.0%}", memory)
        table.add_row(*row, *map(duration, times))
    out = console()
    out.print(table)
    out.print(s["why"])
    config, pick = s["config"], s["pick"]
    if pick is None:
        return
    keys = (("mesh.pipeline", "pipeline"), ("zero.stage", "stage"))[: 1 + (pick["pipeline"] > 1)]
    differ = [f"{name}={config[key]}" for name, key in keys if config[key] is not None and config[key] != pick[key]]
    if differ:
        out.print(f"[yellow]The config has {', '.join(differ)}.[/yellow]")
