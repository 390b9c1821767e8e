"""Attention under the bf16 policy on the deviceless H100 compile: no float32 GEMMs.

`tests/flax/_attention_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
environment with the `gpu-aot` wheels, as for tests/integration/test_gpu_cost_guard.py), with
`JAX_PLATFORMS=cpu`. Without the variable these tests fail under CI (`CI=true`) and are
skipped elsewhere, saying why.

Checked: the SGD train step of a small model (Linear, MultiHeadAttention with padding and causal
masks, Linear) under `params=float32,compute=bfloat16,output=float32` runs every GEMM, forward
and backward, on bfloat16 operands, for NNX and linen, its attention as cuDNN's fused kernel
(one forward and one backward custom call; Flax's default attention replaced by
`mpjax._src.flax.fused_attention`); and under `mpjax.autocast` with the same policy, float32
code calling `jax.nn.dot_product_attention(..., implementation="cudnn")` and the linen model with
`attention_fn=mpjax.nn.dot_product_attention` run the same fused kernel forward and backward.
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json

B, T, D = 8, 128, 256  # as in tests/flax/_attention_hlo.py
LINEAR = 2 * B * T * D * D  # one D x D projection GEMM
ATTENTION = 2 * B * T * T * D  # one attention GEMM (all heads)
# Linear in: forward and weight gradient; q, k, v, out and Linear out: forward and both
# gradients; cuDNN's attention: 2 GEMMs forward, 5 backward (the logits recomputed).
TOTAL = (2 + 5 * 3) * LINEAR + 7 * ATTENTION
# A mask is cuDNN's bias; padding by lengths and causal are the kernel's own masks.
MASKED = ["__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"]
BY_LENGTHS = ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return _run_json("tests/flax/_attention_hlo.py", tmp=tmp_path_factory.mktemp("attention"))


@pytest.fixture
def hlo(figures):
    """The figures by program; reading a program that did not compile fails with its error."""

    class Programs(dict):
        def __getitem__(self, name):
            found = dict.__getitem__(self, name)
            if "error" in found:
                pytest.fail(f"program {name!r} did not compile: {found['error']}")
            return found

    return Programs(figures)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_bf16_policy_attention_train_step_has_only_bf16_gemms(hlo, api):
    assert hlo[api]["gemm_flops"] == {"bf16": TOTAL}


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_bf16_policy_attention_is_one_cudnn_kernel_forward_and_backward(hlo, api):
    assert hlo[api]["attention"] == MASKED


def test_autocast_runs_cudnn_dot_product_attention_in_bf16_forward_and_backward(hlo):
    # Before: NotImplementedError "Q must be fp16/bf16/..., got float32" while tracing.
    assert hlo["autocast"]["attention"] == BY_LENGTHS
    assert set(hlo["autocast"]["gemm_flops"]) == {"bf16"}


def test_autocast_with_the_mpjax_attention_fn_is_the_fused_kernel(hlo):
    assert hlo["autocast_linen"]["attention"] == MASKED
    assert hlo["autocast_linen"]["gemm_flops"] == {"bf16": TOTAL}
