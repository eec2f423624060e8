"""Dtype policy: which dtype the parameters are stored, computed and reduced in."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zerojax.errors import UserError


@dataclass(frozen=True)
class Precision:
    name: str
    master_dtype: jnp.dtype  # the optimizer updates this copy
    compute_dtype: jnp.dtype  # forward and backward run in this dtype
    reduce_dtype: jnp.dtype  # gradients are reduced across devices in this dtype

    @property
    def separate_compute_copy(self) -> bool:
        """True when compute params are a low-precision copy of the master, not the master itself."""
        return jnp.dtype(self.compute_dtype) != jnp.dtype(self.master_dtype)


_DTYPES = {"fp32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}


def get_precision(name: str, reduce_dtype: str | None = None) -> Precision:
    if name not in ("fp32", "bf16"):
        raise UserError(f"precision must be 'fp32' or 'bf16', got {name!r}.")
    if reduce_dtype is not None and reduce_dtype not in _DTYPES:
        raise UserError(f"zero.reduce_dtype must be one of fp32, bf16 (or omitted), got {reduce_dtype!r}.")
    compute = _DTYPES[name]
    reduce = _DTYPES[reduce_dtype] if reduce_dtype else compute
    return Precision(name, jnp.float32, compute, reduce)


def cast_tree(tree, dtype):
    """Cast floating leaves to `dtype`; integer leaves are left alone."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
