"""benchmarks/blockwise_gemm_gpu.py runs (smoke: tiny shapes, kernels interpreted) and checks
each kernel's numbers against the XLA reference, as it will on the first GPU."""

from benchmarks.blockwise_gemm_gpu import blockwise_gemm_gpu
from mpjax._src.kernels import blockwise_gemm_mgpu as mgpu


def test_smoke_run_times_every_form_and_checks_the_kernels():
    result = blockwise_gemm_gpu(smoke=True)
    assert result["notes"].startswith("SMOKE RUN, NOT A MEASUREMENT")
    rows = {row[1]: row for row in result["rows"]}
    want = {"triton", "xla", "bf16", "fp8-tensorwise"}
    want |= {"mosaic_gpu"} if mgpu.INTERPRET_AVAILABLE else set()
    assert set(rows) == want, rows
    for impl in want & {"triton", "mosaic_gpu"}:
        assert float(rows[impl][5]) < 8e-3, rows[impl]  # one bfloat16 rounding of the result
    assert all(row[5] == "" for i, row in rows.items() if i not in ("triton", "mosaic_gpu"))
