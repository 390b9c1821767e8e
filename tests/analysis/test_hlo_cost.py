"""The GPU cost model's HLO analysis (benchmarks/hlo_cost.py) on hand-written XLA:GPU HLO."""
# ruff: noqa: E501 - HLO lines are as long as XLA prints them

import textwrap

import pytest

from mpjax._src.analysis import hlo_cost

HLO = textwrap.dedent(
    """\
    HloModule m

    %gemm_computation (p0: bf16[64,128], p1: f32[128,256]) -> bf16[64,256] {
      %p0 = bf16[64,128]{1,0} parameter(0)
      %p1 = f32[128,256]{1,0} parameter(1)
      %c = bf16[128,256]{1,0} convert(%p1)
      ROOT %dot.1 = bf16[64,256]{1,0} dot(%p0, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }

    %fused_cast (param_0: f32[8,16,16,32]) -> bf16[8,16,16,32] {
      %param_0 = f32[8,16,16,32]{3,2,1,0} parameter(0)
      ROOT %convert.3 = bf16[8,16,16,32]{3,2,1,0} convert(%param_0)
    }

    %fused_relu (param_0.1: bf16[8,16,16,64]) -> bf16[8,16,16,64] {
      %param_0.1 = bf16[8,16,16,64]{3,2,1,0} parameter(0)
      %zero = bf16[] constant(0)
      %b = bf16[8,16,16,64]{3,2,1,0} broadcast(%zero), dimensions={}
      ROOT %max.1 = bf16[8,16,16,64]{3,2,1,0} maximum(%param_0.1, %b)
    }

    ENTRY %main (a: bf16[64,128], w: f32[128,256], x: f32[8,16,16,32], k: bf16[64,3,3,32], g: f32[64,256]) -> (bf16[64,256], bf16[8,16,16,64], f32[64,256]) {
      %a = bf16[64,128]{1,0} parameter(0)
      %w = f32[128,256]{1,0} parameter(1)
      %x = f32[8,16,16,32]{3,2,1,0} parameter(2)
      %k = bf16[64,3,3,32]{3,2,1,0} parameter(3)
      %g = f32[64,256]{1,0} parameter(4)
      %gemm = bf16[64,256]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
      %cast = bf16[8,16,16,32]{3,2,1,0} fusion(%x), kind=kLoop, calls=%fused_cast
      %conv = (bf16[8,16,16,64]{3,2,1,0}, u8[0]{0}) custom-call(%cast, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
      %y = bf16[8,16,16,64]{3,2,1,0} get-tuple-element(%conv), index=0
      %relu = bf16[8,16,16,64]{3,2,1,0} fusion(%y), kind=kLoop, calls=%fused_relu
      %wt = f32[64,256]{1,0} custom-call(%g, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
      ROOT %t = (bf16[64,256]{1,0}, bf16[8,16,16,64]{3,2,1,0}, f32[64,256]{1,0}) tuple(%gemm, %relu, %wt)
    }
    """
)


def test_kernels_flops_bytes_and_converts():
    r = hlo_cost.analyze(HLO)
    assert [k.kind for k in r.kernels] == [
        "triton gemm",
        "loop fusion",
        "cudnn conv",
        "loop fusion",
        "cublas gemm",
    ]
    assert r.kernels_by_kind == {
        "triton gemm": 1,
        "loop fusion": 2,
        "cudnn conv": 1,
        "cublas gemm": 1,
    }
    # 2 * M * N * K per GEMM, keyed by the operand dtypes the dot sees.
    assert r.gemm_flops == {"bf16": 2 * 64 * 256 * 128, "f32": 2 * 64 * 256 * 256}
    assert r.gemms_by_dtype == {"bf16": 1, "f32": 1}
    # 2 * output elements * window * input features.
    assert r.conv_flops == {"bf16": 2 * (8 * 16 * 16 * 64) * 9 * 32}
    assert r.convs_by_dtype == {"bf16": 1}
    assert r.converts == 2
    assert r.convert_kernels == 1  # the cast fusion; the gemm fusion's convert is fused work
    gemm, cast, conv, relu, cublas = r.kernels
    assert gemm.bytes == 64 * 128 * 2 + 128 * 256 * 4 + 64 * 256 * 2
    assert cast.bytes == 8 * 16 * 16 * 32 * (4 + 2)
    assert conv.bytes == 8 * 16 * 16 * 32 * 2 + 64 * 9 * 32 * 2 + 8 * 16 * 16 * 64 * 2
    assert r.bytes == sum(k.bytes for k in r.kernels)
    assert relu.other_flops == 8 * 16 * 16 * 64  # one per element of the maximum
    # Memory-bound kernels take bytes / bandwidth; the roofline is their sum.
    assert cast.time_s == pytest.approx(cast.bytes / hlo_cost.HBM_BYTES_PER_S)
    assert r.roofline_s == pytest.approx(sum(k.time_s for k in r.kernels))


def test_compute_bound_kernel_uses_the_dtype_peak():
    big = HLO.replace("64,128", "8192,8192").replace("128,256", "8192,8192")
    big = big.replace("64,256", "8192,8192")
    gemm = hlo_cost.analyze(big).kernels[0]
    flops = 2 * 8192**3
    assert gemm.tensor_flops == {"bf16": flops}
    assert gemm.time_s == pytest.approx(flops / hlo_cost.PEAK_FLOPS["bf16"])


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_cost.analyze("HloModule m")


def test_while_body_counts_once_per_iteration():
    """A scan's body runs its known trip count times: its FLOPs and bytes count that often."""
    import jax
    import jax.numpy as jnp

    def scanned(x, length):
        body = lambda c, _: (jnp.tanh(c @ x), None)  # noqa: E731
        return jax.lax.scan(body, x, None, length=length)[0]

    x = jnp.ones((64, 64))
    reports = [
        hlo_cost.analyze(jax.jit(scanned, static_argnums=1).lower(x, n).compile().as_text())
        for n in (2, 8)
    ]
    assert reports[1].gemm_flops == {"f32": 8 * 2 * 64**3}
    assert reports[0].gemm_flops == {"f32": 2 * 2 * 64**3}
    assert len(reports[0].kernels) == len(reports[1].kernels)  # the same instructions
    assert reports[1].bytes > 3 * reports[0].bytes
