"""`roofline_seconds`: a report's kernels re-timed on another GPU's data-sheet peaks."""

from __future__ import annotations

from mpjax._src.analysis.hlo_cost import HloReport, Kernel
from mpjax._src.analysis.peaks import B200, H100, Peaks, roofline_seconds


def _kernel(tensor_flops, other, nbytes):
    return Kernel("k", "fusion", nbytes, tensor_flops, tensor_flops, {}, other, 0.0, False)


def _report(*kernels):
    return HloReport(kernels, {}, {}, {}, {}, {}, 0, 0, 0, 0.0)


def test_compute_bound_kernels_use_the_dtype_peak_and_mixed_operands_the_slower():
    toy = Peaks("toy", {"bf16": 100.0, "f8e4m3fn": 200.0}, 10.0, 1.0)
    report = _report(
        _kernel({"f8e4m3fn": 400}, 0, 1),  # 2 s of fp8
        _kernel({"f8e4m3fnxbf16": 400}, 10, 1),  # 4 s at the bf16 rate + 1 s vector
        _kernel({}, 0, 3),  # memory bound: 3 s
    )
    assert roofline_seconds(report, toy) == 2.0 + 5.0 + 3.0


def test_b200_runs_fp4_twice_as_fast_as_fp8_and_h100_has_no_fp4_peak():
    report = _report(_kernel({"f4e2m1fn": 9e15}, 0, 0), _kernel({"f8e4m3fn": 4.5e15}, 0, 0))
    assert roofline_seconds(report, B200) == 2.0
    # the H100 has no fp4 tensor cores: its FLOPs fall back to the vector rate
    assert roofline_seconds(report, H100) > 100.0
