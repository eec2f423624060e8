"""Host offload (`zero.offload`): placing the train-state groups a mode keeps in host memory.

The modes and the groups each keeps are in `zerojax.offload_modes`. The step streams the host groups
through: it moves them into device memory inside the compiled step (`jax.device_put` to the same
sharding in memory kind "device"), runs the engine's step unchanged, and moves the new master and
optimizer state back out as the step's outputs. Where the master is also the forward's weights (fp32
at every stage, and stage 3 in every precision), the forward reads that streamed copy. See
docs/offload.md for the choice (streaming, not `compute_on("device_host")`) and the measurements.
"""

from __future__ import annotations

import jax

# `check_mode`, `groups` and `split_bytes` are read through this module by the trainer and the layout.
from zerojax.errors import UserError
from zerojax.offload_modes import DEVICE, HOST
from zerojax.state import TrainState


def check_backend(mode: str, devices) -> None:
    """A `UserError` where the devices have no host memory to place state in."""
    if mode == "none":
        return
    for device in devices:
        kinds = [m.kind for m in device.addressable_memories()]
        if HOST not in kinds:
            raise UserError(
                f"zero.offload: {mode} needs the memory kind {HOST!r}, which device {device} "
                f"(platform {device.platform}, jax {jax.__version__}) does not have; it has "
                f"{', '.join(kinds)}. Use zero.offload: none here."
            )


def to_host(sharding):
    return sharding.with_memory_kind(HOST)


def to_device(sharding):
    return sharding.with_memory_kind(DEVICE)


def place(state, shardings, names, where):
    """`state` with the groups `names` moved (inside `jit`: a transfer in the program) to their
    `shardings` in memory kind `where` ("device" or "pinned_host"); the other groups unchanged."""
    if not names:
        return state
    kind = to_device if where == DEVICE else to_host
    moved = {
        g: jax.tree.map(lambda x, s: jax.device_put(x, kind(s)), getattr(state, g), getattr(shardings, g))
        for g in names
        if getattr(state, g) is not None
    }
    return state.replace(**moved)


def streamed(fn, shardings, names):
    """`fn(state, *rest)` run on the state with the host groups moved into device memory first; a
    returned state (first output of a tuple, or the output) goes back to host memory."""
    if not names:
        return fn

    def run(state, *rest):
        out = fn(place(state, shardings, names, DEVICE), *rest)
        if isinstance(out, tuple) and isinstance(out[0], TrainState):
            return (place(out[0], shardings, names, HOST), *out[1:])
        return place(out, shardings, names, HOST) if isinstance(out, TrainState) else out

    return run
