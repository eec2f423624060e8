"""Training batches from token files (`zerojax tokenize`; config key `data.tokens`).

The shards are memory-mapped; each is cut into fixed windows of seq_len + 1 tokens, documents packed
back to back with the end-of-document token between them (a shard's last partial window is
dropped). Step s takes the windows s * batch ... (s + 1) * batch - 1 of an endless sequence that
visits every window once per epoch, in an order shuffled by (seed, epoch): a batch is a pure
function of (seed, step), and `rows(step, start, stop)` reads only the rows asked for, so each
process reads only the rows its devices own and a resumed run reads exactly what the uninterrupted
run would have.

No data-loader framework (grain, tf.data) is used: random access by step already gives an exact
resume and per-process rows without any iterator state to checkpoint, and a memory-mapped read of
a few rows per step needs no worker pool.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from zerojax.data.corpus import VOCAB_SIZE
from zerojax.data.sources import ArraySource
from zerojax.data.token_files import read_index
from zerojax.errors import UserError


class TokenSource:
    """A batch source (`zerojax.data.sources`) over windows first..last - 1 of a token folder."""

    def __init__(
        self,
        folder: str,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        windows: tuple[int, int] | None = None,
        index: dict | None = None,
    ):
        folder = os.path.abspath(folder)
        index = read_index(folder) if index is None else index
        dtype = np.dtype(index["dtype"])
        self.shards = [np.memmap(os.path.join(folder, s["file"]), dtype=dtype, mode="r") for s in index["shards"]]
        self.seq_len, self.batch_size, self.seed = seq_len, global_batch, seed
        per_shard = [len(s) // (seq_len + 1) for s in self.shards]
        self.starts = np.cumsum([0, *per_shard])  # the first window of each shard
        first, last = windows if windows is not None else (0, int(self.starts[-1]))
        if last - first < 1:
            raise UserError(
                f"data.tokens={folder!r} has no window of seq_len + 1 = {seq_len + 1} tokens to train on "
                f"({int(self.starts[-1])} in all, {last - first} here); tokenize more text or shorten model.seq_len."
            )
        self.first = first
        # ArraySource's epoch-shuffled order, over window numbers instead of rows of data.
        self.order = ArraySource({"inputs": range(last - first)}, batch_size=global_batch, seed=seed)  # type: ignore[dict-item]

    def window(self, number: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, number, side="right")) - 1
        offset = (number - int(self.starts[shard])) * (self.seq_len + 1)
        return self.shards[shard][offset : offset + self.seq_len + 1]

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows start..stop of the step's global batch; only those windows are read."""
        numbers = self.order.indices(step, start, stop) + self.first
        window_RxL1 = np.stack([self.window(int(n)) for n in numbers]).astype(np.int32)
        return {"inputs": window_RxL1[:, :-1], "targets": window_RxL1[:, 1:]}

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """The whole [global_batch, seq_len] batch on this host (single-process use and tests)."""
        return self.rows(step, 0, self.batch_size)

    batch = host_batch  # the batch-source protocol (zerojax.data.sources)


def token_sources(
    folder: str, *, seq_len: int, global_batch: int, seed: int, eval_fraction: float
) -> tuple[TokenSource, TokenSource | None]:
    """(train, eval or None): eval holds the last `eval_fraction` of the windows, seeded seed + 1."""
    index = read_index(folder)
    make: dict[str, Any] = dict(seq_len=seq_len, global_batch=global_batch, index=index)
    whole = TokenSource(folder, seed=seed, **make)
    total = int(whole.starts[-1])
    n_eval = int(round(total * eval_fraction))
    if not n_eval:
        return whole, None
    train = TokenSource(folder, seed=seed, windows=(0, total - n_eval), **make)
    return train, TokenSource(folder, seed=seed + 1, windows=(total - n_eval, total), **make)


def model_vocab(folder: str | None, configured: int | None) -> int:
    """The shipped GPT's vocabulary: model.vocab_size when set, else the token files' (data.tokens)
    or the byte corpus's 256; never fewer than the data's tokens."""
    needed = read_index(folder)["vocab_size"] if folder else VOCAB_SIZE
    if configured is not None and configured < needed:
        where = f"the tokenizer of data.tokens={folder!r}" if folder else "the byte-level corpus"
        raise UserError(
            f"model.vocab_size={configured} is smaller than the {needed} tokens of {where}; "
            f"leave it unset or make it at least {needed}."
        )
    return needed if configured is None else configured
