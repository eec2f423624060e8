"""Messages for people: one-line warnings on stderr, and quieting libraries' own logging."""

from __future__ import annotations

import logging
import sys
import threading

import jax


def warn(message: str) -> None:
    """One `warning: ...` line on stderr, from process 0 only."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def quiet_orbax(level: int = logging.ERROR) -> None:
    """For the CLI: orbax's absl warnings (read-only options, missing step metadata) are noise there.

    `zerojax train` passes CRITICAL: a failed checkpoint write is reported once, as its own `error:`
    line, so orbax's logged copy and the "Event loop is closed" tracebacks that tensorstore's
    callbacks report (through `sys.unraisablehook`) for the writes still in flight are dropped too.
    """
    logging.getLogger("absl").setLevel(level)
    if level >= logging.CRITICAL and not getattr(sys.unraisablehook, "_zerojax", False):
        default = sys.unraisablehook

        def hook(unraisable):
            value = unraisable.exc_value
            if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
                return
            default(unraisable)

        hook._zerojax = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook
        threading.excepthook = _held_thread_errors.append  # orbax's writer threads: see below


# Uncaught exceptions of background threads while `zerojax train` runs. A failed checkpoint write
# surfaces in the main thread as one `error:` line, and its writer thread's own traceback, printed
# or not depending on timing, would only repeat it; any other is printed when the run ends.
_held_thread_errors: list = []


def release_thread_errors() -> None:
    """Print the background-thread exceptions held since `quiet_orbax(CRITICAL)`."""
    threading.excepthook = threading.__excepthook__
    while _held_thread_errors:
        threading.__excepthook__(_held_thread_errors.pop(0))
