"""One row of `zerojax compare`: build the experiment a config describes, initialise it and hand the
trainer to `accounting.compare.measured_row`. JAX is imported inside `run_row`, so that importing
this module leaves the device count to be set."""

from __future__ import annotations

import itertools
from typing import Any


def run_row(c, steps: int, devices=None) -> tuple[dict, int, int]:
    """One stage x engine: init, one compile (measured), `steps` steps on the config's data.
    Returns (row, parameters, devices); `devices` (default all) are those the mesh is built over."""
    import jax

    from zerojax.accounting.activations import GPTShape
    from zerojax.accounting.compare import measured_row
    from zerojax.cli.experiment import build_experiment
    from zerojax.data.sources import global_batch

    exp = build_experiment(c, devices=devices)
    trainer, gpt = exp.trainer, exp.model  # gpt: None for a model.target (no analytic activations)
    sharding = trainer.batch_sharding
    first = global_batch(exp.train_data, 0, sharding)
    later = (global_batch(exp.train_data, step, sharding) for step in range(1, steps))
    model: dict[str, Any] = (
        {"shape": GPTShape.of(gpt), "seq_len": gpt.seq_len, "remat": gpt.remat} if gpt is not None else {}
    )
    state = trainer.init(jax.random.key(c.train.seed), first)
    row, params = measured_row(trainer, state, itertools.chain([first], later), optimizer=c.optimizer.name, **model)
    return row, params, int(trainer.mesh.devices.size)
