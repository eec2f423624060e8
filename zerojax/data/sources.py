"""Batch sources: where `zj.fit` and `zerojax train` get each step's global batch.

The protocol (duck-typed, nothing to inherit):

    source.batch(step) -> {"inputs": np.ndarray, "targets": np.ndarray, ...}

returns the *global* batch of `step` (every process sees the same rows), as a pure function of the
source's seed and `step`: a resumed run asks for step k and gets exactly the batch the uninterrupted
run trained on, which is what makes `--resume` exact. Two optional members let a source do less work:

    source.rows(step, start, stop) -> dict    rows start..stop of that batch only (each process
                                             builds only the rows its devices own); needs
    source.batch_size                        the global batch size (rows per step)
    source.global_batch(step, sharding)      the batch already as sharded `jax.Array`s

Adapters here: `ArraySource` (in-memory or memory-mapped arrays, e.g. `np.load(..., mmap_mode="r")`
token files or image arrays: only the rows a step draws are read) and `IterableSource` (any iterator
of batches; see its resume caveat). The byte corpus `zerojax.data.corpus.BatchStream` is a source too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zerojax.errors import UserError


@runtime_checkable
class BatchSource(Protocol):
    def batch(self, step: int) -> dict[str, np.ndarray]: ...


def is_source(obj: Any) -> bool:
    return callable(getattr(obj, "batch", None)) or callable(getattr(obj, "global_batch", None))


def _check(batch: Any, source: Any, step: int) -> dict:
    if not isinstance(batch, Mapping) or "inputs" not in batch:
        raise UserError(
            f"the batch source {type(source).__name__} returned {type(batch).__name__} for step {step}; "
            "batch(step) must return a dict of arrays with at least an 'inputs' entry."
        )
    return dict(batch)


def _host(batch: Mapping) -> dict:
    """Each value of `batch` (an array or a pytree of arrays) as NumPy arrays."""
    import jax

    return {k: jax.tree.map(np.asarray, v) for k, v in batch.items()}


def host_batch(source: Any, step: int) -> dict[str, np.ndarray]:
    """The whole global batch of `step` as NumPy arrays on this host."""
    if callable(getattr(source, "batch", None)):
        return _host(_check(source.batch(step), source, step))
    if callable(getattr(source, "rows", None)):
        return _host(_check(source.rows(step, 0, source.batch_size), source, step))
    raise UserError(f"{type(source).__name__} is not a batch source: it has no batch(step) method.")


def global_batch(source: Any, step: int, sharding) -> dict:
    """The batch of `step` as global `jax.Array`s split by `sharding` over their first axis; with
    `rows`, each process builds only the rows its addressable devices own."""
    import jax

    if callable(getattr(source, "global_batch", None)):
        return source.global_batch(step, sharding)
    if callable(getattr(source, "rows", None)) and getattr(source, "batch_size", None):
        n = int(source.batch_size)
        spans = [
            idx[0].indices(n)[:2] if idx else (0, n) for idx in sharding.addressable_devices_indices_map((n,)).values()
        ]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        local = _host(_check(source.rows(step, lo, hi), source, step))

        def make(value: np.ndarray):
            shape = (n, *value.shape[1:])

            def shard(index):
                start, stop, _ = (index[0] if index else slice(None)).indices(n)
                return value[start - lo : stop - lo][(slice(None), *index[1:])]

            return jax.make_array_from_callback(shape, sharding, shard)

        return {k: jax.tree.map(make, v) for k, v in local.items()}
    whole = lambda v: jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])  # noqa: E731
    return {k: jax.tree.map(whole, v) for k, v in host_batch(source, step).items()}


def example_batch(source: Any) -> dict[str, np.ndarray]:
    """Step 0's batch (host arrays): shapes and dtypes for init, planning and inspection."""
    return host_batch(source, 0)


class ArraySource:
    """Batches drawn from arrays with a common first axis (in memory or `np.memmap`).

    Each epoch visits every example once in an order shuffled by (seed, epoch); step s takes the
    examples s * batch_size ... (s + 1) * batch_size - 1 of that endless sequence, so a batch is a
    pure function of (seed, step). `shuffle=False` walks the arrays in order. Only the rows a step
    draws are read, so a memory-mapped token or image file is never loaded whole.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], *, batch_size: int, seed: int = 0, shuffle: bool = True):
        if "inputs" not in arrays:
            raise UserError(f"ArraySource needs an 'inputs' array; got {', '.join(arrays) or 'none'}.")
        import jax

        # each array, or each leaf of a pytree of arrays (a model's several inputs), by its path
        lengths = {
            f"{k}{jax.tree_util.keystr(p)}": len(x)
            for k, v in arrays.items()
            for p, x in jax.tree_util.tree_flatten_with_path(v)[0]
        }
        if len(set(lengths.values())) != 1:
            raise UserError(f"ArraySource arrays must have the same number of rows, got {lengths}.")
        self.size = next(iter(lengths.values()))
        if batch_size < 1 or self.size < 1:
            raise UserError(
                f"ArraySource needs batch_size >= 1 and at least one row, got batch_size={batch_size}, "
                f"{self.size} rows."
            )
        self.arrays, self.batch_size, self.seed, self.shuffle = dict(arrays), batch_size, seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    @classmethod
    def from_npy(cls, paths: Mapping[str, str], **kwargs) -> ArraySource:
        """Memory-mapped `.npy` files, e.g. {"inputs": "x.npy", "targets": "y.npy"}."""
        return cls({k: np.load(p, mmap_mode="r") for k, p in paths.items()}, **kwargs)

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size))
        return self._perm[1]

    def indices(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.batch_size if stop is None else stop
        flat = step * self.batch_size + np.arange(start, stop)
        if not self.shuffle:
            return flat % self.size
        out = np.empty(len(flat), dtype=np.int64)
        epochs = flat // self.size
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._order(int(epoch))[flat[sel] % self.size]
        return out

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        idx = self.indices(step, start, stop)
        order = np.argsort(idx, kind="stable")  # memmaps read fastest in file order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        import jax

        return {k: jax.tree.map(lambda x: np.asarray(x[idx[order]])[inverse], v) for k, v in self.arrays.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.batch_size)


class IterableSource:
    """A source over any iterator of global batches, `make_iter()` called to (re)start it.

    Resume caveat: an iterator has no random access, so asking for step k after a restart replays
    (and discards) the first k batches, and the batches are only the same as in the uninterrupted run
    if `make_iter()` yields the same sequence every time (seeded, no wall-clock or worker-order
    dependence). Prefer `ArraySource` or a source with `batch(step)` for long runs.
    """

    def __init__(self, make_iter: Callable[[], Iterable[Mapping[str, Any]]]):
        self._make = make_iter
        self._it: Iterator | None = None
        self._next = 0  # the step the iterator yields next
        self._last: tuple[int, dict] | None = None

    def batch(self, step: int) -> dict[str, np.ndarray]:
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self._it is None or step < self._next:
            self._it, self._next = iter(self._make()), 0
        try:
            while self._next < step:  # replay up to the step
                next(self._it)
                self._next += 1
            out = next(self._it)
        except StopIteration:
            raise UserError(
                f"the iterable batch source ended before step {step}; give one that yields at least "
                "train.steps batches."
            ) from None
        self._next += 1
        self._last = (step, _host(_check(out, self, step)))
        return self._last[1]


def items_per_step(inputs) -> int:
    """What tokens_per_s counts: tokens for integer token-id inputs [batch, seq, ...], else examples
    (rows, for inputs that are a pytree of arrays)."""
    if not hasattr(inputs, "shape"):
        import jax

        return int(np.shape(jax.tree.leaves(inputs)[0])[0])
    shape = tuple(inputs.shape)
    if len(shape) >= 2 and np.issubdtype(np.dtype(inputs.dtype), np.integer):
        return int(math.prod(shape[:2]))
    return int(shape[0])
