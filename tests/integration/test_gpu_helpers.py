"""tests/helpers/gpu.py's `quick_rows`: each benchmark case compiled once per test session."""

from __future__ import annotations

import os

import jax
import pytest

from tests.helpers import gpu


def _record(name: str) -> dict:
    model, variant = name.split("/")[1:3]
    return {"name": name, "status": "ok", "model": model, "variant": variant.split("@")[0],
            "target": "h100", "figures": {"of": name}}  # fmt: skip


def test_quick_rows_runs_only_the_cases_not_yet_run_this_session(tmp_path_factory, monkeypatch):
    calls = []

    def fake_run_json(script, *args, tmp):
        names = args[args.index("--only") + 1].split(",")
        calls.append((script, args[0], names))
        return {"records": [_record(n) for n in names]}

    monkeypatch.setattr(gpu, "_run_json", fake_run_json)
    session = tmp_path_factory.mktemp("session")
    monkeypatch.setattr(gpu, "_session_dir", lambda factory: session)
    a, b, c = "cost/lm/bf16@h100", "cost/lm/fp32@h100", "cost/resnet/bf16@h100"
    first = gpu.quick_rows([a, b], tmp_path_factory)
    assert first == {("lm", "bf16", "h100"): {"of": a}, ("lm", "fp32", "h100"): {"of": b}}
    second = gpu.quick_rows([c, a], tmp_path_factory)
    assert list(second) == [("resnet", "bf16", "h100"), ("lm", "bf16", "h100")]
    assert second[("lm", "bf16", "h100")] == {"of": a}
    run = ("benchmarks/run.py", "--quick")
    assert calls == [(*run, [a, b]), (*run, [c])]
    gpu.quick_rows([b, c], tmp_path_factory)
    assert len(calls) == 2  # every case read back


def test_quick_rows_fails_on_a_case_the_suite_did_not_run(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(gpu, "_run_json", lambda script, *args, tmp: {"records": []})
    monkeypatch.setattr(gpu, "_session_dir", lambda factory: factory.mktemp("session"))
    with pytest.raises(AssertionError):
        gpu.quick_rows(["cost/lm/nope@h100"], tmp_path_factory)


def test_the_session_folder_is_shared_by_the_xdist_workers(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert gpu._session_dir(tmp_path_factory) == tmp_path_factory.getbasetemp().parent
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert gpu._session_dir(tmp_path_factory) == tmp_path_factory.getbasetemp()


def test_gpu_aot_children_get_no_persistent_compilation_cache(monkeypatch):
    """JAX cannot load deviceless GPU executables back from the cache: the children skip it."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/nonexistent/cache")
    env = gpu.gpu_aot_env()
    assert "JAX_COMPILATION_CACHE_DIR" not in env
    assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONPATH"] == str(gpu.ROOT)


def test_gpu_aot_children_share_a_kernel_cache_per_worker_and_drop_cpu_only_flags(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/session/cache")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_force_host_platform_device_count=8 --xla_llvm_disable_expensive_passes=true "
        "--xla_cpu_parallel_codegen_split_count=1 --xla_backend_optimization_level=1",
    )
    flags = gpu.gpu_aot_env()["XLA_FLAGS"].split()
    assert flags == [
        "--xla_force_host_platform_device_count=8",
        "--xla_gpu_kernel_cache_file=/session/cache/gpu-kernels-gw1.bin",
    ]
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # outside a test session: no cache file
    assert gpu.gpu_aot_env()["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_the_session_compiles_xla_cpu_cheaply_and_caches_every_compile():
    """One LLVM module, LLVM level 1 without its expensive passes (tests/conftest.py)."""
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_llvm_disable_expensive_passes=true" in flags
    assert "--xla_cpu_parallel_codegen_split_count=1" in flags
    assert "--xla_backend_optimization_level=1" in flags
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
