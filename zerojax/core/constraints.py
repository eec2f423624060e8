"""Logical names on activations (Flax's `nn.with_logical_constraint`): where a model says what its
activations' dimensions are, the engine's mesh and axis rules turn the names into a sharding.

    x = zj.with_logical_constraint(x, ("batch", "seq", "embed"))

`batch` is the data-parallel axes; any other name goes through the same rules as the parameters'
(`zerojax.core.axis_rules`). With sequence parallelism (`mesh.sequence_parallel`, the rule seq -> tensor),
the residual stream between blocks is split over `tensor` along the sequence: norms and dropout run
on a slice, and XLA turns each block's all-reduce into a reduce-scatter and an all-gather.

The constraints apply only while an engine runs the model on a mesh with a `tensor` axis; elsewhere
(and outside zerojax) they return `x` unchanged, so a model carries them at no cost.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core.axis_rules import mesh_axes
from zerojax.core.mesh import BATCH_AXES, TENSOR_AXIS

SEQUENCE_PARALLEL_RULES = {"seq": TENSOR_AXIS}  # what `mesh.sequence_parallel: true` adds to the rules


@dataclass(frozen=True)
class _Active:
    mesh: object  # a concrete mesh (GSPMD), or None inside a shard_map: its abstract mesh
    rules: Mapping[str, str | None]

    def spec(self, names: tuple) -> P:
        batch = BATCH_AXES if self.mesh is not None else None  # manual inside a shard_map: already local
        return P(*(batch if n == "batch" else _entry(mesh_axes(n, self.rules)) for n in names))


def _entry(axes: tuple[str, ...]):
    """One PartitionSpec entry for a dimension split over `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("zerojax_activation_rules", default=None)


def with_logical_constraint(x: jax.Array, names: tuple) -> jax.Array:
    """`x` constrained to the sharding its dimensions' logical `names` mean on the active mesh."""
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"with_logical_constraint: {len(names)} names {names} for an array of rank {x.ndim}")
    mesh = active.mesh if active.mesh is not None else jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, active.spec(tuple(names))))  # type: ignore[arg-type]


@contextlib.contextmanager
def rules_active(layout, *, manual: bool) -> Iterator[None]:
    """Within the block, `with_logical_constraint` follows `layout`'s mesh and rules (`manual`: the
    model runs inside a shard_map over the batch axes). Nothing is constrained without a tensor axis."""
    if dict(layout.mesh.shape).get(TENSOR_AXIS, 1) == 1:
        yield
        return
    token = _ACTIVE.set(_Active(None if manual else layout.mesh, layout.axis_rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
