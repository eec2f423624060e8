"""`zerojax inspect CONFIG [--stage S] [--devices N] [--set KEY=VALUE]... [--json]`: every parameter's
shape, its PartitionSpec in each state group, the bytes one device keeps of it, and which leaves are
replicated or padded, and why. Built from the trainer's abstract state: nothing is allocated."""

from __future__ import annotations

import argparse
import json
import math

from zerojax.cli.commands import add_devices, add_overrides
from zerojax.core.stages import GROUPS


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="per-parameter layout of each state group, bytes per device")
    p.add_argument("config", help="YAML experiment config, e.g. configs/tiny.yaml")
    p.add_argument("--stage", type=int, default=None, help="ZeRO stage to lay out (default: the config's)")
    add_devices(p)
    add_overrides(p, "override a config key (repeatable)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerojax.cli.config import load_config
    from zerojax.core.mesh import simulate_cpu_devices
    from zerojax.core.stages import get_stage

    overrides = list(args.overrides)
    if args.stage is not None:
        get_stage(args.stage, "--stage")
        overrides.append(f"zero.stage={args.stage}")
    config = load_config(args.config, overrides)  # before JAX starts: bad input fails fast
    if args.devices is not None:
        simulate_cpu_devices(args.devices)
    report = layout_report(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _spec(sharding) -> str:
    return str(tuple(sharding.spec)) if len(sharding.spec) else "()"


def _shard_bytes(sds) -> int:
    return math.prod(sds.sharding.shard_shape(sds.shape)) * sds.dtype.itemsize


def layout_report(c) -> dict:
    """The layout `Trainer.init` would build for config `c`, as plain JSON-ready values."""
    import jax
    import jax.numpy as jnp

    from zerojax.cli.experiment import build_experiment
    from zerojax.core.leaf_rule import LeafLayout
    from zerojax.core.trees import abstract, count_params, path_str

    exp = build_experiment(c)
    trainer = exp.trainer
    if exp.model is not None and not c.data.target:  # the shipped GPT on the byte corpus
        batch = {
            k: jax.ShapeDtypeStruct((c.train.batch_size, exp.model.seq_len), jnp.int32) for k in ("inputs", "targets")
        }
    else:
        from zerojax.data.sources import example_batch

        batch = abstract(example_batch(exp.train_data))
    state = trainer.abstract_state(jax.random.key(c.train.seed), batch)
    prepared = trainer.prepare(jax.random.key(c.train.seed), batch)
    layout = prepared.layout
    params = {
        path_str(p): l
        for p, l in jax.tree_util.tree_flatten_with_path(layout.leaves, is_leaf=lambda x: isinstance(x, LeafLayout))[0]
    }
    by_param, other = _optimizer_leaves(state.opt_state, params)
    master = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    leaves = [_leaf_row(layout, name, l, master[name], by_param.get(name, [])) for name, l in params.items()]
    totals = {g: sum(leaf["bytes_per_device"][g] for leaf in leaves) for g in GROUPS if g != "grads"}
    totals["other_state"] = sum(o["bytes_per_device"] for o in other) + _shard_bytes(state.step)
    totals["total"] = sum(totals.values())
    return {
        "config": c.to_dict()["model"],
        "stage": layout.stage.index,
        "precision": layout.precision.name,
        "engine": trainer.engine,
        "mesh": {k: int(v) for k, v in layout.mesh.shape.items()},
        "fsdp": layout.fsdp_size,
        "tensor": int(dict(layout.mesh.shape).get("tensor", 1)),
        # logical axis names no rule maps and no mesh axis is: free for FSDP (`zerojax.core.axis_rules`)
        "unmapped_axis_names": list(layout.unmapped_names),
        "params": count_params(layout.leaves),
        "trainable_params": count_params(layout.trained_leaves()),
        "groups_sharded": dict(
            zip(GROUPS, (layout.compute_sharded, layout.master_sharded, layout.optimizer_sharded, layout.grads_sharded))
        ),
        "leaves": leaves,
        "other_state": other,
        "persistent_bytes_per_device": totals,
        "host_groups": list(layout.host_groups),  # zero.offload: these groups' bytes are in host memory
        "gathers": prepared.report.description,  # how the step materialises the params, and any exceptions
        # what the model's traces dropped from its own shardings (`zerojax.core.model_mesh`)
        "sharding_notes": list(prepared.gather_report().notes),
    }


def _optimizer_leaves(opt_state, params: dict) -> tuple[dict[str, list], list[dict]]:
    """Optimizer leaves by the parameter whose path ends theirs (Adam's mu/..., nu/...), and the rest."""
    import jax

    from zerojax.core.trees import path_str

    by_param: dict[str, list] = {}
    other = []
    for p, sds in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name = path_str(p)
        owner = next((k for k in params if name == k or name.endswith("/" + k)), None)
        if owner is not None and sds.shape:
            by_param.setdefault(owner, []).append(sds)
        else:
            other.append(
                {
                    "path": name,
                    "shape": list(sds.shape),
                    "dtype": str(sds.dtype),
                    "spec": _spec(sds.sharding),
                    "bytes_per_device": _shard_bytes(sds),
                }
            )
    return by_param, other


def _leaf_row(layout, name: str, l, m, opt: list) -> dict:
    """One parameter's row: its specs in each group and the bytes one device keeps of it."""
    from jax.sharding import NamedSharding

    prec = layout.precision
    if not l.trainable:
        compute_spec, compute_bytes, compute_note = _spec(m.sharding), _shard_bytes(m), "frozen: kept once, no master"
    elif layout.keeps_compute_copy:
        compute_spec = _spec(NamedSharding(layout.mesh, l.spec(False)))
        compute_bytes, compute_note = math.prod(l.shape) * prec.param_bytes // l.model_split, "kept"
    elif layout.compute_sharded and prec.separate_compute_copy:
        compute_spec, compute_bytes, compute_note = _spec(m.sharding), 0, "cast from the shard and gathered per use"
    else:
        compute_spec, compute_bytes, compute_note = _spec(m.sharding), 0, "the master itself (fp32)"
    grads = NamedSharding(layout.mesh, l.spec(layout.grads_sharded))
    status = "replicated" if l.axis is None else ("padded" if l.padded else "sharded")
    nbytes = {
        "compute_params": compute_bytes,
        "master": _shard_bytes(m) if l.trainable else 0,
        "optimizer": sum(_shard_bytes(s) for s in opt),
    }
    nbytes["total"] = sum(nbytes.values())
    return {
        "path": name,
        "shape": list(l.shape),
        "stored_shape": list(m.shape),
        "status": status,
        "trainable": l.trainable,
        "tensor_axis": l.tensor_axis,  # the dimension split over the mesh's tensor axis in every group
        "reason": l.reason,
        "spec": {
            "compute_params": compute_spec,
            "master": _spec(m.sharding) if l.trainable else "-",
            "optimizer": _spec(opt[0].sharding) if opt else "-",
            "grads": _spec(grads) if l.trainable else "-",
        },
        "compute_note": compute_note,
        "bytes_per_device": nbytes,
    }


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from zerojax.accounting.measure import human_bytes as b

    sharded = ", ".join(g for g, on in r["groups_sharded"].items() if on) or "nothing"
    table = Table(
        title=f"zerojax inspect: stage {r['stage']}, {r['precision']}, {r['params']:,} params "
        f"({r['trainable_params']:,} trainable, {r['trainable_params'] / r['params']:.1%}), fsdp={r['fsdp']}, "
        f"tensor={r['tensor']} "
        f"(mesh {r['mesh']}); sharded groups: {sharded}",
        caption="PartitionSpec per group; bytes = what one device keeps between steps (compute copy + fp32 master "
        "+ optimizer state). Gradients live only inside the step.",
    )
    for col in ("parameter", "shape", "stored", "compute", "master", "optimizer", "grads", "bytes/device", "why"):
        table.add_column(col, justify="right" if col == "bytes/device" else "left")
    for leaf in r["leaves"]:
        s = leaf["spec"]
        stored = "" if leaf["stored_shape"] == leaf["shape"] else str(tuple(leaf["stored_shape"]))
        why = leaf["reason"] if leaf["status"] != "sharded" or leaf["tensor_axis"] is not None else ""
        table.add_row(
            leaf["path"],
            str(tuple(leaf["shape"])),
            stored,
            s["compute_params"],
            s["master"],
            s["optimizer"],
            s["grads"],
            b(leaf["bytes_per_device"]["total"]),
            f"[yellow]{why}[/yellow]" if why else "",
        )
    console = Console(width=None if Console().is_terminal else 160)
    console.print(table)
    t = r["persistent_bytes_per_device"]
    replicated = [l["path"] for l in r["leaves"] if l["status"] == "replicated"]
    padded = [l["path"] for l in r["leaves"] if l["status"] == "padded"]
    console.print(
        f"per device: compute {b(t['compute_params'])}, master {b(t['master'])}, optimizer {b(t['optimizer'])}, "
        f"other {b(t['other_state'])}; total {b(t['total'])}"
    )
    console.print(f"replicated leaves: {len(replicated)}" + (f" ({', '.join(replicated)})" if replicated else ""))
    console.print(f"padded leaves: {len(padded)}" + (f" ({', '.join(padded)})" if padded else ""))
    console.print(f"gathers: {r['gathers']}")
    for note in r["sharding_notes"]:
        console.print(f"model sharding: {note}")
    if r["unmapped_axis_names"]:
        names = ", ".join(r["unmapped_axis_names"])
        console.print(f"axis names no rule maps (free for FSDP): {names}")
