"""`TrainState`: the train state as one typed pytree, the groups it is made of, which are saved, and
how the derived compute copy is made.

  step         int32 scalar, replicated
  params       the master parameters (fp32; with fp32 precision also the compute copy)
  opt_state    the optax state; a moment leaf shards like its parameter, counters replicate
  compute      the low-precision compute copy where it is kept persistently (bf16, stages 0-2),
               else None; derived from `params`, so never saved
  rng          reserved: a training PRNG key (dropout), saved once it exists; None today
  model_state  reserved: non-trainable model state that training updates (BatchNorm statistics),
               saved once it exists; None today

A sharded group stores leaves in their padded shape, a replicated group in their logical shape (see
`zerojax.layout`). A group of None has no leaves: it costs nothing in `jit`, shardings or checkpoints.
Where a group lives is said by its shardings alone, so a host-resident group (a `memory_kind` of
"pinned_host") needs no change here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from zerojax.precision import cast_tree

if TYPE_CHECKING:
    import optax

    from zerojax.layout import StateLayout


# Fields in name order, as a dict of the groups would flatten: the jitted step's argument order (and
# with it XLA's buffer assignment) stays that of the untyped state this class replaced.
@struct.dataclass(kw_only=True)
class TrainState:
    compute: Any = None
    model_state: Any = None
    opt_state: Any
    params: Any
    rng: Any = None
    step: Any

    # The groups a checkpoint holds, in this order; "compute" is rebuilt from "params" instead.
    SAVED: ClassVar[tuple[str, ...]] = ("step", "params", "opt_state", "rng", "model_state")

    def saved(self) -> dict:
        """The groups a checkpoint holds, as a dict (groups that are None are left out)."""
        return {k: getattr(self, k) for k in self.SAVED if getattr(self, k) is not None}

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainState":
        """The state from restored groups; the compute copy is still missing (see `derive_compute`)."""
        unknown = set(saved) - set(cls.SAVED)
        if unknown:
            raise ValueError(f"not a saved train-state group: {sorted(unknown)}")
        return cls(**saved)


def derive_compute(layout: "StateLayout", params):
    """The persistent compute copy of master `params`: logical shapes, compute dtype, replicated."""
    return cast_tree(layout.to_layout(params, sharded=False), layout.precision.compute_dtype)


def fresh_state(layout: "StateLayout", tx: "optax.GradientTransformation", params) -> TrainState:
    """Step 0 from logical params (any dtype): master, optimizer and compute groups in their layouts."""
    params = jax.tree.map(lambda x: x.astype(layout.precision.master_dtype), params)
    compute = None
    if layout.keeps_compute_copy:
        compute = jax.tree.map(lambda x: x.astype(layout.precision.compute_dtype), params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=layout.to_layout(params, layout.master_sharded),
        opt_state=tx.init(layout.to_opt(params)),
        compute=compute,
    )
