"""Byte-level text corpus (vocabulary 256) and deterministic, per-process sharded batches."""

from __future__ import annotations

import os
import sysconfig

import jax
import numpy as np

from zerojax.errors import UserError

VOCAB_SIZE = 256
_BINARY_PROBE = 8192  # a NUL byte in the first 8 KiB marks a file as binary
# Text with a byte-order mark in these encodings is read as its UTF-8 bytes (it holds NUL bytes).
_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _sorted_files(root: str, *, suffix: str = "", skip_dirs: frozenset[str] = frozenset()) -> list[str]:
    # Sort by relative path (not os.walk order) so the corpus is identical on every run.
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(suffix) and os.path.isfile(full) and not os.path.islink(full):
                found.append(os.path.relpath(full, root))
    return [os.path.join(root, rel) for rel in sorted(found)]


def text_bytes(path: str, budget: int) -> bytes | None:
    """Up to `budget` bytes of a file's text as UTF-8; None for a binary file."""
    with open(path, "rb") as f:
        head = f.read(_BINARY_PROBE)
        encoding = next((enc for bom, enc in _BOMS if head.startswith(bom)), None)
        if encoding is not None:  # UTF-16/32 text: decode it whole, keep its UTF-8 bytes
            text = (head + f.read()).decode(encoding, errors="replace")
            return text.encode("utf-8")[:budget]
        if b"\0" in head:
            return None
        return head[:budget] + f.read(max(0, budget - len(head)))


def _read_until(files: list[str], max_bytes: int) -> bytes:
    out = bytearray()
    for path in files:
        if len(out) >= max_bytes:
            break
        try:
            out += text_bytes(path, max_bytes - len(out)) or b""
        except OSError:
            continue  # unreadable files (permissions, races) are simply not part of the corpus
    return bytes(out[:max_bytes])


def corpus_files(path: str | None) -> list[str]:
    """The files of a corpus in a fixed order: a file, every file under a folder, or (None) the stdlib's .py files."""
    if path is None:
        stdlib = sysconfig.get_paths()["stdlib"]
        return _sorted_files(stdlib, suffix=".py", skip_dirs=frozenset(_SKIP_DIRS))
    if os.path.isdir(path):
        return _sorted_files(path, skip_dirs=frozenset({"__pycache__"}))
    if os.path.isfile(path):
        return [path]
    raise UserError(
        f"data.path={path!r} does not exist; give an existing text file or folder, or null for the built-in corpus."
    )


def load_corpus(path: str | None, max_bytes: int = 16 * 2**20) -> np.ndarray:
    """The corpus as uint8 tokens: a file, every text file under a folder, or (None) the stdlib's .py files."""
    data = _read_until(corpus_files(path), max_bytes)
    if not data:
        raise UserError(
            f"data.path={path!r} holds no usable bytes (empty, unreadable, or only files with NUL "
            "bytes: binary, or UTF-16/32 text without a byte-order mark, which must be converted "
            "to UTF-8); give a non-empty text corpus."
        )
    return np.frombuffer(data, dtype=np.uint8).copy()


def split_corpus(tokens: np.ndarray, eval_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval): eval is the held-out last `eval_fraction` of the corpus, so the two never overlap."""
    if not 0.0 <= eval_fraction < 1.0:
        raise UserError(f"data.eval_fraction={eval_fraction!r} is invalid; it must be in [0, 1).")
    n_eval = int(round(len(tokens) * eval_fraction))
    cut = len(tokens) - n_eval
    return tokens[:cut], tokens[cut:]


class BatchStream:
    """Batches are a pure function of (seed, step): a resumed run sees exactly the data it would have.
    A batch source in the sense of `zerojax.data.sources` (batch, rows, batch_size, global_batch)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, seed: int, path: str | None = None):
        if seq_len < 1 or global_batch < 1:
            raise UserError(f"seq_len={seq_len} and global_batch={global_batch} must both be at least 1.")
        if len(tokens) < seq_len + 2:
            raise UserError(
                f"data.path={path!r} gives a split of {len(tokens)} bytes, too short for seq_len={seq_len} "
                f"(needs at least {seq_len + 2}); use a longer corpus or a shorter sequence."
            )
        self.tokens = np.asarray(tokens, dtype=np.uint8)
        self.seq_len = seq_len
        self.batch_size = global_batch
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the step's rows; the last step's are cached (one RNG draw per step, not per device)."""
        if self._cached is None or self._cached[0] != step:
            rng = np.random.default_rng([self.seed, step])
            offs = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
            self._cached = (step, offs)
        return self._cached[1]

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows start..stop of the step's global batch; only those rows are read from the corpus."""
        offs = self.offsets(step)[start:stop]
        window_RxL1 = self.tokens[offs[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": window_RxL1[:, :-1], "targets": window_RxL1[:, 1:]}

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """The whole [global_batch, seq_len] batch on this host (single-process use and tests)."""
        return self.rows(step, 0, self.batch_size)

    batch = host_batch  # the batch-source protocol (zerojax.data.sources)

    def global_batch(self, step: int, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
        """Global sharded arrays; each process materialises only the rows its addressable devices own."""
        self.offsets(step)  # warm the cache before the per-device callbacks run
        shape = (self.batch_size, self.seq_len)

        def make(key: str) -> jax.Array:
            def shard(index: tuple[slice, ...]) -> np.ndarray:
                rows_slice = index[0] if index else slice(None)
                start, stop, _ = rows_slice.indices(self.batch_size)
                return self.rows(step, start, stop)[key][(slice(None), *index[1:])]

            return jax.make_array_from_callback(shape, sharding, shard)  # type: ignore[arg-type]

        return {"inputs": make("inputs"), "targets": make("targets")}
