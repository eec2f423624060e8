"""Messages for people: one-line warnings on stderr, and quieting libraries' own logging."""

from __future__ import annotations

import logging
import sys

import jax


def warn(message: str) -> None:
    """One `warning: ...` line on stderr, from process 0 only."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def quiet_orbax() -> None:
    """For the CLI: orbax's absl warnings (read-only options, missing step metadata) are noise there."""
    logging.getLogger("absl").setLevel(logging.ERROR)
