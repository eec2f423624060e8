"""Host offload (`zero.offload`): its modes, the train-state groups each keeps in host memory, and
placing them there. The rules import no JAX (config validation and the planner read them); the
placement imports it where it runs.

  none               everything in device memory
  optimizer          the fp32 master params (the `params` group) and the optimizer state in host
                     memory (JAX memory kind "pinned_host"), at every stage
  optimizer+params   also every other persistent parameter copy: the bf16 compute copy that stages 0-2
                     keep (the `compute` group). Stage 3 keeps no parameter shard but the fp32 master,
                     and with fp32 the master is the compute copy, so there it places the same as
                     `optimizer`: its parameter shards already stay on the host between uses.

The step streams the host groups
through: it moves them into device memory inside the compiled step (`jax.device_put` to the same
sharding in memory kind "device"), runs the engine's step unchanged, and moves the new master and
optimizer state back out as the step's outputs. Where the master is also the forward's weights (fp32
at every stage, and stage 3 in every precision), the forward reads that streamed copy. See
docs/offload.md for the choice (streaming, not `compute_on("device_host")`) and the measurements.
"""

from __future__ import annotations

import math

from zerojax.errors import UserError

MODES = ("none", "optimizer", "optimizer+params")
HOST = "pinned_host"
DEVICE = "device"
HOST_KINDS = ("pinned_host", "unpinned_host")


def check_mode(mode, key: str = "zero.offload") -> str:
    """`mode` itself (None reads as "none"), or a `UserError` naming the valid modes."""
    mode = "none" if mode is None else mode
    if mode not in MODES:
        raise UserError(f"{key} must be one of {', '.join(MODES)}, got {mode!r}.")
    return mode


def groups(mode: str, keeps_compute_copy: bool) -> tuple[str, ...]:
    """The `TrainState` groups `mode` keeps in host memory; `keeps_compute_copy`: whether the state
    has a compute copy apart from the fp32 master (bf16 at stages 0-2)."""
    if check_mode(mode) == "none":
        return ()
    extra = ("compute",) if mode == "optimizer+params" and keeps_compute_copy else ()
    return ("params", "opt_state", *extra)


def is_host(sharding) -> bool:
    """Whether `sharding` places its array in host memory."""
    return getattr(sharding, "memory_kind", None) in HOST_KINDS


def check_backend(mode: str, devices) -> None:
    """A `UserError` where the devices have no host memory to place state in."""
    import jax

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
    import jax

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

    from zerojax.core.state import TrainState

    def run(state, *rest):
        out = fn(place(state, shardings, names, DEVICE), *rest)
        if isinstance(out, tuple) and isinstance(out[0], TrainState):
            return (place(out[0], shardings, names, HOST), *out[1:])
        return place(out, shardings, names, HOST) if isinstance(out, TrainState) else out

    return run


def split_bytes(tree, device=None) -> dict[str, int]:
    """{"device": bytes, "host": bytes} of `tree`'s shards on `device` (default: the first shard's),
    by each array's memory kind; for `jax.ShapeDtypeStruct`s, from their shardings."""
    import jax

    out = {"device": 0, "host": 0}
    for leaf in jax.tree.leaves(tree):
        where = "host" if is_host(leaf.sharding) else "device"
        if isinstance(leaf, jax.ShapeDtypeStruct):
            out[where] += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            continue
        for shard in leaf.addressable_shards:
            device = shard.device if device is None else device
            if shard.device == device:
                out[where] += shard.data.nbytes
    return out
