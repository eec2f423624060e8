"""What the experiments share: where results go, and simulated CPU devices set before JAX starts."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 2**20


def sweep_config(model: str, precision: str, engine: str, stage: int, *more: str):
    """configs/tiny.yaml as one (model preset, precision, engine, stage) row of a sweep: global batch
    16, and `more` overrides."""
    from zerojax.cli.config import load_config

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
    overrides = [f"model.preset={model}", f"precision={precision}", f"zero.stage={stage}", f"zero.engine={engine}"]
    return load_config(config, [*overrides, "train.batch_size=16", *more])


def cpu_devices(count: int = 8) -> None:
    """Simulate `count` CPU devices unless the environment already asks for a number (call it before
    JAX is imported; other `XLA_FLAGS` are kept)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
