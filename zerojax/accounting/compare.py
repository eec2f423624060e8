"""Measure a built trainer's step beside the analytic model and time it a few steps: the row
`zerojax compare` prints and the experiments in `experiments/` tabulate."""

from __future__ import annotations

import itertools
import statistics
import time


def measured_row(
    trainer, state, batches, *, optimizer: str = "adamw", shape=None, seq_len: int = 0, remat: str = "full"
) -> tuple[dict, int]:
    """(row, parameters): `trainer`'s step compiled once for the first of `batches` and measured
    (`measure.measure_step`; `shape`, `seq_len`, `remat` give the model's activations, as there),
    then run from `state` on each batch in turn. The row adds the median step time and the losses."""
    from zerojax.accounting import measure  # imports JAX: `zerojax compare` sets the devices first

    batches = iter(batches)
    first = next(batches)
    m, compiled = measure.measure_step(
        trainer, state, first, optimizer=optimizer, shape=shape, seq_len=seq_len, remat=remat
    )
    losses, times = [], []
    for batch in itertools.chain([first], batches):
        batch = trainer.shard_batch(batch)
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # blocks until the step is done
        times.append(time.perf_counter() - t)
    del state
    return {**m.row(), "step_time_s": statistics.median(times), "losses": losses}, m.ideal.params


def add_loss_differences(rows: list[dict]) -> None:
    """final loss minus that of stage 0 (same engine when compared, else the first stage-0 row)."""
    zeros = [r for r in rows if r["stage"] == 0]
    for r in rows:
        ref = next((z for z in zeros if z["engine"] == r["engine"]), zeros[0] if zeros else None)
        r["final_loss"] = r["losses"][-1]
        r["final_loss_diff_vs_stage0"] = None if ref is None else r["final_loss"] - ref["losses"][-1]
