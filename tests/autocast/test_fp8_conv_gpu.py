"""fp8 convolutions on the deviceless H100 compile (XLA:GPU, default flags).

`tests/autocast/_fp8_conv_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
environment with the `gpu-aot` wheels, as for tests/integration/test_gpu_cost_guard.py), with
`JAX_PLATFORMS=cpu`. Without the variable these tests fail under CI (`CI=true`) and are
skipped elsewhere, saying why.

Checked: under `autocast(fp8=Fp8Recipe(convs="1x1"))` a 1x1 convolution's forward and both
gradient GEMMs have fp8 operands in the optimized HLO and the 3x3 convolution stays bf16; and
the XLA facts behind the fallback (mpjax/fp8/conv.py): a direct e4m3 forward or stride-1
input-gradient convolution is a cuDNN fp8 graph convolution, while the weight-gradient
convolution is a bf16 (f32 in the dequantise form) cuDNN backward-filter convolution;
mixed-format input gradients fuse only in the dequantise form with the kernel flipped in fp8;
a strided input gradient runs on a zero-dilated gradient. If XLA gains an fp8 weight-gradient
convolution, `test_xla_runs_no_fp8_weight_gradient_convolution` fails: time to revisit.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.gpu import ROOT, _gpu_aot_python, gpu_aot_env

N, HW, C = 8, 16, 128  # as in tests/autocast/_fp8_conv_hlo.py
GEMM_FLOPS = 2 * N * HW * HW * C * C  # the 1x1 conv as a GEMM
CONV3_FLOPS = 9 * GEMM_FLOPS


@pytest.fixture(scope="module")
def hlo():
    proc = subprocess.run(
        [_gpu_aot_python(), str(ROOT / "tests" / "autocast" / "_fp8_conv_hlo.py")],
        cwd=ROOT,
        env=gpu_aot_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_autocast_1x1_conv_runs_fp8_gemms_forward_and_backward(hlo):
    r = hlo["autocast"]
    # forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight gradient e4m3 x e5m2
    assert r["gemm_flops"] == {
        "f8e4m3fn": GEMM_FLOPS,
        "f8e5m2xf8e4m3fn": GEMM_FLOPS,
        "f8e4m3fnxf8e5m2": GEMM_FLOPS,
    }
    # the 3x3 conv (forward, input and weight gradient) is bf16 (the documented fallback)
    assert r["conv_flops"] == {"bf16": 3 * CONV3_FLOPS}


def test_xla_runs_direct_fp8_forward_and_input_gradient_convs_in_fp8(hlo):
    for name in ("fwd", "dgrad"):
        assert hlo[name]["targets"] == ["__cudnn$convForwardGraph"], name
        assert hlo[name]["conv_flops"] == {"f8e4m3fn": CONV3_FLOPS}, name


def test_xla_runs_no_fp8_weight_gradient_convolution(hlo):
    assert hlo["wgrad"]["targets"] == ["__cudnn$convBackwardFilter"]
    assert hlo["wgrad"]["conv_flops"] == {"bf16": CONV3_FLOPS}  # fp8 operands upcast first
    assert hlo["wgrad_deq"]["targets"] == ["__cudnn$convBackwardFilter"]
    assert hlo["wgrad_deq"]["conv_flops"] == {"f32": CONV3_FLOPS}


def test_dequantise_form_input_gradient_is_fp8_only_with_the_kernel_flipped_in_fp8(hlo):
    # e5m2 gradient x e4m3 kernel: mixed formats fuse into one fp8 graph (scales inside)
    assert hlo["dgrad_deq"]["targets"] == ["__cudnn$convForwardGraph"]
    assert hlo["dgrad_deq"]["conv_flops"] == {"f8e5m2xf8e4m3fn": CONV3_FLOPS}
    # flipping the dequantised kernel (jax's transpose-rule order) gives a TF32 conv
    assert hlo["dgrad_deq_flip_after"]["targets"] == ["__cudnn$convForward"]
    assert hlo["dgrad_deq_flip_after"]["conv_flops"] == {"f32": CONV3_FLOPS}


def test_strided_input_gradient_runs_on_a_zero_dilated_gradient(hlo):
    # an fp8 graph over the 16x16 zero-dilated gradient: 4x the stride-2 conv's multiply-adds
    assert hlo["dgrad_stride2"]["targets"] == ["__cudnn$convForwardGraph"]
    assert hlo["dgrad_stride2"]["conv_flops"] == {"f8e4m3fn": CONV3_FLOPS}
