"""FSDP units for user models: which submodules gather their own parameters when they are called.

Like PyTorch FSDP's auto-wrap policy, a `WrapRule` picks submodules by class. A unit's parameters
are gathered right before its call and (with `reshard_after_forward`) dropped after it; the backward
pass gathers them again (`zerojax.adapt.unit_vjp`). Parameters outside every unit belong to the root and
are gathered once, before the model runs.

The default rule, `WrapRule()`, needs no configuration: every module class that is used more than
once and holds parameters is a unit, outermost first (a transformer's blocks, an MLP's layers).
NNX units are made in `zerojax.adapt.wrap_nnx`, Linen units in `zerojax.adapt.wrap_linen`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from zerojax.core.remat import check as check_remat

Path = tuple[str, ...]
# (["a/b/kernel", ...], their stored values) -> the compute-dtype arrays: the leaves a unit uses
# together, so an engine may move them in one collective
Materialize = Callable[[list[str], list[Any]], list[Any]]
Policy = Any  # "full", "none" or a `jax.checkpoint` policy (`zerojax.core.remat.unit_policy`)


@dataclass(frozen=True)
class WrapRule:
    classes: tuple[type, ...] | None = None  # units by class; None: classes used more than once
    reshard_after_forward: bool = True  # re-gather in backward instead of keeping the weights
    # Which of a unit's activations the backward pass gets without recomputing them: "full" (none:
    # the unit is re-run), "dots" (the weight matmuls' outputs), "none" (all), "offload" (dots', in
    # host memory), or a `jax.checkpoint` policy. None: "full" when resharding (the backward re-runs
    # the unit to gather again anyway), else "none". The gathered weights themselves are never saved;
    # with "none", values the unit computes from them (a cast, a transpose) are, as `jax.vjp` keeps them.
    remat: Any = None

    def __post_init__(self):
        if not callable(self.remat) and self.remat is not None:
            check_remat(self.remat, key="WrapRule.remat")  # a bad name fails here; offload's backend when traced


@dataclass(frozen=True)
class UnitPlan:
    """What an engine asks of a model's units for one step: which submodules gather their own params
    (`units`), how (`materialize` turns leaves used together into whole compute-dtype arrays), and
    when the gathered weights are dropped and gathered again (`zerojax.adapt.unit_vjp`)."""

    units: tuple[Path, ...]
    materialize: Materialize
    param_paths: tuple[Path, ...] = ()  # every parameter leaf (the root gathers those outside units)
    reshard_after_forward: bool = True
    wait_for_grads: bool = False  # a unit's input gradient waits for its reduced parameter gradients
    prefetch: bool = False  # each unit gathers one unit ahead (`zerojax.adapt.ordering.Prefetch`)
    policy: Policy = None  # what a unit saves for its backward (`zerojax.core.remat.unit_policy`)
    loose: frozenset = frozenset()  # unit-owned leaves the model reads outside their unit: the root's
    stacks: tuple[Path, ...] = ()  # lifted layer stacks: units called inside their transform, per layer
    ranks: dict[Path, int] = field(default_factory=dict)  # each leaf's stored rank

    def root_leaves(self) -> list[Path]:
        """The leaves the root gathers once, before the model runs."""
        return [p for p in self.param_paths if owner(p, self.units) is None or p in self.loose]


def as_rule(wrap) -> WrapRule | None:
    """`"auto"` -> the default rule; `None`/`"none"` -> no units (one whole-model gather);
    a class or a tuple of classes -> those classes; a `WrapRule` as is."""
    if isinstance(wrap, WrapRule):
        return wrap
    if wrap is None or wrap is False or wrap == "none":
        return None
    if wrap == "auto":
        return WrapRule()
    classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ValueError(f"wrap must be 'auto', 'none', a module class or a tuple of them, got {wrap!r}")
    return WrapRule(classes)


def choose_units(modules: list[tuple[Path, type, int]], rule: WrapRule) -> list[Path]:
    """Unit paths from `(path, class, parameter leaves in its subtree)` of every non-root module."""
    holding = [(p, c) for p, c, n in modules if p and n > 0]
    if rule.classes is not None:
        return sorted(p for p, c in holding if issubclass(c, rule.classes))
    uses = collections.Counter(c for _, c in holding)
    repeated = [p for p, c in holding if uses[c] > 1]
    return sorted(p for p in repeated if not any(q != p and p[: len(q)] == q for q in repeated))


def owner(leaf: Path, units) -> Path | None:
    """The deepest unit whose subtree holds `leaf`; None: the root's."""
    best = None
    for u in units:
        if leaf[: len(u)] == u and len(leaf) > len(u) and (best is None or len(u) > len(best)):
            best = u
    return best


def describe(units: list[Path], classes: dict[Path, type], rule: WrapRule | None) -> str:
    if not units:
        why = "wrap disabled" if rule is None else "no submodule matched the wrap rule"
        return f"whole model gathered at once ({why})"
    counts = collections.Counter(classes[u].__name__ for u in units)
    kinds = ", ".join(f"{n} x {name}" for name, n in sorted(counts.items()))
    how = "auto: classes used more than once" if rule.classes is None else "by class"  # type: ignore[union-attr]
    return f"FSDP units: {kinds} ({how})"


def sees_one_layer(path: Path, own: dict, ranks: dict[Path, int]) -> bool:
    """Whether a module at `path`, holding `own` ({relative path: value}), sees its params with one
    axis fewer than stored (`ranks`): it is called inside a transform that slices a layer stack."""
    return layers_sliced(path, own, ranks) == 1


def layers_sliced(path: Path, own: dict, ranks: dict[Path, int]) -> int:
    """How many axes fewer than stored (`ranks`) a module at `path`, holding `own` ({relative path:
    value}), sees its params with: 1 inside a transform that slices a layer stack, more inside nested
    ones. A value may be a pair of arrays (stage 2's `Resident`): its arrays' rank counts."""
    for rel, value in own.items():
        full = path + tuple(str(k) for k in rel)
        arrays = [x for x in jax.tree.leaves(value) if hasattr(x, "ndim")]
        if arrays and full in ranks:
            return ranks[full] - arrays[0].ndim
    return 0
