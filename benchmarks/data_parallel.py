"""Step time of the pjit data-parallel example: 8 CPU devices vs 1 device on the same global batch.

A scaling sanity check, not a speed claim: the 8 "devices" are simulated by XLA on the
host's CPU cores, so they share those cores (2 on the project's CI machine) and the 8-device
step pays for partitioning and all-reduces without gaining compute. What the figure shows is
that sharding the batch costs a bounded factor rather than breaking or blowing up, and that
ZeRO-sharded optimizer state adds little on top.

On a GPU (``jax.default_backend() == "gpu"``) it also times one device under fp32, bf16 and
fp16 with dynamic loss scaling (the example's ``--precision``), which is the throughput
comparison that matters there; without a GPU those rows are left out and the notes say so.

The measurement runs in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (device count is fixed when jax
starts), configurations alternate round by round, and times are medians with min-max.

    python benchmarks/run.py --only data-parallel [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_DEVICES = 8
_MARK = "DATA_PARALLEL_RESULT "


def _configs(gpu: bool) -> list[tuple[str, str, str, int, bool]]:
    """(label, mode, precision, devices, zero) of each timed configuration."""
    configs = [
        ("pjit, 1 device", "pjit", "fp16", 1, False),
        (f"pjit, {N_DEVICES} devices", "pjit", "fp16", N_DEVICES, False),
        (f"pjit, {N_DEVICES} devices, ZeRO", "pjit", "fp16", N_DEVICES, True),
    ]
    if gpu:
        configs += [(f"1 GPU, {p}", "single", p, 1, False) for p in ("fp32", "bf16", "fp16")]
    return configs


def _worker(quick: bool) -> dict:
    """Runs in the child: times every configuration, alternating them round by round."""
    import jax

    from examples import data_parallel as dpx
    from examples.digits_cnn import global_batch_indices, load_data

    batch_size, steps, rounds = (64, 5, 3) if quick else (512, 20, 7)
    gpu = jax.default_backend() == "gpu"
    assert jax.device_count() >= N_DEVICES or gpu, jax.devices()
    x_all, y_all = load_data()[0]
    idx = [global_batch_indices(len(y_all), batch_size, s, seed=0) for s in range(steps)]

    runs = []
    for label, mode, precision, n, zero in _configs(gpu):
        dp = dpx.make_data_parallel(mode, precision, zero=zero, devices=jax.devices()[:n])
        batches = [dp.put_batch(x_all[i], y_all[i]) for i in idx]
        state = list(dp.init(0))
        for b in batches[:2]:  # compile and warm up
            state[0], state[1], _ = dp.step(*state, *b)
        jax.block_until_ready(state)
        runs.append({"label": label, "dp": dp, "batches": batches, "state": state, "times": []})

    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for run_ in order:
            state = run_["state"]
            start = time.perf_counter()
            for b in run_["batches"]:
                state[0], state[1], _ = run_["dp"].step(*state, *b)
            jax.block_until_ready(state)
            run_["times"].append((time.perf_counter() - start) / steps)

    return {
        "batch_size": batch_size,
        "steps": steps,
        "rounds": rounds,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "runs": [{"label": r["label"], "times": r["times"]} for r in runs],
    }


def run(quick: bool = False) -> dict:
    """Runs the measurement in a child process with 8 CPU devices and returns the table."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={N_DEVICES}",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"] + (["--quick"] * quick)
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=Path(__file__).parents[1]
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(_MARK)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"data_parallel worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    res = json.loads(lines[-1][len(_MARK) :])

    base = statistics.median(res["runs"][0]["times"])
    rows = []
    for r in res["runs"]:
        times_ms = [t * 1e3 for t in r["times"]]
        med = statistics.median(times_ms)
        rows.append(
            [
                r["label"],
                res["batch_size"],
                round(med, 2),
                f"{min(times_ms):.2f}-{max(times_ms):.2f}",
                round(res["batch_size"] / (med / 1e3)),
                round(med / (base * 1e3), 2),
            ]
        )
    gpu_note = (
        "GPU rows: one GPU, mode single, fp32 vs bf16 vs fp16 with dynamic loss scaling."
        if res["backend"] == "gpu"
        else "No GPU here: the single-GPU fp32 / bf16 / fp16+scaling throughput rows are not "
        "measured (they run when jax's backend is gpu)."
    )
    return {
        "title": "Data-parallel example (pjit): step time, 8 devices vs 1 on the same global batch",
        "columns": [
            "configuration",
            "global batch",
            "step ms (median)",
            "min-max ms",
            "images/s",
            "time vs 1 device",
        ],
        "rows": rows,
        "notes": (
            f"Backend {res['backend']}, {res['cpu_count']} CPU cores; fp16 params and compute, "
            f"dynamic loss scaling, Adam; {res['steps']} steps per sample, {res['rounds']} "
            "samples per configuration, configurations alternated. The 8 devices are simulated "
            "on the same CPU cores, so >1x is expected: this checks that sharding works at a "
            "bounded cost, not that it is faster. " + gpu_note
        ),
    }


if __name__ == "__main__" and "--worker" in sys.argv:  # the 8-device child of `run`
    print(_MARK + json.dumps(_worker("--quick" in sys.argv)))
