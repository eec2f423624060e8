"""What the experiments share: where results go, and simulated CPU devices set before JAX starts."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 2**20


def cpu_devices(count: int = 8) -> None:
    """Simulate `count` CPU devices unless the environment already asks for a number (call it before
    JAX is imported; other `XLA_FLAGS` are kept)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
