"""Simulate 8 CPU devices before JAX initialises its backends, compile fast, and share compiled programs.

- `--xla_backend_optimization_level=0`: XLA:CPU's LLVM code generation at its lowest level. It runs
  after every HLO pass, so the programs, buffer assignments (`memory_analysis`) and collectives these
  tests measure are the same as at the default level; only the machine code is slower, which the tiny
  models here never notice. It halves their compile time.
- A persistent compilation cache, new for each session (and each `-n` worker pool) and removed after
  it, compiles each distinct program once: the stage-0 reference many tests compare against, the CLI's
  tiny GPT in each subprocess. Set in the environment, so the subprocesses a test launches share both.
  `zerojax.accounting.partitioned.compile_partitioned` always compiles, since its HLO dump is what it reads.
"""

import os
import shutil
import tempfile

TEST_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)

_flags = os.environ.get("XLA_FLAGS", "")
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="zerojax-test-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

    def pytest_sessionfinish(session, exitstatus):
        shutil.rmtree(_cache_dir, ignore_errors=True)  # the controller's: `-n` workers inherit the variable
