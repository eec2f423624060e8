"""A BatchNorm's statistics are the global batch's in every engine.

Under `shard_map` each device runs the model on its own rows, so a BatchNorm without an `axis_name`
is given the batch axes (`sync`) to average over, which makes its statistics the global batch's, as
they are under `gspmd`, where the model sees the whole batch. A Linen BatchNorm whose author named
the axis of a data-parallel `pmap` (Flax's ImageNet example: `axis_name='batch'`), which nothing
around it binds here, means the same batch: it gets `sync` too, or no axis under `gspmd`. A name the
model's own transform binds (`nn.vmap(..., axis_name=...)`, an ensemble's) is kept, with `sync` added
under `shard_map`. Values are those of the model on the global batch.
"""

from __future__ import annotations

import contextlib
import re

import jax
from flax import linen as nn
from flax import nnx

from zerojax.errors import UserError


def linen(sync):
    """A context in which every `nn.BatchNorm` averages over `sync` (None: over nothing, the rows it is
    given being the whole batch) and over its own `axis_name` where the model's transform binds it;
    an own axis nothing binds is dropped."""

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, nn.BatchNorm):
            own = _names(m.axis_name) if m.axis_name is not None and _bound(m.axis_name) else ()
            object.__setattr__(m, "axis_name", _joined(own, sync))
        return next_fun(*args, **kwargs)

    return nn.intercept_methods(interceptor)


def nnx_sync(module: nnx.Module, sync) -> None:
    """Every `nnx.BatchNorm` in `module` averages over `sync` (when given) too: over it alone without an
    axis of its own, else over its own and `sync`. An NNX module's call cannot be intercepted, so an
    own axis is kept whether or not the model's transform binds it; where nothing does, the call fails
    and `unbound_refused` says so."""
    if sync:
        for _, node in nnx.iter_graph(module):
            if isinstance(node, nnx.BatchNorm):
                node.axis_name = _joined(_names(node.axis_name) if node.axis_name is not None else (), sync)


@contextlib.contextmanager
def unbound_refused():
    """A model that reduces over an axis name nothing binds (an NNX BatchNorm's `axis_name='batch'`,
    its own `lax.pmean(x, 'batch')`, written for `pmap`): one `UserError` instead of JAX's NameError."""
    try:
        yield
    except NameError as error:
        found = re.search(r"unbound axis name: ([^\s]+?)\.?(\s|$)", str(error))
        if found is None:
            raise
        raise UserError(
            f"the model reduces over the axis {found.group(1)!r}, which nothing binds here: zerojax runs it on the "
            "whole batch under gspmd and on each device's rows under shard_map, and gives a BatchNorm without an "
            "axis_name the global batch's statistics in both; drop the axis name (axis_name=None)."
        ) from error


def _names(name) -> tuple:
    return tuple(name) if isinstance(name, tuple | list) else (name,)


def _joined(own: tuple, sync):
    """A BatchNorm's axes: its own bound ones, then the batch axes `sync` (None: none)."""
    axes = (*own, *(_names(sync) if sync else ()))
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _bound(name) -> bool:
    """Whether every axis in `name` (one or a tuple) is bound where this runs (traced)."""
    for axis in _names(name):
        try:
            jax.lax.axis_index(axis)
        except NameError:
            return False
    return True
