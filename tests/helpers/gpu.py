"""Shared test helpers: gpu."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


ENV_PYTHON = "MPJAX_GPU_AOT_PYTHON"


def _gpu_aot_python() -> str:
    python = os.environ.get(ENV_PYTHON)
    if python:
        return python
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must set {ENV_PYTHON} to a python with the gpu-aot wheels (.ci/run)")
    pytest.skip(f"{ENV_PYTHON} is not set: no gpu-aot environment for the deviceless compile")


def _run_json(script: str, *args: str, tmp: Path) -> dict:
    out = tmp / f"{Path(script).stem}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [_gpu_aot_python(), str(ROOT / script), *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def run_suite(*args: str, tmp: Path) -> dict:
    """`benchmarks/run.py *args` under the gpu-aot python (the benchmark suite, e.g.
    `"--quick", "--only", "cost/lm/"`): `(model, variant, target) -> figures` of its cases."""
    data = _run_json("benchmarks/run.py", *args, tmp=tmp)
    bad = [r for r in data["records"] if r["status"] != "ok"]
    assert not bad, bad
    return {(r["model"], r["variant"], r["target"]): r["figures"] for r in data["records"]}
