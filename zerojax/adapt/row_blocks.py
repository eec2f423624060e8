"""The blocks of a batch's rows a step calls the model and the loss on, as probes compare them.

A step that does not see the whole batch at once splits its rows as (groups, blocks, rows per block),
block i being slice i of every group (`Setup.loss_split`): each device's rows under `shard_map`, each
micro-batch's when accumulating. A probe compares a function of the rows together with the same
function of each block (`zerojax.adapt.loss_rows`, `zerojax.adapt.model_rows`) on a few of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class Blocks:
    """The rows as (groups, blocks, size); a probe uses the first `used_groups` x `used_blocks`."""

    groups: int
    blocks: int
    size: int
    used_groups: int
    used_blocks: int

    @property
    def used_rows(self) -> int:
        return self.used_groups * self.used_blocks * self.size

    def take(self, x) -> np.ndarray:
        """The used rows of `x` (rows first), as (used_groups, used_blocks, size, ...)."""
        x = np.asarray(x).reshape(self.groups, self.blocks, self.size, *np.shape(x)[1:])
        return x[: self.used_groups, : self.used_blocks]

    def rows(self, tree, i: int | None = None):
        """Block i's rows of a tree of `take`n arrays, or (None) every used row, as (rows, ...)."""
        return jax.tree.map(lambda x: (x if i is None else x[:, i : i + 1]).reshape(-1, *x.shape[3:]), tree)

    def by_block(self, tree):
        """Every used block's rows of a tree of `take`n arrays, as (used_blocks, rows of a block, ...):
        block i is `rows(tree, i)`."""
        g, n, s = self.used_groups, self.used_blocks, self.size
        return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(n, g * s, *x.shape[3:]), tree)

    def joined(self, x) -> np.ndarray:
        """`by_block`'s inverse for one array: the blocks' rows in the order of `rows(tree)`."""
        g, n, s = self.used_groups, self.used_blocks, self.size
        return np.asarray(x).reshape(n, g, s, *x.shape[2:]).swapaxes(0, 1).reshape(g * n * s, *x.shape[2:])


def probed_blocks(split: tuple[int, int, str], batch, row_bytes: int, max_blocks: int, max_bytes: int):
    """The `Blocks` a probe of `batch` (rows first in every leaf) compares, or None where there is
    nothing to compare or measure: the step sees every row at once, several processes (each would
    judge its own rows, and one refusing alone would leave the others waiting), an abstract batch, rows
    that do not divide, or more than `max_bytes` at `row_bytes` a row even over two blocks of one group."""
    blocks, groups, _ = split
    leaves = jax.tree.leaves(batch)
    if blocks <= 1 or jax.process_count() > 1 or not leaves or not all(_concrete(x) for x in leaves):
        return None
    rows = int(np.shape(leaves[0])[0]) if np.ndim(leaves[0]) else 0
    if not rows or rows % (blocks * groups) or any(np.shape(x)[:1] != (rows,) for x in leaves):
        return None
    size = rows // (blocks * groups)
    used_blocks, used_groups = min(blocks, max_blocks), groups
    while used_groups > 1 and used_groups * used_blocks * size * row_bytes > max_bytes:
        used_groups //= 2
    while used_blocks > 2 and used_groups * used_blocks * size * row_bytes > max_bytes:
        used_blocks //= 2
    if used_groups * used_blocks * size * row_bytes > max_bytes:
        return None
    return Blocks(groups, blocks, size, used_groups, used_blocks)


def _concrete(x) -> bool:
    if isinstance(x, jax.Array):
        return x.is_fully_addressable and not isinstance(x, jax.core.Tracer)
    return isinstance(x, (np.ndarray, np.generic, int, float))
