"""Test set-up: 8 simulated CPU devices (set before jax is imported), a fixed hypothesis profile."""

import os

# 8 devices, and XLA:CPU's collective rendezvous allowed 10 minutes instead of 40 s before it
# ends the process: 8 device threads on a loaded 2-core machine fall that far apart
# (examples/data_parallel.py's SIMULATED_DEVICE_FLAGS says more).
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "mpjax",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("mpjax")
