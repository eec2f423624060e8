"""A user's model traced under zerojax's mesh, so that JAX's own sharding API inside it means that mesh.

Models written the way JAX's and Flax's sharding guides write them name mesh axes themselves:
`jax.lax.with_sharding_constraint(h, P(("data", "fsdp"), None))`, Linen's `nn.with_logical_constraint`
under `nn.logical_axis_rules`, `out_sharding=` arguments of NNX layers and `jnp.einsum`. Each needs a
mesh as context while the model is traced. `ModelMesh.active()` is that context; `FunctionalModel.
on_mesh` enters it around every trace of the model (init, step, evaluate, verify, the checks and probes):

- zerojax's mesh is the context mesh (`jax.sharding.use_abstract_mesh`), so a bare `PartitionSpec`
  resolves against it; inside the shard_map engine's region the region's own mesh stays the context.
- Each name in a user's spec goes through the axis rules (`zerojax.core.axis_rules`): a mesh axis means
  itself, any other name its rule (a model written for "model" or "dp" needs no edit:
  `axis_rules={"model": "tensor", "dp": ["data", "fsdp"]}`); a name that is neither is one `UserError`
  naming it and the rule that would map it. `batch` means the data-parallel axes unless a rule says else.
- Flax's logical rules are those active when the trainer was built, else zerojax's own rules, so
  `nn.with_logical_constraint` and `zj.with_logical_constraint` mean the same axes.
- Inside the shard_map engine's region, manual over the batch axes, those axes are dropped from a
  user's constraint: the local batch is already split over them. Constraints over `tensor` keep
  their meaning.
- `out_sharding=` of an operation is left to the partitioner (its names still checked): JAX honours
  it only on Explicit mesh axes, and zerojax's mesh is Auto (sharding propagation, the engines'
  constraints).

What was dropped is listed in `Trainer.gather_report().notes`. The interception swaps JAX's
`with_sharding_constraint` and its `out_sharding` resolution (every module holding either name) for
the duration of a trace, and puts them back after; outside a trace nothing is changed.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core.axis_rules import mesh_axes, unknown
from zerojax.core.mesh import BATCH_AXES
from zerojax.errors import UserError

try:  # the one place every `out_sharding=` argument is resolved; absent in some jax, then nothing changes
    from jax._src.sharding_impls import canonicalize_sharding as _canonicalize_sharding
except ImportError:  # pragma: no cover
    _canonicalize_sharding = None

_with_sharding_constraint = jax.lax.with_sharding_constraint

_ACTIVE: contextvars.ContextVar[ModelMesh | None] = contextvars.ContextVar("zerojax_model_mesh", default=None)


@dataclass(frozen=True, eq=False)
class ModelMesh:
    """The mesh and rules a user's model is traced under (one per `Setup`), and what its traces dropped."""

    mesh: Any
    rules: Mapping[str, Any]  # zerojax's axis rules (`zerojax.core.axis_rules.as_rules`)
    flax_rules: tuple = ()  # Flax's logical axis rules active when the trainer was built
    notes: set = field(default_factory=set)  # what traces dropped from the model's own shardings

    @classmethod
    def of(cls, mesh, rules: Mapping[str, Any]) -> ModelMesh:
        from flax.linen import get_logical_axis_rules

        return cls(mesh, {"batch": BATCH_AXES, **rules}, tuple(get_logical_axis_rules() or ()))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Trace the model's code inside this block (nested blocks and other threads are left as they are)."""
        from flax.linen import get_logical_axis_rules, logical_axis_rules

        with contextlib.ExitStack() as stack:
            if jax.sharding.get_abstract_mesh().empty or not _manual_axes():
                stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
            if not get_logical_axis_rules():
                stack.enter_context(logical_axis_rules(self.flax_rules or self._as_flax_rules()))
            token = _ACTIVE.set(self)
            stack.callback(_ACTIVE.reset, token)
            stack.enter_context(_swapped())
            yield

    def _as_flax_rules(self) -> tuple:
        return tuple((name, target) for name, target in self.rules.items())

    def spec(self, spec, what: str, note: bool = True) -> P:
        """A user's spec in zerojax's mesh axes: names through the rules, the region's manual axes dropped."""
        manual, used = _manual_axes(), set()
        entries: list[Any] = []
        for entry in spec:
            if entry is P.UNCONSTRAINED:
                entries.append(entry)
                continue
            bad = unknown(entry, self.rules)
            if bad:
                raise UserError(
                    f"the model's {what} names mesh axis {bad[0]!r}, which zerojax's mesh "
                    f"({', '.join(self.mesh.axis_names)}) does not have and no axis rule maps; add a rule, "
                    f"e.g. axis_rules={{{bad[0]!r}: 'tensor'}} (config: mesh.rules), or None to leave it unsplit."
                )
            axes = [a for a in mesh_axes(entry, self.rules) if a not in used]
            kept = [a for a in axes if a not in manual]
            dropped = [a for a in axes if a in manual and self.mesh.shape[a] > 1]
            if dropped and note:
                self.notes.add(
                    f"{what} over {', '.join(dropped)}: dropped inside the shard_map region, which is manual "
                    "over those axes (each device's block is already split over them)"
                )
            used.update(axes)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
        return P(*entries)

    def constraint(self, sharding):
        """One leaf of a user's `with_sharding_constraint` shardings, in zerojax's mesh."""
        if isinstance(sharding, NamedSharding):
            if _ours(sharding.mesh, self.mesh):
                return sharding  # zerojax's own constraints, or a model already written for this mesh
            return self.spec(sharding.spec, "sharding constraint")
        if isinstance(sharding, P):
            return self.spec(sharding, "sharding constraint")
        return sharding


def _ours(mesh, ours) -> bool:
    return mesh is ours or mesh == ours or getattr(mesh, "abstract_mesh", mesh) == ours.abstract_mesh


def _manual_axes() -> frozenset:
    """The axes the enclosing shard_map region is manual over (none outside one)."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (P, jax.sharding.Sharding))


def with_sharding_constraint(x, shardings):
    """`jax.lax.with_sharding_constraint` as a model traced under a `ModelMesh` sees it."""
    active = _ACTIVE.get()
    if active is not None:
        shardings = jax.tree.map(active.constraint, shardings, is_leaf=_is_spec_leaf)
    return _with_sharding_constraint(x, shardings)


def canonicalize_sharding(sharding, api_name, *args, **kwargs):
    """JAX's resolution of an `out_sharding=` argument, as a model traced under a `ModelMesh` sees it:
    the user's names checked, the choice left to the partitioner (zerojax's mesh axes are Auto)."""
    active = _ACTIVE.get()
    if active is not None and _users(sharding, active.mesh):
        spec = sharding if isinstance(sharding, P) else sharding.spec
        active.spec(spec, f"out_sharding of {api_name}", note=False)  # checks its names
        active.notes.add(f"out_sharding= of {api_name}: left to the partitioner (zerojax's mesh axes are Auto)")
        return None
    return _canonicalize_sharding(sharding, api_name, *args, **kwargs)


def _users(sharding, mesh) -> bool:
    """A sharding the user's code wrote: a spec naming an axis, or a NamedSharding on a mesh of other
    axis names (JAX's own calls pass shardings on zerojax's mesh, or on the shard_map region's)."""
    if isinstance(sharding, P):
        return any(entry is not None and entry is not P.UNCONSTRAINED for entry in sharding)
    if not isinstance(sharding, NamedSharding):
        return False
    names = tuple(sharding.mesh.axis_names)
    return bool(names) and names != tuple(mesh.axis_names)


# ---- the swap -------------------------------------------------------------------------------------

_SWAPS = ((_with_sharding_constraint, with_sharding_constraint), (_canonicalize_sharding, canonicalize_sharding))
_lock = threading.Lock()
_depth = 0
_sites: list = []  # (module dict, name, original) of every module holding an original
_seen_modules = -1


def _find_sites() -> list:
    """Every module attribute holding one of the originals (`from jax.lax import with_sharding_constraint`
    in a user's module too); looked up again only when modules were imported since."""
    global _sites, _seen_modules
    if len(sys.modules) != _seen_modules:
        originals = {id(o): o for o, _ in _SWAPS if o is not None}
        sites = []
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict) or names is globals():  # this module keeps the originals
                continue
            for name, value in list(names.items()):
                if id(value) in originals and value is originals[id(value)]:
                    sites.append((names, name, value))
        _sites, _seen_modules = sites, len(sys.modules)
    return _sites


@contextlib.contextmanager
def _swapped() -> Iterator[None]:
    global _depth
    with _lock:
        if _depth == 0:
            replacement = {id(o): r for o, r in _SWAPS if o is not None}
            for names, name, original in _find_sites():
                names[name] = replacement[id(original)]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for names, name, original in _sites:
                    names[name] = original
