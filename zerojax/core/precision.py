"""Dtype policy: which dtype the parameters are stored, computed and reduced in, and the bytes per
parameter each group takes. The one precision model of the library: the trainer, the engines and
the analytic planner all read `Precision`. No JAX import (dtypes come from numpy and ml_dtypes), so
`zerojax plan` starts instantly.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from zerojax.errors import UserError

# The names a config may use, for `precision` and `zero.reduce_dtype`.
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}  # also accepted for `reduce_dtype` by the Python API


@dataclass(frozen=True)
class Precision:
    name: str
    master_dtype: np.dtype  # the optimizer updates this copy
    compute_dtype: np.dtype  # forward and backward run in this dtype; parameters are gathered in it
    reduce_dtype: np.dtype  # gradients are reduced across devices in this dtype

    @property
    def separate_compute_copy(self) -> bool:
        """True when compute params are a low-precision copy of the master, not the master itself."""
        return self.compute_dtype != self.master_dtype

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter of the copy forward and backward read (and parameter collectives move)."""
        return self.compute_dtype.itemsize

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of a separate fp32 master; 0 when the params are the fp32 master."""
        return self.master_dtype.itemsize if self.separate_compute_copy else 0

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of a gradient (computed in the compute dtype)."""
        return self.compute_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes per parameter a gradient reduction moves."""
        return self.reduce_dtype.itemsize


def get_precision(name: str, reduce_dtype: str | None = None) -> Precision:
    if name not in DTYPES:
        raise UserError(f"precision must be 'fp32' or 'bf16', got {name!r}.")
    reduce_dtype = _ALIASES.get(reduce_dtype, reduce_dtype)  # type: ignore[arg-type]
    if reduce_dtype is not None and reduce_dtype not in DTYPES:
        raise UserError(f"zero.reduce_dtype must be fp32, bf16 or null, got {reduce_dtype!r}.")
    compute = DTYPES[name]
    reduce = DTYPES[reduce_dtype] if reduce_dtype else compute
    return Precision(name, DTYPES["fp32"], compute, reduce)


PRECISIONS: dict[str, Precision] = {name: get_precision(name) for name in DTYPES}


def cast_tree(tree, dtype):
    """Cast floating leaves to `dtype`; integer leaves are left alone."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
