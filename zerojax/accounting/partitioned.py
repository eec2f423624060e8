"""A program's HLO right after SPMD partitioning, read from XLA's dump of one compile that always
runs (a persistent compilation cache would otherwise serve it without dumping anything)."""

from __future__ import annotations

import contextlib
import os
import re


def partitioned_hlo_text(lowered, dump_dir: str) -> str:
    """Compile `lowered` (a `jax.stages.Lowered`) and return its HLO right after SPMD partitioning."""
    return compile_partitioned(lowered, dump_dir)[1]


def compile_partitioned(lowered, dump_dir: str):
    """(the `jax.stages.Compiled`, its HLO right after SPMD partitioning) from one compile.

    XLA writes one file per dumped pass; the wanted one is named
    `module_NNNN.<module>.NNNN.spmd-partitioner.after_spmd-partitioning...txt`. Files this call
    created are preferred, so a reused `dump_dir` does not return a stale program. The compile
    always runs, even under a persistent compilation cache (see `_uncached_options`).
    """
    os.makedirs(dump_dir, exist_ok=True)
    before = set(os.listdir(dump_dir))
    with _cache_writes_off():
        compiled = lowered.compile(
            compiler_options=_uncached_options({"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        )
    m = re.search(r"module @([\w.\-]+)", lowered.as_text())
    module = m.group(1) if m else ""

    def wanted(f: str) -> bool:
        return "after_spmd-partitioning" in f and f.endswith(".txt") and f".{module}." in f

    files = sorted(f for f in os.listdir(dump_dir) if wanted(f) and f not in before)
    if not files:
        raise RuntimeError(f"XLA dumped no post-partitioning HLO for module {module!r} into {dump_dir}")
    with open(os.path.join(dump_dir, files[-1])) as fh:
        return compiled, fh.read()


def _uncached_options(options: dict) -> dict:
    """`options` plus a non-default value of an option that only shapes debug text.

    A persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`) keys an executable on the program
    and its options but leaves the dump options out, so an identical earlier compile would be
    served from the cache and nothing would be dumped. No other compile sets this option, and
    `_cache_writes_off` keeps these compiles out of the cache, so the key is never found."""
    return {**options, "xla_debug_buffer_assignment_show_max": _NEVER_CACHED}


_NEVER_CACHED = 1_000_003  # any value but XLA's default; it only bounds a debug listing


@contextlib.contextmanager
def _cache_writes_off():
    """No cache entry for the key `_uncached_options` makes, so it is never served from the cache."""
    import jax

    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
