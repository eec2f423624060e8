"""Simulate 8 CPU devices before JAX initialises its backends, and share compiled programs.

Many tests compile the same program (the stage-0 reference a test compares against, the CLI's tiny
GPT in each subprocess). A persistent compilation cache, new for each session and removed after it,
compiles each once; every test still runs what it compiles. Set in the environment, so the
subprocesses a test launches share it. `zerojax.accounting.hlo.compile_partitioned` always
compiles, since its HLO dump is what it reads.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="zerojax-test-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

    def pytest_sessionfinish(session, exitstatus):
        shutil.rmtree(_cache_dir, ignore_errors=True)
