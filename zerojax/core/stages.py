"""The ZeRO stage table, as data: a stage only says *which state groups are sharded* over the mesh's
`fsdp` axis. Every sharding in the library is derived from this table and from one rule per
parameter leaf (`zerojax.core.leaf_rule`)."""

from __future__ import annotations

from dataclasses import dataclass

from zerojax.errors import UserError


@dataclass(frozen=True)
class Stage:
    """Which state groups one ZeRO stage shards over the `fsdp` axis."""

    index: int
    compute_params: bool  # low-precision compute params; at stage 3 gathered layer by layer
    master_params: bool  # fp32 master copy
    optimizer: bool  # optimizer moments (scalar counters always replicate)
    gradients: bool  # reduce-scattered during backward instead of all-reduced

    @property
    def resident_compute(self) -> bool:
        """Compute params replicated while gradients are reduce-scattered during backward (stage 2):
        the forward reads a resident copy whose backward reduces into the shard."""
        return self.gradients and not self.compute_params


STAGES = (
    Stage(0, compute_params=False, master_params=False, optimizer=False, gradients=False),
    Stage(1, compute_params=False, master_params=True, optimizer=True, gradients=False),
    Stage(2, compute_params=False, master_params=True, optimizer=True, gradients=True),
    Stage(3, compute_params=True, master_params=True, optimizer=True, gradients=True),
)


STAGE_INDICES = tuple(s.index for s in STAGES)

# The four state groups a stage may shard, as plans, reports and `zerojax inspect` name them, and the
# `Stage` field that says whether it does (gradients live only inside the step).
GROUPS = ("compute_params", "master", "optimizer", "grads")
_STAGE_FIELD = {
    "compute_params": "compute_params",
    "master": "master_params",
    "optimizer": "optimizer",
    "grads": "gradients",
}


# The `TrainState` field holding each group between steps.
GROUP_OF_FIELD = {"compute": "compute_params", "params": "master", "opt_state": "optimizer"}


def sharded_groups(stage: Stage) -> dict[str, bool]:
    """{group: whether `stage` shards it}, in `GROUPS` order."""
    return {g: getattr(stage, _STAGE_FIELD[g]) for g in GROUPS}


def get_stage(index, key: str = "zero.stage") -> Stage:
    """The table row for `index`; `key` names the setting in the error (e.g. `--stage`)."""
    if isinstance(index, bool) or index not in STAGE_INDICES:
        valid = ", ".join(map(str, STAGE_INDICES[:-1])) + f" or {STAGE_INDICES[-1]}"
        raise UserError(f"{key} must be {valid}, got {index!r}.")
    return STAGES[index]
