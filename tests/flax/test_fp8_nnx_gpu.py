"""NNX delayed fp8 on the H100 compile (deviceless): the block GEMMs run as fp8 GEMMs.

Runs the benchmark suite's `fp8-nnx` cases (`benchmarks/run.py --quick --only fp8-nnx/`)
under `$MPJAX_GPU_AOT_PYTHON`, as the GPU cost guard
does (fails under CI without it, skipped elsewhere saying why), and checks the structure of
the compiled NNX LM train step with default compile options.
"""

import pytest

from tests.helpers.gpu import run_suite

pytestmark = pytest.mark.slow


def test_nnx_delayed_block_gemms_are_fp8_on_h100(tmp_path):
    figures = run_suite("--quick", "--only", "fp8-nnx/", tmp=tmp_path)
    by_variant = {variant: f for (_, variant, _), f in figures.items()}
    cfg = by_variant["nnx-fp8-delayed"]["config"]
    tokens, d = cfg["batch"] * cfg["seq"], cfg["d"]
    block = 3 * 2 * tokens * cfg["layers"] * (4 * d * d + 2 * d * cfg["mlp"])
    flops = by_variant["nnx-fp8-delayed"]["gemm_flops"]
    fp8 = {k: v for k, v in flops.items() if "f8" in k}
    # forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight gradient e4m3 x e5m2
    assert set(fp8) == {"f8e4m3fn", "f8e5m2xf8e4m3fn", "f8e4m3fnxf8e5m2"}
    assert sum(fp8.values()) >= 0.9 * block
    assert not any("f8" in k for k in by_variant["nnx-bf16"]["gemm_flops"])
