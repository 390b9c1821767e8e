"""Test set-up: 8 simulated CPU devices (set before jax is imported), a fixed hypothesis profile."""

import os

# 8 simulated devices, and XLA:CPU's thread pool twice that (its size from NPROC): a pool of
# exactly the device count can deadlock a collective on a loaded machine
# (examples/data_parallel.py's simulated_device_env says how).
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("NPROC", "16")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "mpjax",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("mpjax")
