"""The names of the activation-checkpoint (remat) policies, without JAX: the model applies them
(`zerojax.remat`, which says what each saves) and the planner (`zerojax.accounting`), which must not
import JAX, counts their bytes and recompute."""

from __future__ import annotations

from zerojax.errors import UserError

REMAT_POLICIES = ("full", "dots", "none", "offload")


def check(policy: str, key: str = "model.remat") -> str:
    """`policy` itself, or a `UserError` naming the valid policies."""
    if policy not in REMAT_POLICIES:
        raise UserError(f"{key} must be one of {REMAT_POLICIES}, got {policy!r}.")
    return policy
