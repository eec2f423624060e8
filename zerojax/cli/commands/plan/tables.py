"""The tables `zerojax plan` prints: the stages side by side with the recommendation, stage 3's
traffic by mesh axis, and the best combinations of stage x accumulation x offload x remat."""

from __future__ import annotations

from zerojax.accounting import analytic


def console():
    """A rich console; in a file or pipe 140 columns wide, so the tables do not wrap."""
    from rich.console import Console

    return Console(width=None if Console().is_terminal else 140)


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def unit_for(largest: float) -> tuple[str, float]:
    """The decimal unit that shows `largest` (and so a table's column of bytes) with digits to read."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0


def param_count(n: float) -> str:
    """A parameter count for people: 7B, 20.7M, 5,000."""
    if n >= 1e9:
        return f"{n / 1e9:g}B"
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,.0f}"


def duration(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:,.1f} us"
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


# ---- the stages -----------------------------------------------------------------------------------


def stage_table_title(p, config: str | None, replicas: int) -> str:
    hw = p.hardware
    source = f" ({config}: {p.shape.n_layers} layers, d_model {p.shape.d_model})" if config and p.shape else ""
    tuning = "" if p.trainable is None else f" ({param_count(p.trainable)} trainable, the rest frozen)"
    return (
        f"ZeRO plan: {param_count(p.params)} params{tuning}{source} on {p.devices * replicas} x {hw.name}"
        f"{f' (state sharded over {p.devices}, {replicas} replicas)' if replicas > 1 else ''} "
        f"({hw.hbm_bytes / 1e9:.0f} GB, {hw.peak_flops / 1e12:.0f} TFLOP/s, "
        f"{_links(hw, p.devices)}), {p.precision.name} + {p.optimizer.name}"
    )


def _links(hw, devices: int) -> str:
    """The link rate the table's collectives run at; both rates where the group spans nodes."""
    from zerojax.accounting.hardware import group_links, node_links

    rate = f"{hw.link_bytes_per_s / 1e9:.0f} GB/s per direction"
    used = group_links(hw, devices)
    if used is hw:
        return rate
    return f"{rate} in a node of {node_links(hw, devices)[0]}, {used.link_bytes_per_s / 1e9:.0f} GB/s between nodes"


def stage_table_caption(p, unit: str, scale: float, remat: str, replicas: int) -> str:
    act = p.stages[0].activation_bytes
    activations = (
        "Activations not included."
        if act is None
        else f"'fits' includes {act / scale:,.2f} {unit} of activations (remat={remat}), not in the state columns."
    )
    return (
        f"{unit} = {scale:.0e}".replace("e+0", "e")
        + f" bytes per device. model state: the textbook ZeRO accounting (compute params, fp32 "
        f"master, optimizer, gradients); kept: what zerojax keeps between steps (no gradients; stage 3 "
        f"casts each fp32 shard when it gathers it, so no bf16 copy). Traffic per step; "
        f"{p.grad_accum} x {p.micro_batch} x {p.seq_len} tokens per device per step "
        f"(micro-batches x rows x seq; stage 3 gathers per micro-batch"
        f"{', once with reshard_after_forward=false' if not p.reshard_after_forward else ''}) at "
        f"{p.mfu:g} x peak. {activations}"
        + (
            " Traffic is within one group of the sharding devices; the replicas' gradient all-reduce is not included."
            if replicas > 1
            else ""
        )
    )


def stage_columns(unit: str) -> tuple[str, ...]:
    return (
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
    )


def stage_cells(r, kept: float, scale: float) -> list[str]:
    """One stage's row: its model state by group, what zerojax keeps, its traffic and time."""
    m = r.memory
    sizes = (m["compute_params"], m["master"], m["optimizer"], m["grads"], m["total"], kept)
    traffic = (r.traffic["param_allgather"], r.traffic["grad_reduce"])
    return [
        str(r.stage),
        *(f"{x / scale:,.2f}" for x in (*sizes, *traffic)),
        duration(r.time.compute_s),
        duration(r.time.comm_s),
        "yes" if r.fits else "[red]no[/red]",
        r.time.bound,
    ]


def print_recommendation(out, p) -> None:
    rec = p.recommendation
    if rec.stage is None:
        out.print(f"[bold red]State alone:[/bold red] {rec.reason}.")
        return
    out.print(
        f"State alone (no activations): {rec.reason}. Communication stops dominating at "
        f"{rec.comm_bound_below_tokens:,.0f} tokens per device per step "
        f"(micro-batch >= {rec.min_micro_batch} at seq {p.seq_len})."
    )


def print_stage_table(p, config: str | None = None, remat: str = "full", replicas: int = 1) -> None:
    """Every stage's memory, traffic and time (`accounting.planning.Plan`), and the stage to use."""
    from rich.table import Table

    kept = {
        r.stage: analytic.kept_state_bytes(
            p.params, p.devices, r.stage, p.precision, p.optimizer, trainable=p.trainable
        )["total"]
        for r in p.stages
    }
    unit, scale = unit_for(
        max(max(r.memory["total"], r.traffic["param_allgather"], r.traffic["grad_reduce"]) for r in p.stages)
    )
    table = Table(
        title=stage_table_title(p, config, replicas), caption=stage_table_caption(p, unit, scale, remat, replicas)
    )
    for col in stage_columns(unit):
        table.add_column(col, justify="left" if col in ("fits", "bound") else "right")
    for r in p.stages:
        table.add_row(*stage_cells(r, kept[r.stage], scale))
    out = console()
    out.print(table)
    print_recommendation(out, p)


# ---- stage 3 by mesh axis -------------------------------------------------------------------------


def print_by_axis(section: dict) -> None:
    """Stage 3's traffic by mesh axis, plain and with the config's ZeRO++ options
    (`accounting.zeropp.plan_section`), and hpZ's memory where it keeps a secondary copy."""
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
        cells = [gb(section["plain"].get(kind, {}).get(axis, 0.0))]
        if chosen:
            cells.append(gb(chosen.get(kind, {}).get(axis, 0.0)))
        table.add_row(kind, axis, *cells)
    table.add_row("total", "", gb(section["plain_total"]), *((gb(section["with_options_total"]),) if chosen else ()))
    out = console()
    out.print(table)
    memory = section.get("with_options_memory")
    if memory and memory["secondary_copy"]:
        out.print(
            f"hpZ memory per device: state kept {gb(memory['kept'])} GB (plain stage 3 on this mesh: "
            f"{gb(section['plain_memory']['kept'])} GB), plus the secondary copy, "
            f"{gb(memory['secondary_copy'])} GB, inside the step."
        )


# ---- the combinations -----------------------------------------------------------------------------


def pick_columns(unit: str) -> tuple[str, ...]:
    return ("#", "stage", "accum x rows", "offload", "remat", f"device {unit}", f"host {unit}", "step", "bound", "fits")


def pick_cells(i: int, p, scale: float) -> list[str]:
    return [
        str(i),
        str(p.stage),
        f"{p.grad_accum} x {p.micro_batch}",
        p.offload,
        p.remat,
        f"{p.device_peak_bytes / scale:,.2f}",
        f"{p.host_bytes / scale:,.2f}",
        duration(p.step_s),
        p.bound,
        "yes" if p.fits else "[red]no[/red]",
    ]


def print_picks(ranked, top: int, hw, rows: int, seq_len: int, headroom: float) -> None:
    """The best `top` combinations of stage x accumulation x offload x remat, and the best one's
    config overrides."""
    from rich.table import Table

    fitting = sum(p.fits for p in ranked)
    budget = hw.hbm_bytes * (1 - headroom)
    unit, scale = unit_for(max((max(p.device_peak_bytes, p.host_bytes) for p in ranked[:top]), default=0.0))
    table = Table(
        title=(
            f"Combinations: {fitting} of {len(ranked)} fit in {budget / 1e9:,.2f} GB per "
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
    for col in pick_columns(unit):
        table.add_column(col, justify="left" if col in ("offload", "remat", "bound", "fits") else "right")
    for i, p in enumerate(ranked[:top], 1):
        table.add_row(*pick_cells(i, p, scale))
    out = console()
    out.print(table)
    best = ranked[0] if ranked and ranked[0].fits else None
    if best is None:
        out.print(
            f"[bold red]No combination fits[/bold red] in {budget / 1e9:,.2f} GB "
            "per device: shard over more devices (mesh.fsdp) or shorten the sequences."
        )
        return
    out.print("[bold]Recommendation:[/bold] " + " ".join(f"--set {o}" for o in best.overrides()))
