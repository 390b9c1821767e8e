"""Simulated CPU devices get a thread pool with room to spare: XLA:CPU sizes its pool to the
device count on a small machine, and a collective that needs every device's thread at once can
then deadlock (examples/data_parallel.py's `simulated_device_env`)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COUNT_POOL = """
import collections, os, sys
sys.argv = ["data_parallel.py", "--cpu-devices", "8"]
from examples import data_parallel
data_parallel.initialize(data_parallel.parse_args(sys.argv[1:]))
import jax, jax.numpy as jnp
jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jnp.ones(8)).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(jax.device_count(), collections.Counter(names)["tf_XLAEigen"])
"""


def test_simulated_device_env_doubles_the_pool_unless_set():
    from examples.data_parallel import simulated_device_env

    assert simulated_device_env({}, 8) == {"NPROC": "16"}
    assert simulated_device_env({}, 32) == {"NPROC": "64"}
    assert simulated_device_env({"NPROC": "4"}, 8) == {}  # the user's choice stands


def test_the_example_runs_8_devices_on_a_pool_of_16_threads():
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", COUNT_POOL], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    devices, pool = map(int, out.stdout.split()[-2:])
    assert devices == 8 and pool >= 16, out.stdout
