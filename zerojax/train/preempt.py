"""Termination requests: SIGTERM (pods, SLURM, `zerojax launch`) or JAX's preemption notice.

`Preemption.reached(step)` is asked after every step and answers the same on every process:
  one process     a SIGTERM handler (installed only while training, on the main thread) sets a flag;
  many processes  JAX's preemption service (`jax.distributed` catches SIGTERM itself and agrees on
                  the first step every process reaches after the notice), through
                  `multihost_utils.reached_preemption_sync_point`.
The step loop then saves a checkpoint of that step, waits for it to be complete, and stops.
"""

from __future__ import annotations

import signal
import threading


class Preemption:
    def __init__(self):
        import jax

        self.requested = False
        self._multi = jax.process_count() > 1
        self._old = None

    def __enter__(self) -> Preemption:
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (the same answer on every process)."""
        if self._multi:
            from jax.experimental import multihost_utils

            try:
                self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is off (jax_enable_preemption_service=False)
                return False
        return self.requested
