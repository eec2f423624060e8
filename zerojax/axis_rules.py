"""Logical axis names on parameters, and the rules that map them to mesh axes (MaxText's
`logical_axis_rules`, Flax's `nn.logical_axis_rules`).

A model names its parameters' dimensions the Flax way (`nnx.with_partitioning(init, ("embed", "mlp"))`,
`nn.with_logical_partitioning`); zerojax reads the names as metadata and lays the arrays out itself.
A rule maps a name to a mesh axis or to None (free for FSDP); a name that is itself a mesh axis means
that axis; a name no rule maps is free for FSDP too, and listed by `zerojax inspect`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from zerojax.errors import UserError
from zerojax.stages import FSDP_AXIS, TENSOR_AXIS

# Megatron's split: attention heads, the MLP's hidden width and the vocabulary over `tensor`; the
# model width (`embed`) stays whole there, so FSDP takes it.
DEFAULT_AXIS_RULES: dict[str, str | None] = {
    "embed": None,
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
}
# The mesh axes a rule may name: the data axis holds whole replicas, so no parameter dimension maps to it.
RULE_TARGETS = (FSDP_AXIS, TENSOR_AXIS)


def as_rules(rules: Mapping[str, str | None] | Iterable | None) -> dict[str, str | None]:
    """Rules from a mapping or (name, axis) pairs (MaxText's list form); None: the defaults."""
    if rules is None:
        return dict(DEFAULT_AXIS_RULES)
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    out: dict[str, str | None] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise UserError(f"an axis rule is a (logical name, mesh axis) pair, got {pair!r}.")
        name, axis = pair
        if axis is not None and axis not in RULE_TARGETS:
            raise UserError(
                f"axis rule {name!r} -> {axis!r}: a rule maps to one of {', '.join(RULE_TARGETS)} "
                "or None (free for FSDP)."
            )
        out[name] = axis
    return out


def mesh_axis(name: str | None, rules: Mapping[str, str | None]) -> str | None:
    """The mesh axis one logical name means: its rule, else itself if it names a rule target."""
    if name is None:
        return None
    if name in rules:
        return rules[name]
    return name if name in RULE_TARGETS else None


def unmapped(names: Iterable[str | None], rules: Mapping[str, str | None]) -> list[str]:
    """The names neither a rule nor a mesh axis: free for FSDP, reported once."""
    return sorted({n for n in names if n is not None and n not in rules and n not in RULE_TARGETS})


def dims(path: str, names: tuple | None, shape: tuple, rules: Mapping[str, str | None], tensor: int = 1):
    """(tensor axis, fsdp axis) of one leaf from its logical names: the dimension mapped to `tensor`
    (None where the mesh has no tensor axis), and one the model maps to `fsdp` itself (else None:
    FSDP takes the largest free dimension).

    Names shorter than the leaf (a stack's layer axis added by a transform) align to its last axes."""
    if not names:
        return None, None
    names = (None,) * (len(shape) - len(names)) + tuple(names)
    axes = [mesh_axis(n, rules) for n in names]
    split = [i for i, a in enumerate(axes) if a == TENSOR_AXIS]
    if len(split) > 1:
        raise UserError(
            f"parameter {path!r} maps {len(split)} dimensions {tuple(names)} to the tensor axis; at most one can be."
        )
    fsdp = next((i for i, a in enumerate(axes) if a == FSDP_AXIS), None)
    if not split or tensor == 1:
        return None, fsdp
    if shape[split[0]] % tensor:
        raise UserError(
            f"parameter {path!r} splits axis {split[0]} ({shape[split[0]]}) over the tensor axis, which "
            f"{tensor} devices do not divide; choose mesh.tensor dividing it."
        )
    return split[0], fsdp
