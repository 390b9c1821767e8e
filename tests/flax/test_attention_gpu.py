"""Attention under the bf16 policy on the deviceless H100 compile: no float32 GEMMs.

`tests/flax/_attention_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
environment with the `gpu-aot` wheels, as for tests/integration/test_gpu_cost_guard.py), with
`JAX_PLATFORMS=cpu`. Without the variable these tests fail under CI (`CI=true`) and are
skipped elsewhere, saying why.

Checked: the SGD train step of a small model (Linear, MultiHeadAttention with padding and causal
masks, Linear) under `params=float32,compute=bfloat16,output=float32` runs every GEMM, forward
and backward, on bfloat16 operands, for NNX (`float32_softmax_attention` of
mpjax/policy/nnx.py) and linen (mpjax/policy/linen.py). (`jax.nn.dot_product_attention`, which
Flax's NNX attention calls without dropout, has float32 backward GEMMs on XLA:GPU.)
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json

B, T, D = 8, 128, 256  # as in tests/flax/_attention_hlo.py
LINEAR = 2 * B * T * D * D  # one D x D projection GEMM
ATTENTION = 2 * B * T * T * D  # one attention GEMM (all heads)
# Linear in: forward and weight gradient; q, k, v, out and Linear out: forward and both
# gradients; logits and weighted sum: forward and both gradients.
TOTAL = (2 + 5 * 3) * LINEAR + 2 * 3 * ATTENTION


@pytest.fixture(scope="module")
def hlo(tmp_path_factory):
    return _run_json("tests/flax/_attention_hlo.py", tmp=tmp_path_factory.mktemp("attention"))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_bf16_policy_attention_train_step_has_only_bf16_gemms(hlo, api):
    assert hlo[api]["gemm_flops"] == {"bf16": TOTAL}
