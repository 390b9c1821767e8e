"""`mpjax.report` for the deviceless H100 targets: what the GPU runs, module by module.

`tests/report/_report_h100.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
environment with the `gpu-aot` wheels, as for tests/integration/test_gpu_cost_guard.py), with
`JAX_PLATFORMS=cpu`. Without the variable these tests fail under CI (`CI=true`) and are
skipped elsewhere, saying why.
"""

from __future__ import annotations

import pytest

from mpjax._src.report.records import dtype_name
from tests.helpers.gpu import _run_json, quick_rows
from tests.helpers.report import KEPT

COMPUTE = ["bfloat16", "float16"]


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    return _run_json("tests/report/_report_h100.py", tmp=tmp_path_factory.mktemp("report"))


@pytest.mark.parametrize("compute", COMPUTE)
def test_h100_runs_exactly_the_kept_module_in_float32(h100, compute):
    r = h100[compute]
    assert r["flagged"] == [KEPT]
    assert {p for p, _, _ in r["gemms"]} == {"Dense_0", KEPT, "conv", "head"}
    for path, asks, runs in r["gemms"]:
        want = "float32" if path == KEPT else compute
        assert (asks, runs) == (want, want), path
    assert f"in {compute}, 17.6 % in float32: {KEPT};" in r["summary"]


@pytest.mark.parametrize("compute", COMPUTE)
def test_h100_totals_agree_with_hlo_cost(h100, compute):
    r = h100[compute]
    want: dict = {}
    for flops in r["cost"].values():
        for key, n in flops.items():
            want[dtype_name(key)] = want.get(dtype_name(key), 0) + n
    assert r["runs"] == want
    kernels, cost_kernels = r["convert_kernels"]
    assert kernels == cost_kernels
    roofline, cost_roofline = r["roofline"]  # the calibrated model's
    assert roofline == cost_roofline > 0
    peak, cost_peak = r["peak_roofline"]  # every kernel at the data-sheet peaks
    assert peak == pytest.approx(cost_peak, rel=1e-12) and 0 < peak <= roofline
    unmeasured, cost_unmeasured = r["unmeasured"]
    assert unmeasured == cost_unmeasured
    assert r["public_equal"]  # mpjax.report(..., target="h100") gives the same report


def test_h100x8_collectives_match_the_optimized_hlo(h100):
    s = h100["sharded"]
    assert s["report"] == [[op, dtype_name(dt), n] for op, dt, n in s["hlo"]]
    # bf16 on the GPU (XLA:CPU upcasts): the forward partial sums (32 rows / 2 data shards
    # x 128) and the weight gradient's shard (64 rows / 4 model shards x 128).
    assert s["report"] == [["all-reduce", "bfloat16", 16 * 128 * 2]] * 2


def test_h100_runs_every_fp8_gemm_in_fp8(h100):
    gemms = h100["fp8"]["gemms"]
    fp8 = sorted((path, direction) for path, direction, asked, _ in gemms if asked)
    assert fp8 == sorted(
        [("Dense_0", "forward"), ("Dense_0", "backward")]
        + [("mid", "forward"), ("mid", "backward"), ("mid", "backward")]
    )
    assert all(runs == asked for _, _, asked, runs in gemms)  # fp8 exactly where asked
    assert "5 fp8 GEMMs (Dense_0, mid), 5 run as fp8 on h100" in h100["fp8"]["summary"]


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory):
    # rows of the GPU cost guard's (tests/integration/test_gpu_cost_guard.py): read back
    # when it compiled them earlier in the session
    rows = [f"cost/{m}/{v}@h100" for m in ("resnet", "lm") for v in ("bf16", "policy-rules")]
    figures = quick_rows(rows, tmp_path_factory)
    return {(model, variant): f for (model, variant, _), f in figures.items()}


@pytest.mark.parametrize("model", ["resnet", "lm"])
@pytest.mark.parametrize("variant", ["bf16", "policy-rules"])
def test_report_totals_agree_with_the_cost_model(cost_model, model, variant):
    r = cost_model[(model, variant)]
    want: dict = {}
    for flops in (r["gemm_flops"], r["conv_flops"]):
        for key, n in flops.items():
            want[dtype_name(key)] = want.get(dtype_name(key), 0) + n
    report = r["report"]
    assert report["flops_by_dtype"] == want == {"bfloat16": sum(want.values())}
    # Every GEMM the program asks for is found in what runs (XLA merges GPT-2's q/k/v).
    assert report["unmatched_gemms"] == 0
    assert report["asked_flops_by_dtype"] == want
    assert report["convert_kernels"] == r["convert_kernels"]
    assert report["float32_modules"] == []
