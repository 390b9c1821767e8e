"""Test set-up: 8 simulated CPU devices and XLA:CPU's compile flags (set before jax is imported),
a fixed hypothesis profile, one persistent compilation cache per session."""

import os
import shutil
import tempfile

# 8 simulated devices, and XLA:CPU's thread pool twice that (its size from NPROC): a pool of
# exactly the device count can deadlock a collective on a loaded machine
# (examples/data_parallel.py's simulated_device_env says how).
# XLA:CPU compiles each program as one LLVM module (not split for a thread pool that two
# xdist workers on two cores keep busy anyway), at LLVM's optimisation level 1 and without its
# expensive passes (vectorisation, unrolling): the tests are mostly compile time (a char-LM
# training test spends 18.4 of its 21.6 s in XLA's compiler), and none of the three changes a
# result bit (measured: the examples' trained metrics, the checkpoint fixtures' resumed runs
# bit for bit, the scaling and kernel tests; level 0 does change them). Level 1 took the
# autocast, scaling and flax tests from 369 to 313 s. The GPU compiles of tests/helpers/gpu.py
# drop all three (ptxas-bound there, and the cost model reads the program users compile).
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_backend_optimization_level=1",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("NPROC", "16")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "mpjax",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("mpjax")


# One JAX persistent compilation cache per test session (its first process makes it and the
# xdist workers and subprocesses inherit the variable): a program compiled again, by a fresh
# `jax.jit` of the same function or another test or example running the same step, loads the
# executable instead of compiling it. Every compile is cached, not only those of 1 s or more
# (JAX's default): many of the suite's compiles are small steps that other tests compile again
# (the autocast, scaling and flax tests: 404 -> 369 s). Removed at the end of the session;
# a JAX_COMPILATION_CACHE_DIR already set is used as it is.
_CACHE = "JAX_COMPILATION_CACHE_DIR"
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
_made_cache: list[str] = []


def pytest_configure(config):
    if _CACHE not in os.environ:
        os.environ[_CACHE] = tempfile.mkdtemp(prefix="mpjax-jax-cache-")
        _made_cache.append(os.environ[_CACHE])


def pytest_unconfigure(config):
    for path in _made_cache:
        shutil.rmtree(path, ignore_errors=True)
