"""`zerojax plan`'s FSDP x tensor section: each tensor size within a node, the pick, and the tokens
per device below which tensor parallelism pays (`zerojax.accounting.tensor_plan`)."""

from __future__ import annotations


def section(inputs: dict, hardware, efficiency: float) -> dict | None:
    """The section for a GPT-shaped plan (None without a model shape); compute at `efficiency` x peak."""
    from zerojax.accounting import tensor_plan
    from zerojax.accounting.hardware import node_links

    shape = inputs["shape"]
    if shape is None:
        return None
    devices = inputs["devices"] * inputs["replicas"]
    tokens = inputs["rows_per_device"] * inputs["seq_len"]
    args = (inputs["params"], devices, hardware, shape)
    opts = tensor_plan.options(*args, tokens, efficiency, inputs["remat"], inputs.get("trainable"))
    pick = tensor_plan.best(opts)
    node, _ = node_links(hardware, devices)
    return {
        "devices": devices,
        "devices_per_node": node,
        "tokens_per_device": tokens,
        "efficiency": efficiency,
        "options": [dict(vars(o), step_s=o.step_s, bound=o.bound) for o in opts],
        "pick": {"tensor": pick.tensor, "fsdp": pick.fsdp, "bound": pick.bound, "step_s": pick.step_s},
        "config_tensor": inputs.get("tensor"),
        "crossover_tokens_per_device": tensor_plan.crossover(
            *args, efficiency, inputs["remat"], inputs.get("trainable")
        ),
    }


def print_section(s: dict) -> None:
    from rich.table import Table

    from zerojax.cli.commands.plan.tables import console, duration, gb

    table = Table(
        title=f"FSDP x tensor at stage 3: {s['devices']} devices ({s['devices_per_node']} a node), "
        f"{s['tokens_per_device']:,} tokens per device per step, compute at {s['efficiency']:.0%} of peak",
        caption="step = max(compute, fsdp traffic, tensor traffic) + per-collective latency",
    )
    for col in ("tensor x fsdp", "state/device (GB)", "compute", "fsdp traffic", "tensor traffic", "latency", "step"):
        table.add_column(col, justify="left" if col == "tensor x fsdp" else "right")
    for o in s["options"]:
        times = (o["compute_s"], o["fsdp_s"], o["tensor_s"], o["latency_s"], o["step_s"])
        table.add_row(f"{o['tensor']} x {o['fsdp']}", gb(o["state_bytes"]), *map(duration, times))
    out = console()
    out.print(table)
    pick = s["pick"]
    out.print(
        f"Tensor parallelism: mesh.tensor={pick['tensor']}, fsdp={pick['fsdp']} "
        f"(the fastest step, {duration(pick['step_s'])}, bound by {pick['bound']})."
    )
    cross = s["crossover_tokens_per_device"]
    if cross is None:
        out.print("Tensor parallelism never pays here: stage 3's traffic hides under compute at any batch.")
    else:
        out.print(f"Tensor parallelism pays below ~{cross:,.0f} tokens per device per step (stage 3 alone above).")
    if s["config_tensor"] is not None and s["config_tensor"] != pick["tensor"]:
        out.print(f"[yellow]The config has mesh.tensor={s['config_tensor']}.[/yellow]")
