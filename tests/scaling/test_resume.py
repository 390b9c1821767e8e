"""Kill and resume: checkpoint at step K, kill, resume in a new process to N: bitwise identical.

The resumed run equals an uninterrupted N-step run bit for bit, through an orbax checkpoint and
through flax.serialization bytes.

The training loop is tests/scaling/resume_worker.py (fp16 params with float32 master weights,
AdamW under
`loss_scaled`, a non-default `DynamicLossScale`, dropout from a JAX key); every run is its own
process. The window holds NaN and inf batches before and after the checkpoint, so the restored
loss-scale state (scale at `min_scale`, growth counter), skip counters, master weights and RNG all
decide the result.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("resume_worker.py")
ROOT = Path(__file__).resolve().parents[2]
N, K = 12, 5
BAD_STEPS = {"2": float("nan"), "3": float("inf"), "4": float("nan"), "7": float("nan")}
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def _start(*args, stdout=None) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--stop", str(N), "--bad-steps", json.dumps(BAD_STEPS)]
    return subprocess.Popen(
        [*cmd, *map(str, args)],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]


def _save_then_kill(ckpt_dir: Path) -> list[str]:
    """Runs the worker until it has saved at K and trained two more steps, then SIGKILLs it."""
    proc = _start(
        "--save-at", K, "--ckpt-dir", ckpt_dir, "--hang-after-save", stdout=subprocess.PIPE
    )
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith(f"TRAINED {K + 2}"):
                break
    finally:
        proc.kill()  # by its own pid: this test started it
        watchdog.cancel()
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert lines[:3] == [f"SAVED {K}", f"TRAINED {K + 1}", f"TRAINED {K + 2}"], (lines, err[-3000:])
    assert proc.returncode == -9  # killed, not exited
    return lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    # the uninterrupted run and the run that is killed after its checkpoint, side by side
    full = _start("--out", d / "full.npz")
    _save_then_kill(d)
    _finish(full)
    assert (d / "orbax").is_dir() and (d / "state.msgpack").is_file()
    # resume each checkpoint in a fresh process
    resumed = [
        _start("--start", K, "--restore-orbax", d / "orbax", "--out", d / "orbax.npz"),
        _start("--start", K, "--restore-bytes", d / "state.msgpack", "--out", d / "bytes.npz"),
    ]
    for proc in resumed:
        _finish(proc)
    return {name: dict(np.load(d / f"{name}.npz")) for name in ("full", "orbax", "bytes")}


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _assert_bitwise_identical(got: dict, want: dict) -> None:
    got = {k: v for k, v in got.items() if k != "__scales__"}
    want = {k: v for k, v in want.items() if k != "__scales__"}
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        assert got[path].dtype == value.dtype and got[path].shape == value.shape, path
        assert np.array_equal(_bits(got[path]), _bits(value)), path
    # the comparison covers everything that has to survive
    for part in (
        "['params']",
        ".master[",
        ".inner_state[0].nu[",
        ".loss_scale.loss_scale",
        ".loss_scale.counter",
        ".skipped_steps",
        "['rng']",
        "['step']",
    ):
        assert any(part in path for path in want), part


@pytest.mark.parametrize("fmt", ["orbax", "bytes"])
def test_resumed_run_is_bitwise_identical_to_uninterrupted(runs, fmt):
    _assert_bitwise_identical(runs[fmt], runs["full"])


def test_window_exercises_skips_min_scale_and_growth_after_resume(runs):
    full = runs["full"]
    scales = full["__scales__"]
    assert int(full["['opt_state'].skipped_steps"]) == len(BAD_STEPS)
    assert int(full["['step']"]) == N
    min_scale, initial = 2.0**4, 2.0**6  # resume_worker.LOSS_SCALE_CONFIG
    assert scales[0] == initial
    assert scales[:K].min() == min_scale and scales[K:].min() == min_scale  # held at the floor
    assert scales[-1] > min_scale  # grew again after 3 finite steps (growth_interval=3)
    np.testing.assert_array_equal(runs["orbax"]["__scales__"], scales[K:])
    for leaf, value in full.items():
        if value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), leaf
