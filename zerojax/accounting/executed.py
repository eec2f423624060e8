"""How often instructions of a compiled program run in one execution, read from a profile of it:
what the HLO text cannot say for a conditional's branches, since which branch runs in each
iteration of a loop is decided as the program runs (a pipeline's stage-to-stage sends:
`zerojax.engines.pipeline`)."""

from __future__ import annotations

import collections
import glob
import os
import tempfile


def instruction_runs(run, names: set[str], devices: int) -> dict[str, int]:
    """{name: executions per device} of the instructions `names` while `run()` executes the program
    once and waits for it, from a `jax.profiler` trace, in which each device records one event per
    instruction it executes (XLA:CPU's thunks, named as in the program's HLO). An instruction of
    `names` that never ran is 0; if none of them shows, the program's names are not the trace's
    and this raises rather than report zeros."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="zerojax-profile-") as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        traces = sorted(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True))
        if not traces:
            raise RuntimeError(f"the profiler wrote no trace into {tmp}")
        data = ProfileData.from_file(traces[-1])
    seen = collections.Counter(
        event.name for plane in data.planes for line in plane.lines for event in line.events if event.name in names
    )
    if names and not seen:
        raise RuntimeError(f"none of {sorted(names)[:3]} ... shows in the profile of the program's run")
    uneven = {n: k for n, k in seen.items() if k % devices}
    if uneven:
        raise RuntimeError(f"instructions ran unevenly over the {devices} devices: {uneven}")
    return {n: seen[n] // devices for n in names}
