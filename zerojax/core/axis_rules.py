"""Logical axis names on parameters, and the rules that map them to mesh axes (MaxText's
`logical_axis_rules`, Flax's `nn.logical_axis_rules`).

A model names its parameters' dimensions the Flax way (`nnx.with_partitioning(init, ("embed", "mlp"))`,
`nn.with_logical_partitioning`); zerojax reads the names as metadata and lays the arrays out itself.
A rule maps a name to a mesh axis or to None (free for FSDP); a name that is itself a mesh axis means
that axis; a name no rule maps is free for FSDP too, and listed by `zerojax inspect`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zerojax.core.mesh import AXES, DATA_AXIS, FSDP_AXIS, TENSOR_AXIS
from zerojax.errors import UserError

# Megatron's split: attention heads, the MLP's hidden width and the vocabulary over `tensor`; the
# model width (`embed`) stays whole there, so FSDP takes it.
DEFAULT_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": None,
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
}
# What a rule may map a name to: a mesh axis, several (a dimension split over their product, like
# `P(("data", "fsdp"))`), or None. A model written for other mesh-axis names ("model", "mp", "dp")
# maps them the same way: {"model": "tensor", "dp": ["data", "fsdp"]}.
RULE_TARGETS = AXES


def as_rules(rules: Mapping[str, Any] | Iterable | None) -> dict[str, str | tuple[str, ...] | None]:
    """Rules from a mapping or (name, axis) pairs (MaxText's list form); None: the defaults."""
    if rules is None:
        return dict(DEFAULT_AXIS_RULES)
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    out: dict[str, str | tuple[str, ...] | None] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise UserError(f"an axis rule is a (logical name, mesh axis) pair, got {pair!r}.")
        name, axis = pair
        axes = (
            (axis,) if axis is None or isinstance(axis, str) else tuple(axis) if isinstance(axis, (list, tuple)) else ()
        )
        several = len(axes) > 1 and (None in axes or len(set(axes)) < len(axes))
        if not axes or several or any(a is not None and a not in RULE_TARGETS for a in axes):
            raise UserError(
                f"axis rule {name!r} -> {axis!r}: a rule maps to one of {', '.join(RULE_TARGETS)}, a list of "
                "them, or None (free for FSDP)."
            )
        out[name] = axes[0] if len(axes) == 1 else axes
    return out


def mesh_axes(name, rules: Mapping[str, Any]) -> tuple[str, ...]:
    """The mesh axes one entry of a sharding spec or of a leaf's names means: a mesh axis itself, else
    its rule; `name` may be a tuple of names (their axes in order). () for None and for a name that is
    neither (see `unknown`)."""
    if name is None:
        return ()
    if isinstance(name, (tuple, list)):
        return tuple(a for n in name for a in mesh_axes(n, rules))
    if name in RULE_TARGETS:
        return (name,)
    target = rules.get(name)
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def unknown(name, rules: Mapping[str, Any]) -> list[str]:
    """The names in one spec entry that are neither a mesh axis nor mapped by a rule."""
    if isinstance(name, (tuple, list)):
        return [u for n in name for u in unknown(n, rules)]
    return [] if name is None or name in RULE_TARGETS or name in rules else [name]


def unmapped(names: Iterable, rules: Mapping[str, Any]) -> list[str]:
    """The names neither a rule nor a mesh axis: free for FSDP, reported once."""
    return sorted({u for n in names for u in unknown(n, rules)})


def dims(path: str, names: tuple | None, shape: tuple, rules: Mapping[str, Any], tensor: int = 1):
    """(tensor axis, fsdp axis) of one leaf from its logical names: the dimension mapped to `tensor`
    (None where the mesh has no tensor axis), and one the model maps to `fsdp` itself (else None:
    FSDP takes the largest free dimension).

    Names shorter than the leaf (a stack's layer axis added by a transform) align to its last axes."""
    if not names:
        return None, None
    names = (None,) * (len(shape) - len(names)) + tuple(names)
    axes = [mesh_axes(n, rules) for n in names]
    for i, (n, a) in enumerate(zip(names, axes)):
        # The data axis holds whole replicas: a dimension mapped to it and fsdp (a model written for one
        # "dp" axis that carries both the batch and the FSDP shards) is an fsdp dimension.
        if a == (DATA_AXIS,) or (TENSOR_AXIS in a and FSDP_AXIS in a):
            raise UserError(
                f"parameter {path!r} maps axis {i} ({n!r}) to {a}: a parameter dimension goes to fsdp, to "
                "tensor or to neither (the data axis holds whole replicas); change its axis rule."
            )
    split = [i for i, a in enumerate(axes) if TENSOR_AXIS in a]
    if len(split) > 1:
        raise UserError(
            f"parameter {path!r} maps {len(split)} dimensions {tuple(names)} to the tensor axis; at most one can be."
        )
    fsdp = next((i for i, a in enumerate(axes) if FSDP_AXIS in a), None)
    if not split or tensor == 1:
        return None, fsdp
    if shape[split[0]] % tensor:
        raise UserError(
            f"parameter {path!r} splits axis {split[0]} ({shape[split[0]]}) over the tensor axis, which "
            f"{tensor} devices do not divide; choose mesh.tensor dividing it."
        )
    return split[0], fsdp
