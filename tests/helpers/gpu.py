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


# XLA:CPU flags of the test session (tests/conftest.py) that a GPU compile does not take.
CPU_ONLY_FLAGS = (
    "--xla_llvm_disable_expensive_passes",
    "--xla_cpu_parallel_codegen_split_count",
    "--xla_backend_optimization_level",
)


def gpu_aot_env() -> dict:
    """The environment of a gpu-aot child: CPU platform, this checkout importable, and not the
    session's persistent compilation cache (tests/conftest.py): JAX writes deviceless GPU
    executables there but cannot load them back (a warning, then a compile, on every hit).

    Inside a test session (its cache folder set) XLA:GPU keeps the kernels it compiles in a
    kernel cache file there, one per xdist worker (a worker runs its children one at a time):
    a later child's compile of the same fusion loads it instead of running LLVM and ptxas
    again (measured: four ResNet rows of the cost model compile in 7.9 s instead of 15.8 s with
    their kernels cached). What is compiled is the same program; only its compile time changes.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    session = env.pop("JAX_COMPILATION_CACHE_DIR", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(CPU_ONLY_FLAGS)]
    if session:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        flags.append(f"--xla_gpu_kernel_cache_file={Path(session) / f'gpu-kernels-{worker}.bin'}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _run_json(
    script: str, *args: str, tmp: Path, env: dict | None = None, timeout: int = 1200
) -> dict:
    """`script *args --json FILE` under the gpu-aot python (`env`: variables added to
    `gpu_aot_env()`); the JSON it wrote."""
    out = tmp / f"{Path(script).stem}.json"
    proc = subprocess.run(
        [_gpu_aot_python(), str(ROOT / script), *args, "--json", str(out)],
        cwd=ROOT,
        env={**gpu_aot_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
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


def _session_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder of this test session that every xdist worker of it shares."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def quick_rows(names: list[str], factory: pytest.TempPathFactory) -> dict:
    """The benchmark suite's quick cases named exactly (e.g. `"cost/lm/bf16@h100"`), each
    compiled once per test session: a case another test of the session (any worker) ran
    through here is read back, the rest run under the gpu-aot python (`run_suite`).
    Returns `(model, variant, target) -> figures`."""
    cache = _session_dir(factory) / "quick-rows"
    cache.mkdir(exist_ok=True)
    paths = {name: cache / (name.replace("/", "_") + ".json") for name in names}
    missing = [name for name, path in paths.items() if not path.exists()]
    if missing:
        only = ",".join(missing)
        data = _run_json("benchmarks/run.py", "--quick", "--only", only, tmp=factory.mktemp("q"))
        records = {r["name"]: r for r in data["records"]}
        assert sorted(records) == sorted(missing), sorted(records)
        bad = [r for r in records.values() if r["status"] != "ok"]
        assert not bad, bad
        for name in missing:  # whole files only: write aside, then rename
            part = paths[name].with_suffix(f".{os.getpid()}")
            part.write_text(json.dumps(records[name]))
            part.replace(paths[name])
    records = [json.loads(paths[name].read_text()) for name in names]
    return {(r["model"], r["variant"], r["target"]): r["figures"] for r in records}
