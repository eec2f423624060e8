"""Host offload (`zero.offload: optimizer`) against the device-resident run, paired in one process.

Part 1, the train step: the shipped GPT (`--preset`, default 20m) with AdamW at each `--stages` on
all local devices (8 simulated CPU devices here), offload none vs optimizer: per device, the state's
device-space and host-space bytes (live arrays' memory kinds), the compiled step's arguments by
memory space (S(5) in the entry layout is host), its temporaries, and the step time, none and
optimizer steps interleaved so both see the same machine load (median of `--steps`, ratio of medians).

Part 2, the choice: the AdamW update alone on `--update-params` fp32 parameters sharded over the
devices, three ways: device-resident; streamed (host arrays moved into device memory inside the
program, updated there, moved back: what zerojax does); and run on the host
(`jax.experimental.compute_on.compute_on("device_host")` over host arrays).

    python -m experiments.offload                      # -> results/offload.{md,json}
    python -m experiments.offload --preset 1b --stages 3 --precision bf16 --batch 4   # one GPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

from experiments.common import RESULTS

HERE = os.path.dirname(os.path.abspath(__file__))


def train_rows(preset: str, stages, precision: str, batch: int, steps: int) -> list[dict]:
    import jax
    import optax

    from zerojax import Trainer
    from zerojax.accounting.placed_bytes import compiled_argument_bytes
    from zerojax.core.trees import count_params
    from zerojax.data.corpus import BatchStream, load_corpus
    from zerojax.models.gpt import GPT, gpt_config

    cfg = gpt_config(preset)
    stream = BatchStream(load_corpus(None, 400_000), seq_len=cfg.seq_len, global_batch=batch, seed=0)
    rows = []
    for stage in stages:
        runs = {}
        for mode in ("none", "optimizer"):
            trainer = Trainer(
                functools.partial(GPT, cfg), optax.adamw(1e-3), stage=stage, precision=precision, offload=mode
            )
            state = trainer.init(jax.random.key(0), stream.host_batch(0))
            compiled = trainer.compile(state, stream.host_batch(0))
            ma = compiled.memory_analysis()
            runs[mode] = {
                "trainer": trainer,
                "state": state,
                "compiled": compiled,
                "times": [],
                "losses": [],
                "row": {
                    "stage": stage,
                    "offload": mode,
                    "precision": precision,
                    "params": count_params(trainer.layout.leaves),
                    "devices": int(trainer.mesh.devices.size),
                    "device_bytes": trainer.persistent_bytes_per_device(state),
                    "host_bytes": trainer.host_persistent_bytes_per_device(state),
                    "compiled_args": compiled_argument_bytes(compiled),
                    "temp_bytes": int(ma.temp_size_in_bytes),
                    "host_argument_size_in_bytes": int(getattr(ma, "host_argument_size_in_bytes", 0)),
                },
            }
        for i in range(steps + 1):  # step 0 warms up; the rest interleave the two runs
            for run in runs.values():
                batch_i = run["trainer"].shard_batch(stream.host_batch(i))
                t = time.perf_counter()
                run["state"], metrics = run["compiled"](run["state"], batch_i)
                run["losses"].append(float(metrics["loss"]))
                if i:
                    run["times"].append(time.perf_counter() - t)
        base = statistics.median(runs["none"]["times"])
        for run in runs.values():
            row = run["row"]
            row["step_time_s"] = statistics.median(run["times"])
            row["step_time_ratio_vs_none"] = row["step_time_s"] / base
            row["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(run["losses"], runs["none"]["losses"]))
            rows.append(row)
        print(rows[-2], rows[-1], flush=True)
        del runs
    return rows


def update_rows(n: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    dev = NamedSharding(mesh, P("fsdp"))
    host = dev.with_memory_kind("pinned_host")
    tx = optax.adamw(1e-3)

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rep = NamedSharding(mesh, P())

    def place(tree, kind):  # inside jit: a transfer between memory spaces
        return jax.tree.map(lambda x: jax.device_put(x, (dev if x.ndim else rep).with_memory_kind(kind)), tree)

    def streamed(params, opt_state, grads):
        params, opt_state = update(place(params, "device"), place(opt_state, "device"), grads)
        return place((params, opt_state), "pinned_host")

    def on_host(params, opt_state, grads):
        from jax.experimental.compute_on import compute_on

        try:
            wrap = compute_on("device_host")
        except TypeError:  # jax 0.12: compute_on(compute_type=..., out_memory_spaces=...)
            wrap = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
        return wrap(jax.jit(update))(params, opt_state, jax.device_put(grads, host))

    params = jnp.zeros((n,), jnp.float32)
    grads = jax.device_put(jnp.full((n,), 1e-3, jnp.float32), dev)
    rows = []
    for name, fn, where in (("device", update, dev), ("streamed", streamed, host), ("compute_on host", on_host, host)):
        p = jax.device_put(params, where)
        s = jax.tree.map(
            lambda x, where=where: jax.device_put(x, (dev if x.ndim else rep).with_memory_kind(where.memory_kind)),
            tx.init(params),
        )
        try:
            jitted = jax.jit(fn, donate_argnums=(0, 1))
            out = jax.block_until_ready(jitted(p, s, grads))
            p, s = out
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                p, s = jax.block_until_ready(jitted(p, s, grads))
                times.append(time.perf_counter() - t)
            rows.append(
                {"update": name, "params": n, "time_s": statistics.median(times), "params_kind": p.sharding.memory_kind}
            )
        except Exception as e:  # noqa: BLE001 - a variant this backend cannot run is a result too
            rows.append({"update": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(rows[-1], flush=True)
    base = next((r["time_s"] for r in rows if r["update"] == "device" and "time_s" in r), None)
    for r in rows:
        if base and "time_s" in r:
            r["ratio_vs_device"] = r["time_s"] / base
    return rows


def write(result: dict, suffix: str) -> None:
    mib = lambda b: f"{b / 2**20:,.2f}"  # noqa: E731
    lines = [
        f"# Host offload: device vs host bytes and step time ({result['device_kind']})",
        "",
        f"Run {result['date']} on {result['host']}, jax {result['jax']}, {result['devices']} devices; "
        f"`python -m experiments.offload {' '.join(result['argv'])}`.",
        "",
        f"## The train step: GPT {result['preset']}, AdamW, {result['precision']}, per device",
        "",
        "| stage | offload | device MiB | host MiB | compiled args device / host MiB | temp MiB | "
        "step ms | ratio vs none | max loss diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["train"]:
        a = r["compiled_args"]
        lines.append(
            f"| {r['stage']} | {r['offload']} | {mib(r['device_bytes'])} | {mib(r['host_bytes'])} | "
            f"{mib(a['device'])} / {mib(a['host'])} | {mib(r['temp_bytes'])} | {r['step_time_s'] * 1e3:,.1f} | "
            f"{r['step_time_ratio_vs_none']:.3f} | {r['max_loss_diff_vs_none']:.1e} |"
        )
    lines += [
        "",
        f"## The update alone: AdamW on {result['update_params']:,} fp32 parameters",
        "",
        "| update | ms | ratio vs device |",
        "|---|---|---|",
    ]
    for r in result["update"]:
        if "error" in r:
            lines.append(f"| {r['update']} | {r['error']} | - |")
        else:
            lines.append(f"| {r['update']} | {r['time_s'] * 1e3:,.2f} | {r.get('ratio_vs_device', 1):.3f} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"offload{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, f"offload{suffix}.json"), "w") as f:
        json.dump(result, f, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--update-params", type=int, default=8 * 2**20)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on a GPU)")
    ap.add_argument("--suffix", default="", help="results/offload{suffix}.{md,json}")
    args = ap.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    import jax

    stages = [int(s) for s in args.stages.split(",")]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "jax": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "argv": sys.argv[1:],
        "preset": args.preset,
        "precision": args.precision,
        "update_params": args.update_params,
    }
    result["train"] = train_rows(args.preset, stages, args.precision, args.batch, args.steps)
    result["update"] = update_rows(args.update_params, repeats=5)
    write(result, args.suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
