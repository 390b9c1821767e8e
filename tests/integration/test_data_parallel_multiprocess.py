"""examples/data_parallel.py as two jax.distributed processes on localhost (2 CPU devices each):
identical params in both, the same result as one device, and an inf in one process's local
batch makes both skip."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from examples import data_parallel as dpx
from examples.digits_cnn import load_data
from mpjax.scaling import find_loss_scaled_state
from tests.helpers.data_parallel import rel_change_error

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "data_parallel.py"
STEPS, BATCH, INF_STEP = 4, 16, 2
TIMEOUT_S = 240  # both processes together; ~15 s of CPU time on an idle machine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(tmp_path: Path) -> list[dict]:
    """Starts both processes, waits (bounded), kills leftovers; returns their saved npz."""
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    procs, logs = [], []
    try:
        for pid in range(2):
            log = open(tmp_path / f"log{pid}.txt", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [
                sys.executable,
                str(EXAMPLE),
                *("--mode", "pjit", "--precision", "fp16", "--cpu-devices", "2"),
                *("--num-processes", "2", "--process-id", str(pid)),
                *("--coordinator", f"127.0.0.1:{port}"),
                *("--steps", str(STEPS), "--batch-size", str(BATCH), "--log-every", "1"),
                *("--inject-inf-step", str(INF_STEP), "--inject-inf-process", "1"),
                *("--save", str(tmp_path / f"p{pid}.npz")),
            ]
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"2-process run exceeded {TIMEOUT_S}s:\n{_logs(tmp_path)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n{_logs(tmp_path)}"
    return [dict(np.load(tmp_path / f"p{pid}.npz")) for pid in range(2)]


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- process {pid}\n" + (tmp_path / f"log{pid}.txt").read_text()[-3000:]
        for pid in range(2)
        if (tmp_path / f"log{pid}.txt").exists()
    )


def _tree(saved: dict, kind: str, step: int) -> dict:
    prefix = f"{kind}/{step}/"
    return {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}


@pytest.mark.slow
def test_two_processes_train_identically_and_skip_together(tmp_path):
    p0, p1 = _run_two_processes(tmp_path)

    # Both processes hold the same params and master weights after every step.
    assert sorted(p0) == sorted(p1)
    for key in p0:
        if key.startswith(("params/", "master/")):
            assert p0[key].tobytes() == p1[key].tobytes(), key

    # The inf sat in process 1's rows only, and both skipped that step.
    for saved in (p0, p1):
        finite = saved["metrics/grads_finite"]
        np.testing.assert_array_equal(finite, [s != INF_STEP for s in range(STEPS)])
        np.testing.assert_array_equal(saved["metrics/skipped_steps"], [0, 0, 1, 1])
        scale = saved["metrics/loss_scale"]
        assert scale[INF_STEP] == scale[INF_STEP - 1] / 2
        for kind in ("params", "master"):
            before, after = _tree(saved, kind, INF_STEP - 1), _tree(saved, kind, INF_STEP)
            assert before and all(after[k].tobytes() == before[k].tobytes() for k in before)
            later = _tree(saved, kind, STEPS - 1)
            assert any(later[k].tobytes() != after[k].tobytes() for k in after)

    # Together the two processes trained on the global batch: one device gets the same.
    single = dpx.make_data_parallel("single", "fp16")
    host_steps = []
    dpx.train(
        single,
        load_data()[0],
        steps=STEPS,
        batch_size=BATCH,
        inject_inf=(INF_STEP, 0),  # any row of the global batch: the step is skipped
        callback=lambda s, p, o, m: host_steps.append(dpx.to_host((p, o, m))),
    )
    np.testing.assert_array_equal(
        [bool(m["grads_finite"]) for _, _, m in host_steps], p0["metrics/grads_finite"]
    )
    np.testing.assert_array_equal(
        [float(m["loss_scale"]) for _, _, m in host_steps], p0["metrics/loss_scale"]
    )
    init_master = find_loss_scaled_state(single.init(0)[1]).master
    init_master = {jax.tree_util.keystr(k): np.asarray(v) for k, v in _flat(init_master)}
    ref_master = {jax.tree_util.keystr(k): v for k, v in _flat(host_steps[-1][1].master)}
    err = rel_change_error(_tree(p0, "master", STEPS - 1), ref_master, init_master)
    print(f"2-process vs single-device master: relative error {err:.3g}")
    assert err < 1e-2


def _flat(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]
