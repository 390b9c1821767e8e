"""Tests for `mpjax.Fp8Recipe` and fp8 quantisation with current scaling (vs float64)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpjax import Fp8Recipe
from mpjax.fp8 import amax, compute_scale, dequantize, fp8_max, quantize

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
MANTISSA = {np.dtype(E4): 3, np.dtype(E5): 2}


def wide_range(rng, shape, lo=-12, hi=12):
    """Random signs times log-uniform magnitudes 2**lo .. 2**hi (float32)."""
    mag = 2.0 ** rng.uniform(lo, hi, shape)
    return (rng.choice([-1.0, 1.0], shape) * mag).astype(np.float32)


# ----------------------------------------------------------------------------- recipe


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"forward_dtype": jnp.bfloat16}, "forward_dtype"),
        ({"backward_dtype": jnp.float16}, "backward_dtype"),
        ({"forward_dtype": "int8"}, "forward_dtype"),
        ({"margin": -1.0}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"amax_history_len": -3}, "amax_history_len"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"scaling": "blocks"}, "scaling"),
        ({"block_lowering": "cudnn"}, "block_lowering"),
        ({"amax_compute": "mean"}, "amax_compute"),
        ({"min_dim": 8}, "min_dim"),
    ],
)
def test_recipe_rejects_bad_fields(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        Fp8Recipe(**kwargs)


def test_recipe_defaults_hashable_and_static():
    r = Fp8Recipe()
    assert r.forward_dtype == np.dtype(E4) and r.backward_dtype == np.dtype(E5)  # HYBRID
    assert r.scaling == "tensorwise" and r.amax_compute == "max" and r.margin == 0
    assert r.amax_history_len == 1024 and not r.power_of_two
    assert Fp8Recipe(scaling="rowwise").power_of_two
    assert hash(Fp8Recipe(exclude=["*/head"])) == hash(Fp8Recipe(exclude=("*/head",)))
    all_e4m3 = Fp8Recipe(backward_dtype=E4)
    assert all_e4m3.backward_dtype == np.dtype(E4)
    f = jax.jit(lambda x, r: x * r.margin, static_argnums=1)
    assert float(f(jnp.float32(2.0), Fp8Recipe(margin=1.0))) == 2.0


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_round_trip_within_format_rounding(dtype, power_of_two):
    rng = np.random.default_rng(1)
    x = wide_range(rng, (257, 31))
    scale = compute_scale(amax(x), dtype, power_of_two=power_of_two)
    back = np.asarray(dequantize(quantize(x, scale, dtype), scale), np.float64)
    s = np.float64(scale)
    x64 = np.asarray(x, np.float64)
    info = ml_dtypes.finfo(dtype)
    # half an ulp relative in the normal range; half the subnormal spacing below it
    bound = np.maximum(
        np.abs(x64) * 2.0 ** -(MANTISSA[np.dtype(dtype)] + 1),
        float(info.smallest_subnormal) / 2 / s,
    )
    assert np.all(np.abs(back - x64) <= bound * (1 + 1e-6))
    # the largest magnitude lands at the top of the range (within one rounding)
    top = float(np.max(np.abs(np.asarray(quantize(x, scale, dtype), np.float64))))
    limit = 0.5 if power_of_two else 1.0
    assert limit * fp8_max(dtype) * (1 - 2.0**-3) <= top <= fp8_max(dtype)


@pytest.mark.parametrize("dtype, top", [(E4, 448.0), (E5, 57344.0)])
def test_saturates_never_inf(dtype, top):
    x = jnp.asarray([1e6, -1e6, np.inf, -np.inf, 3e38, 1.0], jnp.float32)
    q = np.asarray(quantize(x, jnp.float32(1.0), dtype), np.float64)
    np.testing.assert_array_equal(q, [top, -top, top, -top, top, 1.0])
    assert fp8_max(dtype) == top


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("where", [0, 50, 99])
def test_nan_propagates(dtype, where, jit):
    x = jnp.asarray(wide_range(np.random.default_rng(2), (100,))).at[where].set(jnp.nan)
    a = (jax.jit(amax) if jit else amax)(x)  # XLA:CPU's jitted max alone drops the NaN
    assert np.isnan(float(a))
    scale = compute_scale(a, dtype, power_of_two=True)
    q = np.asarray(quantize(x, scale, dtype), np.float32)
    assert np.all(np.isnan(q))  # a NaN scale spoils the tensor: never a finite result
    q1 = np.asarray(quantize(x, jnp.float32(1.0), dtype), np.float32)
    assert np.isnan(q1[where]) and np.isfinite(np.delete(q1, where)).all()


@pytest.mark.parametrize("dtype", [E4, E5])
def test_inf_amax_gives_nan_not_finite(dtype):
    x = jnp.asarray([1.0, jnp.inf, 2.0], jnp.float32)
    scale = compute_scale(amax(x), dtype)
    assert float(scale) == 0.0
    q = np.asarray(quantize(x, scale, dtype), np.float32)
    assert np.isnan(q[1])


@pytest.mark.parametrize("power_of_two", [False, True])
def test_amax_zero_gives_finite_scale(power_of_two):
    z = jnp.zeros((4, 32), jnp.float32)
    s = compute_scale(amax(z), E4, power_of_two=power_of_two)
    assert float(s) == 1.0
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(z, s, E4), s)), 0.0)
    tiny = compute_scale(jnp.float32(1e-45), E4)  # subnormal amax: finite clamp
    assert np.isfinite(float(tiny)) and float(tiny) > 0


def test_margin_and_power_of_two():
    a = jnp.float32(3.0)
    assert float(compute_scale(a, E4, margin=2.0)) == pytest.approx(448 / 3 / 4, rel=1e-6)
    s = float(compute_scale(a, E4, power_of_two=True))
    assert s == 128.0  # largest power of two <= 448/3 = 149.3


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_a_nan_reaches_the_amax_of_its_rows_under_jit(axis):
    x = jnp.ones((256, 256)).at[159, 198].set(jnp.nan)
    a = np.asarray(jax.jit(lambda x: amax(x, axis))(x))
    want = np.max(np.abs(np.asarray(x)), axis=axis, keepdims=axis is not None)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(want))
    assert np.isnan(a).any()


def test_rowwise_scales_per_row():
    rng = np.random.default_rng(3)
    x = wide_range(rng, (16, 64), -2, 2) * (2.0 ** np.arange(-8, 8, dtype=np.float32))[:, None]
    a = amax(x, axis=1)
    assert a.shape == (16, 1)
    np.testing.assert_allclose(np.asarray(a)[:, 0], np.abs(x).max(axis=1))
    s = compute_scale(a, E4, power_of_two=True)
    q = np.asarray(quantize(x, s, E4), np.float64)
    row_top = np.abs(q).max(axis=1)
    assert np.all(row_top > 448 / 2 * (1 - 2.0**-3)) and np.all(row_top <= 448)
    log = np.log2(np.asarray(s)[:, 0])
    np.testing.assert_array_equal(log, np.round(log))  # exact powers of two
    back = np.asarray(dequantize(q.astype(np.float32), s), np.float64)
    rel = np.abs(back - x) / np.abs(x)
    normal = np.abs(q) >= float(ml_dtypes.finfo(E4).smallest_normal)
    assert np.all(rel[normal] <= 2.0**-4 * (1 + 1e-6))


@pytest.mark.parametrize(("platform", "reductions"), [("cuda", 1), ("cpu", 2)])
def test_amax_reads_its_input_once_on_the_gpu(platform, reductions):
    # XLA:GPU's max keeps a NaN: one reduction there; XLA:CPU's jitted max can drop it, so
    # the CPU program adds an isnan reduction (it cost a GPT-2 small tensorwise step on the
    # B200 5 % when it ran on the GPU too)
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    module = jax.export.export(jax.jit(amax), platforms=(platform,))(x).mlir_module()
    assert module.count("stablehlo.reduce") == reductions
