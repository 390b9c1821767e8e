"""`Fp8Recipe(choose="roofline", target=...)`: each GEMM's format from its roofline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax import Fp8Recipe
from mpjax._src.core.gpu_peaks import GPU_PEAKS
from mpjax._src.fp8.choose import COMPUTE, NVFP4_GRADIENT_BYTES, choose_gemm_format
from mpjax._src.fp8.recipe import Fp8Site
from mpjax.fp8 import fp8_dot_general, fp8_ops

DIMS = (((1,), (0,)), ((), ()))
LARGE = 16384  # big enough that NVFP4's gradient quantisation pays on the B200 too


def _op(recipe, m, k, n):
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32))
    (op,) = fp8_ops(lambda x, w: x @ w, recipe, *args)
    return op


def _program(recipe, m, k, n) -> str:
    """The traced forward and backward of one GEMM under `recipe` (shapes only)."""

    def step(x, w):
        out, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, DIMS, recipe, jnp.bfloat16), x, w)
        return vjp(out)

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    return str(jax.make_jaxpr(step)(*args))


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_b200_small_gemm_stays_in_bf16_large_takes_the_block_format(scaling):
    recipe = Fp8Recipe(scaling, choose="roofline", target="b200")
    small = _op(recipe, 128, 128, 128)
    assert not small.fp8 and small.reason.startswith("memory bound on b200 (128x128x128)")
    assert small.reason == small.choice and "bfloat16" in small.reason
    large = _op(recipe, *[LARGE] * 3)
    assert large.fp8 and large.lowering.endswith(scaling) and not large.reason
    assert large.choice.startswith("pays on b200") and scaling in large.choice
    # the program: no fp8 at all for the small GEMM; block scales for the large one
    assert "float8" not in _program(recipe, 128, 128, 128)
    assert "float8_e8m0fnu" in _program(
        Fp8Recipe("mxfp8", choose="roofline", target="b200"), *[8192] * 3
    )


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_h100_never_picks_mx_or_nvfp4_but_picks_tensorwise(scaling):
    recipe = Fp8Recipe(scaling, choose="roofline", target="h100")
    large = _op(recipe, 8192, 8192, 8192)
    assert large.fp8 and large.lowering == "fp8 tensorwise"
    assert f"no native {scaling} on h100" in large.choice
    program = _program(recipe, 8192, 8192, 8192)
    assert "float8_e4m3fn" in program and "float8_e5m2" in program  # tensorwise's formats
    assert "e8m0" not in program and "float4" not in program
    assert not _op(recipe, 128, 128, 128).fp8


def test_h100_blockwise_follows_the_calibration():
    # auto: mpjax's Pallas blockwise GEMM measured slower than bf16 on Hopper (the
    # calibration table's lowerings), so it is no candidate and tensorwise stands in
    recipe = Fp8Recipe("blockwise", choose="roofline", target="h100")
    large = _op(recipe, 8192, 8192, 8192)
    assert large.fp8 and large.lowering == "fp8 tensorwise", large
    assert "no native blockwise on h100" in large.choice
    # native asked for: a candidate, timed at the kernel's measured efficiency, which loses
    native = Fp8Recipe("blockwise", choose="roofline", target="h100", block_lowering="native")
    choice = _choice(native, 8192, 8192, 8192)
    assert "blockwise" in choice.seconds and choice.format == "tensorwise"
    assert choice.seconds["blockwise"] > choice.seconds[COMPUTE]
    assert not _op(recipe, 128, 128, 128).fp8


def test_roofline_is_monotone_in_size_and_the_compute_path_is_exact():
    recipe = Fp8Recipe("tensorwise", choose="roofline", target="h100", min_dim=16)
    chosen = [_op(recipe, s, s, s).fp8 for s in (64, 256, 1024, 4096, 16384)]
    assert chosen == sorted(chosen) and chosen[0] is False and chosen[-1] is True
    x = jax.random.normal(jax.random.key(0), (64, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 64)).astype(jnp.bfloat16)
    got = fp8_dot_general(x, w, DIMS, recipe, jnp.bfloat16)  # memory bound: the compute dtype
    want = jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_choose_and_target_are_named():
    with pytest.raises(ValueError, match="target=None.*choose='roofline'"):
        Fp8Recipe("mxfp8", choose="roofline")
    with pytest.raises(ValueError, match="target='a100'"):
        Fp8Recipe("mxfp8", choose="roofline", target="a100")
    with pytest.raises(ValueError, match="target='b200' is read only with choose='roofline'"):
        Fp8Recipe("mxfp8", target="b200")
    with pytest.raises(ValueError, match="choose='auto'"):
        Fp8Recipe("mxfp8", choose="auto")
    with pytest.raises(ValueError, match="choose='roofline' with scaling='delayed'"):
        Fp8Recipe("delayed", choose="roofline", target="h100")


def test_fp8_ops_gives_a_1x1_convs_choice_too():
    recipe = Fp8Recipe("mxfp8", convs="1x1", min_dim=16, choose="roofline", target="b200")

    def conv(x, w):
        dn = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)

    def ops(pixels, channels):
        x = jax.ShapeDtypeStruct((1, pixels, pixels, channels), jnp.float32)
        w = jax.ShapeDtypeStruct((1, 1, channels, channels), jnp.float32)
        (op,) = fp8_ops(conv, recipe, x, w)
        return op

    small, large = ops(8, 64), ops(128, 8192)
    assert not small.fp8 and small.reason.startswith("memory bound on b200 (64x64x64)")
    assert large.fp8 and large.lowering.endswith("mxfp8") and "16384x8192x8192" in large.choice


# The suite's LMs (benchmarks/train_models.py), M = batch x sequence tokens: GPT-2 small
# (8 x 1024, d 768, MLP 3072) and the wide LM (4 x 2048, d 4096, MLP 16384). Each dense
# GEMM as `(K, N)`: the attention projections, the MLP's up and down projections.
GPT2_M, GPT2_GEMMS = 8 * 1024, ((768, 768), (768, 3072), (3072, 768))
WIDE_M, WIDE_GEMMS = 4 * 2048, ((4096, 4096), (4096, 16384), (16384, 4096))


def _choice(recipe, m, k, n):
    dims = (((1,), (0,)), ((), ()))
    return choose_gemm_format(recipe, Fp8Site("", (m, k), (k, n), dims), jnp.bfloat16)


def test_b200_gpt2_small_keeps_bf16_where_nvfp4_quantisation_costs_more():
    # The suite's NVFP4 GPT-2 step under the old model was 1.30x bf16 (its MLP in NVFP4):
    # its gradients go through XLA's quantiser, its GEMMs write float32
    recipe = Fp8Recipe("nvfp4", choose="roofline", target="b200")
    choices = {kn: _choice(recipe, GPT2_M, *kn) for kn in GPT2_GEMMS}
    assert {kn: c.format for kn, c in choices.items()} == dict.fromkeys(GPT2_GEMMS, COMPUTE)
    bw = GPU_PEAKS["b200"].hbm_bytes_per_s
    for (_, n), choice in choices.items():
        nvfp4 = choice.parts["nvfp4"]
        assert {"amax", "output cast", "scale layout"} <= set(nvfp4)
        # g's quantisation alone (XLA's reference) moves NVFP4_GRADIENT_BYTES per element
        assert nvfp4["quantise"] > NVFP4_GRADIENT_BYTES * GPT2_M * n / bw
    # the attention projections: MXFP8's quantisation costs more than its GEMMs save
    mxfp8 = Fp8Recipe("mxfp8", choose="roofline", target="b200")
    assert _choice(mxfp8, GPT2_M, 768, 768).format == COMPUTE


def test_wide_lm_big_gemms_keep_the_block_format():
    mxfp8 = Fp8Recipe("mxfp8", choose="roofline", target="b200")
    choices = {kn: _choice(mxfp8, WIDE_M, *kn) for kn in WIDE_GEMMS}
    assert {kn: c.format for kn, c in choices.items()} == dict.fromkeys(WIDE_GEMMS, "mxfp8")
    # NVFP4 too, now that its stochastically rounded gradient goes through the fused
    # quantiser (7.6 bytes per element of g; XLA's reference moved 44 and made tensorwise
    # fp8 the faster choice wherever g was the big tensor)
    nvfp4 = Fp8Recipe("nvfp4", choose="roofline", target="b200")
    formats = {kn: _choice(nvfp4, WIDE_M, *kn).format for kn in WIDE_GEMMS}
    assert formats == dict.fromkeys(WIDE_GEMMS, "nvfp4")


def test_parts_sum_to_each_candidates_time():
    recipe = Fp8Recipe("mxfp8", choose="roofline", target="b200")
    choice = _choice(recipe, GPT2_M, 768, 3072)
    assert set(choice.parts) == set(choice.seconds) == {COMPUTE, "mxfp8", "tensorwise"}
    for fmt, parts in choice.parts.items():
        assert sum(parts.values()) == pytest.approx(choice.seconds[fmt])
    assert set(choice.parts[COMPUTE]) == {"gemms"}
    # tensorwise: amax and quantise passes, and the scales divided out of each output
    assert set(choice.parts["tensorwise"]) == {"gemms", "amax", "quantise", "rescale"}
    # MXFP8: the fused quantiser, cuDNN's scale layout; no amax, no output pass
    assert set(choice.parts["mxfp8"]) == {"gemms", "quantise", "scale layout"}
