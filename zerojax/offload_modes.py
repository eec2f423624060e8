"""The rules of host offload (`zero.offload`), without JAX: its modes, the train-state groups each
keeps in host memory, and which memory kinds are host memory. Placement (`zerojax.offload`), config
validation and the planner (`zerojax.accounting.picks`, which must not import JAX) all read them here.

  none               everything in device memory
  optimizer          the fp32 master params (the `params` group) and the optimizer state in host
                     memory (JAX memory kind "pinned_host"), at every stage
  optimizer+params   also every other persistent parameter copy: the bf16 compute copy that stages 0-2
                     keep (the `compute` group). Stage 3 keeps no parameter shard but the fp32 master,
                     and with fp32 the master is the compute copy, so there it places the same as
                     `optimizer`: its parameter shards already stay on the host between uses.
"""

from __future__ import annotations

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
