"""`TrainState`: the train state as one typed pytree, the groups it is made of, which are saved, and
how the derived compute copy is made.

  step         int32 scalar, replicated
  params       the master parameters (fp32; with fp32 precision also the compute copy)
  opt_state    the optax state; a moment leaf shards like its parameter, counters replicate
  compute      the low-precision compute copy where it is kept persistently (bf16, stages 0-2),
               else None; derived from `params`, so never saved
  rng          the training PRNG key's raw data (dropout masks), derived from the init key (`run_key`)
  model_state  non-trainable model state that training updates (BatchNorm statistics), or None

A sharded group stores leaves in their padded shape, a replicated group in their logical shape (see
`zerojax.core.layout`). A group of None has no leaves: it costs nothing in `jit`, shardings or checkpoints.
Where a group lives is said by its shardings alone, so a host-resident group (a `memory_kind` of
"pinned_host") needs no change here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct


def run_key(key) -> jax.Array:
    """The training RNG the state carries (raw uint32 key data, so it checkpoints like any leaf):
    derived from the init key, apart from the key that initialised the params."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return jax.random.key_data(jax.random.fold_in(key, 0x7A3A))


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

    if TYPE_CHECKING:  # added by `flax.struct.dataclass`

        def replace(self, **changes: Any) -> TrainState: ...

    # The groups a checkpoint holds, in this order; "compute" is rebuilt from "params" instead.
    SAVED: ClassVar[tuple[str, ...]] = ("step", "params", "opt_state", "rng", "model_state")

    def saved(self) -> dict:
        """The groups a checkpoint holds, as a dict (groups that are None are left out)."""
        return {k: getattr(self, k) for k in self.SAVED if getattr(self, k) is not None}

    @classmethod
    def from_saved(cls, saved: dict) -> TrainState:
        """The state from restored groups; the compute copy is still missing (see `StateLayout.derive_compute`)."""
        unknown = set(saved) - set(cls.SAVED)
        if unknown:
            raise ValueError(f"not a saved train-state group: {sorted(unknown)}")
        return cls(**saved)
