"""Train one ZeRO stage x engine a few steps and measure it beside the analytic model: the row
`zerojax compare` prints and the experiments in `experiments/` tabulate."""

from __future__ import annotations

import statistics
import time


def run_row(c, steps: int, devices=None) -> tuple[dict, int, int]:
    """One stage x engine: init, one compile (measured), `steps` steps on the config's data.
    Returns (row, parameters, devices); `devices` (default all) are those the mesh is built over."""
    import jax

    from zerojax.accounting import measure
    from zerojax.accounting.analytic import GPTShape
    from zerojax.experiment import build_experiment
    from zerojax.sources import global_batch

    exp = build_experiment(c, devices=devices)
    trainer, gpt = exp.trainer, exp.model  # gpt: None for a model.target (no analytic activations)
    sharding = trainer.batch_sharding
    first = global_batch(exp.train_data, 0, sharding)
    state = trainer.init(jax.random.key(c.train.seed), first)
    shape = {"shape": GPTShape.of(gpt), "seq_len": gpt.seq_len, "remat": gpt.remat} if gpt is not None else {}
    m, compiled = measure.measure_step(trainer, state, first, optimizer=c.optimizer.name, **shape)
    losses, times = [], []
    for step in range(steps):
        batch = trainer.shard_batch(first if step == 0 else global_batch(exp.train_data, step, sharding))
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # blocks until the step is done
        times.append(time.perf_counter() - t)
    del state
    row = {**m.row(), "step_time_s": statistics.median(times), "losses": losses}
    return row, m.ideal.params, int(trainer.mesh.devices.size)


def add_loss_differences(rows: list[dict]) -> None:
    """final loss minus that of stage 0 (same engine when compared, else the first stage-0 row)."""
    zeros = [r for r in rows if r["stage"] == 0]
    for r in rows:
        ref = next((z for z in zeros if z["engine"] == r["engine"]), zeros[0] if zeros else None)
        r["final_loss"] = r["losses"][-1]
        r["final_loss_diff_vs_stage0"] = None if ref is None else r["final_loss"] - ref["losses"][-1]
