"""The jaxprs nested in a jaxpr's equations: one walk for every reader of a traced program (the row
read of `zerojax.adapt.row_mixing`, `verify`'s random draws, the optimizer's padding trace)."""

from __future__ import annotations

from jax.extend import core as jcore


def inner_jaxprs(eqn) -> list:
    """The `Jaxpr`s nested in `eqn`'s parameters (a call's, a scan's body, a cond's branches)."""
    return [j for value in eqn.params.values() for j in _jaxprs(value)]


def _jaxprs(value):
    if isinstance(value, jcore.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jcore.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _jaxprs(v)]
    return []
