"""`benchmarks/gpu.py --dry-run`: the prepared GPU run's plan and its device time, on a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    # most important first: the wide LM's bf16, tensorwise and blockwise rows, the blockwise
    # GEMM kernels alone, then GPT-2 small's bf16 paths, ResNet-50's, then the microbenchmarks
    planned = [n for n, _ in names]
    assert planned[:2] == ["gpu/lm:wide/bf16@gpu", "gpu/lm:wide/fp8-tensorwise@gpu"]
    blockwise = [n for n in planned if "blockwise" in n]
    assert blockwise == [
        "gpu/lm:wide/fp8-blockwise@gpu",  # native: the Mosaic GPU kernel on Hopper
        "gpu/lm:wide/fp8-blockwise-emulated@gpu",
        "blockwise-gemm-gpu/study/blockwise_gemm_gpu@gpu",  # the kernels alone vs cuBLAS
    ]
    order = ["gpu/lm:wide/", "blockwise-gemm-gpu/", "gpu/lm/", "gpu/resnet/", "kernels-gpu/"]
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


def test_a_real_run_uses_the_persistent_compilation_cache(tmp_path):
    import jax

    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {k: getattr(jax.config, k) for k in keys}
    try:
        gpu._use_compilation_cache(tmp_path / "cache")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert (tmp_path / "cache").is_dir()
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


def _row(name, variant, seconds, ratio, classes, anchor_classes=None):
    figures = {
        "time_s": {"median": seconds},
        "time_vs_anchor": {"median": ratio, "min": ratio, "max": ratio},
        "model_class_s": {"h200": classes},
    }
    if anchor_classes is not None:
        figures["anchor_model_class_s"] = {"h200": anchor_classes}
    return {"name": name, "model": "lm", "size": "wide", "variant": variant, "anchor": "bf16",
            "status": "ok", "figures": figures}  # fmt: skip


def test_calibrate_fits_the_rows_a_run_wrote():
    """What `gpu.py` does after a real run: the table fitted to the rows' kernels, and each
    row's model ratio beside the measured one (here rows made to fit exactly)."""
    from benchmarks.calibrate import calibrate

    eff = {"bf16 gemm": 0.7, "fp8 gemm": 0.5, "fusion": 0.6, "pallas blockwise gemm": 0.1}
    bf16 = {"bf16 gemm": 0.06, "fusion": 0.02}
    fp8 = {"fp8 gemm": 0.02, "bf16 gemm": 0.01, "fusion": 0.025}
    block = {"pallas blockwise gemm": 0.02, "bf16 gemm": 0.01, "fusion": 0.03}
    rowwise = {"fp8 gemm": 0.02, "bf16 gemm": 0.002, "fusion": 0.05}

    def t(classes):
        return sum(s / eff[c] for c, s in classes.items())

    records = [
        _row("gpu/lm:wide/bf16@gpu", "bf16", t(bf16), 1.0, bf16),
        _row("gpu/lm:wide/fp8-tensorwise@gpu", "fp8-tensorwise", t(fp8), t(fp8) / t(bf16), fp8),
        _row(
            "gpu/lm:wide/fp8-rowwise@gpu", "fp8-rowwise", t(rowwise), t(rowwise) / t(bf16), rowwise
        ),
        _row(
            "gpu/lm:wide/fp8-blockwise@gpu",
            "fp8-blockwise",
            t(block),
            t(block) / t(bf16),
            block,
            anchor_classes=bf16,
        ),
    ]
    machine = {"device_kind": "NVIDIA H200", "date": "2026-12-06 05:00 UTC"}
    results = {"command": "python benchmarks/gpu.py", "machine": machine, "records": records}
    table = calibrate(results)
    entries = table["entries"]["hopper"]
    for c, e in eff.items():
        assert entries[c]["efficiency"] == pytest.approx(e, abs=1e-3)
        assert entries[c]["command"] == "python benchmarks/gpu.py"
        assert entries[c]["date"] == machine["date"] and entries[c]["gpu"] == "NVIDIA H200"
    for r in records:
        f = r["figures"]
        assert f["model_vs_anchor"] == pytest.approx(f["time_vs_anchor"]["median"], abs=1e-3)
        assert f["model_unmeasured"] == []
    native = table["lowerings"]["hopper"]["blockwise"]["native"]
    assert native["ratio"] == pytest.approx(t(block) / t(bf16), abs=1e-4)


def test_kernels_case_smoke_runs_every_kernel_beside_its_xla_reference():
    """The plan's last case, without a GPU: tiny shapes, the kernels in interpret mode.

    A check that the prepared run will not stop at this case (its code runs nowhere else
    without a GPU), with each kernel timed beside XLA's implementation of the same op."""
    out = gpu.kernels_gpu(smoke=True)
    assert out["notes"].startswith("SMOKE RUN, NOT A MEASUREMENT")
    impls: dict[str, list[str]] = {}
    for row in out["rows"]:
        case = re.sub(r" bf16\[.*| f32\[.*| \d+ bf16.*|, \d+x.*", "", row[0])
        impls.setdefault(case, []).append(row[1])
        assert row[2] > 0, row  # ms median
    assert impls == {
        "copy": ["copy"],
        "unscale_and_check": ["interpret", "xla"],
        "conv_epilogue fwd": ["interpret", "xla"],
        "conv_epilogue bwd": ["interpret", "xla"],
        "channel_stats": ["interpret", "xla"],
        "quantize_orientations blockwise": ["interpret", "xla"],
        "quantize_orientations mxfp8": ["interpret", "xla"],
        "ResNet (2 stages of 1 block) train step bf16": ["interpret", "xla"],
    }
