"""`benchmarks/gpu.py --dry-run`: the prepared GPU run's plan and its device time, on a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu
from benchmarks.cases import CASES

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_the_plan_and_it_fits_600_s_of_device_time():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=True,
    ).stdout  # fmt: skip
    names = re.findall(r"^(\S+@gpu)\s+([\d.]+)", out, re.M)
    total = float(re.search(r"^estimated device time\s+([\d.]+)", out, re.M).group(1))
    assert total <= gpu.DEVICE_BUDGET_S == 600
    assert total == sum(float(s) for _, s in names) + gpu.STARTUP_S
    # most important first: the wide LM's bf16, tensorwise and blockwise rows, then GPT-2
    # small's bf16 paths, ResNet-50's, then the microbenchmarks
    planned = [n for n, _ in names]
    assert planned[:2] == ["gpu/lm:wide/bf16@gpu", "gpu/lm:wide/fp8-tensorwise@gpu"]
    blockwise = [n for n in planned if "blockwise" in n]
    assert blockwise[-2:] == [
        "gpu/lm:wide/fp8-blockwise@gpu",
        "gpu/lm:wide/fp8-blockwise-emulated@gpu",
    ]
    order = ["gpu/lm:wide/", "gpu/lm/", "gpu/resnet/", "kernels-gpu/"]
    ranks = [next(i for i, p in enumerate(order) if n.startswith(p)) for n in planned]
    assert ranks == sorted(ranks)
    for want in ("policy", "autocast", "fp16-scaled"):
        assert f"gpu/lm/{want}@gpu" in planned
    assert {"gpu/resnet/policy@gpu", "gpu/resnet/convbn@gpu"} <= set(planned)
    assert planned[-1] == "kernels-gpu/study/kernels_gpu@gpu"
    # every planned case is registered
    assert set(planned) <= {c.name for c in CASES}


def test_estimates_rest_on_the_last_run():
    cases = {c.name: c for c in CASES}
    measured = {"model": "lm", "size": "wide", "status": "ok", "seconds": 12.0}
    previous = {"records": [{**measured, "name": "gpu/lm:wide/bf16@gpu"}]}
    assert gpu.estimate_seconds(cases["gpu/lm:wide/bf16@gpu"], previous) == (12.0, "measured")
    seconds, basis = gpu.estimate_seconds(cases["gpu/lm:wide/fp8-blockwise@gpu"], previous)
    assert (seconds, basis) == (12.0, "median of 1 alike")
    unknown = gpu.estimate_seconds(cases["gpu/resnet/policy@gpu"], previous)
    assert unknown == (gpu.UNMEASURED_CASE_S, "never measured")
    # a failed run is no estimate
    failed = {"records": [{**measured, "name": "gpu/lm:wide/bf16@gpu", "status": "error"}]}
    assert gpu.estimate_seconds(cases["gpu/lm:wide/bf16@gpu"], failed)[1] == "never measured"
