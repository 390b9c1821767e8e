"""Block-scaled recipes compile to native block-scaled GEMMs for a deviceless B200.

`tests/fp8/_block_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
`gpu-aot` wheels, no GPU needed) and compiles one training step of a small transformer LM
under `autocast(..., fp8=Fp8Recipe(scaling, block_lowering="native"))` for the B200 target
(cuDNN 9.10): the GEMMs become `__cudnn$blockScaledDot` custom calls.
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json

BLOCK_DTYPES = {"mxfp8": "f8e4m3fn", "nvfp4": "f4e2m1fn"}


@pytest.fixture(scope="module")
def flops(tmp_path_factory):
    return _run_json("tests/fp8/_block_hlo.py", tmp=tmp_path_factory.mktemp("blocks"))


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_b200_step_runs_90_percent_of_gemm_flops_block_scaled(flops, scaling):
    by_dtype = flops[f"b200/{scaling}"]
    block = by_dtype.get(BLOCK_DTYPES[scaling], 0)
    total = sum(by_dtype.values())
    # the rest: attention's batched products (bf16) and NVFP4's Hadamard transforms
    assert block / total >= 0.9, by_dtype
