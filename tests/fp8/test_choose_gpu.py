"""What `choose="roofline"` counts, recounted from deviceless B200 compiles.

`tests/fp8/_choose_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
`gpu-aot` wheels, no GPU needed): NVFP4's gradient quantisation alone, and one GEMM's
forward and gradients under MXFP8 and NVFP4 (cuDNN block-scaled GEMMs).
"""

from __future__ import annotations

import pytest

from mpjax._src.fp8.choose import NVFP4_GRADIENT_BYTES
from tests.helpers.gpu import _run_json


@pytest.fixture(scope="module")
def hlo(tmp_path_factory):
    return _run_json("tests/fp8/_choose_hlo.py", tmp=tmp_path_factory.mktemp("choose"))


@pytest.mark.slow
def test_nvfp4_gradient_bytes_are_what_its_kernels_move(hlo):
    grad = hlo["nvfp4_gradient"]
    per_element = grad["bytes"] / grad["elements"]
    assert per_element == pytest.approx(NVFP4_GRADIENT_BYTES, rel=0.05), per_element


@pytest.mark.slow
def test_cudnn_gemms_write_what_the_chooser_counts(hlo):
    # MXFP8: the compute dtype (no float32 output to cast); NVFP4: float32, its tensor
    # scales divided out as each output is cast
    assert hlo["mxfp8_step"]["gemm_results"] == [["bf16", "u8"]] * 3
    assert hlo["nvfp4_step"]["gemm_results"] == [["f32", "u8"]] * 3
