"""Checksums of saved leaves: a wrapping sum of their bit patterns, exact in any reduction order, to
which zero padding adds nothing (so a leaf's sum does not depend on its layout). Computed on the
devices where the shards live, or on the host for a leaf read back."""

from __future__ import annotations

import functools

import jax
import numpy as np


def _bits(dtype):
    # Saved leaves are 32-bit but for frozen parameters, kept in a 16-bit compute dtype.
    return np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32


def _sum_bits(x):
    import jax.numpy as jnp

    return jnp.sum(jax.lax.bitcast_convert_type(x, _bits(x.dtype)), dtype=jnp.uint32)


@functools.lru_cache(maxsize=8)
def _checksum_fn(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    # Replicated results: every process can read them, also in a multi-process run.
    return jax.jit(lambda tree: jax.tree.map(_sum_bits, tree), out_shardings=NamedSharding(mesh, PartitionSpec()))


def device_checksums(tree) -> list[int]:
    """One checksum per leaf of `tree` (jax.Arrays), computed where the shards live."""
    sums = _checksum_fn(jax.tree.leaves(tree)[0].sharding.mesh)(tree)
    return [int(c) for c in jax.device_get(jax.tree.leaves(sums))]


def host_checksum(x: np.ndarray) -> int:
    """The checksum of one leaf on the host, as `device_checksums` computes it."""
    return int(np.ascontiguousarray(x).view(_bits(x.dtype)).sum(dtype=np.uint64) % 2**32)
