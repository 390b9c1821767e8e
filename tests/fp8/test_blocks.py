"""`quantize_blocks` / `dequantize_blocks` against a NumPy reference written from the specs.

The reference follows the recipes' definitions (OCP MX v1.0 with NVIDIA's round-up scale,
NVIDIA's NVFP4 recipe, DeepSeek-V3's blockwise fp8) element by element in float64, with a
round-to-nearest-even onto each format's grid enumerated from its bit patterns; only the
scale arithmetic the recipes define in float32 is done in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpjax import Fp8Recipe
from mpjax.fp8 import BlockQuantized, block_shape, dequantize_blocks, quantize_blocks


def _grid(dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative value of `dtype` (sorted) and whether its bit pattern is even."""
    dtype = np.dtype(dtype)
    codes = np.arange(16 if dtype == np.dtype(ml_dtypes.float4_e2m1fn) else 256, dtype=np.uint8)
    values = codes.view(dtype).astype(np.float64)
    keep = np.isfinite(values) & ~np.signbit(values)
    values, codes = values[keep], codes[keep]
    order = np.argsort(values)
    return values[order], (codes[order] % 2 == 0)


def _round_even(v: np.ndarray, dtype) -> np.ndarray:
    """Round-to-nearest-even of float64 `v` (within the format's range) onto `dtype`'s grid."""
    grid, even = _grid(dtype)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    lo = np.where(grid[hi] == a, hi, lo)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(even[lo], lo, hi)))
    return np.sign(v) * grid[pick]


def _blocks(x: np.ndarray, block: tuple[int, ...]):
    """Yields (index tuple of the block, slices) for every block of `x`."""
    ranges = [range(0, n, b) for n, b in zip(x.shape, block, strict=True)]
    for starts in np.ndindex(*[len(r) for r in ranges]):
        sl = tuple(
            slice(r[i], min(r[i] + b, n))
            for r, i, b, n in zip(ranges, starts, block, x.shape, strict=True)
        )
        yield starts, sl


def _close_f32(got, want) -> bool:
    """Float32 division on XLA:CPU is not correctly rounded: allow one ulp."""
    return abs(np.float64(got) - np.float64(want)) <= np.spacing(np.float32(want))


def _pow2_scale(amax: float) -> int:
    """The smallest k with amax / 2**k <= 448 (NVIDIA's round-up: nothing saturates)."""
    k = int(np.floor(np.log2(amax))) - 10
    while amax > 448.0 * 2.0**k:
        k += 1
    return k


def _reference(x: np.ndarray, bq, scaling: str, power_of_two=False):
    """(exact pre-rounding elements, data, scales, tensor scale) per the recipe's spec.

    Scales the recipes define as a float32 quotient are checked to one ulp and the
    implementation's value is then used, so the elements are checked given their scale.
    """
    block = bq.block
    x = x.astype(np.float64)
    exact, data = np.zeros_like(x), np.zeros_like(x)
    scales = np.zeros(tuple(-(-n // b) for n, b in zip(x.shape, block, strict=True)))
    tensor = None
    if scaling == "nvfp4":
        amax_t = np.float32(np.abs(x).max())
        want = np.float32(1.0) if amax_t == 0 else np.float32(448.0 * 6.0) / amax_t
        tensor = np.float32(bq.tensor_scale)
        assert _close_f32(tensor, want)
    got_scales = np.asarray(bq.scales, np.float64)
    for idx, sl in _blocks(x, block):
        xb = x[sl]
        amax = np.abs(xb).max()
        if scaling == "mxfp8":
            k = min(max(_pow2_scale(amax), -127), 127) if amax else -127
            scales[idx] = 2.0**k
            exact[sl] = xb / 2.0**k
            data[sl] = _round_even(exact[sl], ml_dtypes.float8_e4m3fn)
        elif scaling == "blockwise":
            if not amax:
                s = np.float32(1.0)
            elif power_of_two:
                s = np.float32(2.0 ** _pow2_scale(amax))
            else:
                s = np.float32(amax) / np.float32(448.0)
                assert _close_f32(got_scales[idx], s)
                s = np.float32(got_scales[idx])
            scales[idx] = s
            exact[sl] = np.clip(xb / np.float64(s), -448, 448)
            data[sl] = _round_even(exact[sl], ml_dtypes.float8_e4m3fn)
        else:
            sb = np.float32(np.float32(amax) / np.float32(6.0)) * tensor
            sb = _round_even(np.array([min(sb, np.float32(448.0))]), ml_dtypes.float8_e4m3fn)[0]
            scales[idx] = sb
            if sb:
                enc = np.float64(np.float32(tensor) / np.float32(sb))
                exact[sl] = np.clip(xb * enc, -6, 6)
                data[sl] = _round_even(exact[sl], ml_dtypes.float4_e2m1fn)
    return exact, data, scales, tensor


def _assert_rounded(got: np.ndarray, exact: np.ndarray, want: np.ndarray) -> None:
    """`got` equals `want` (nearest even of `exact`), except where `exact` lies within
    2**-20 (relative) of a tie between two grid values, where one-ulp float32 arithmetic
    upstream (the platform's division) may tip it to the other neighbour."""
    differ = got != want
    if not differ.any():
        return
    midpoint = (got[differ] + want[differ]) / 2
    assert np.all(np.abs(exact[differ] - midpoint) <= 2**-20 * np.abs(midpoint)), (
        f"{differ.sum()} elements are not the nearest-even value and not near a tie"
    )


_q = jax.jit(quantize_blocks, static_argnums=1, static_argnames=("axis", "role"))
_dq = jax.jit(dequantize_blocks)


def _wide_range(key, shape, binades=40):
    """Values spanning `binades` binades (2**-20 .. 2**20), random signs."""
    k1, k2, k3 = jax.random.split(key, 3)
    e = jax.random.uniform(k1, shape, minval=-binades / 2, maxval=binades / 2)
    m = 1.0 + jax.random.uniform(k2, shape)
    s = jnp.where(jax.random.bernoulli(k3, 0.5, shape), 1.0, -1.0)
    return np.asarray(s * m * 2.0**e, np.float32)


CASES = [
    ("mxfp8", "activation", (4, 96), -1),
    ("mxfp8", "weight", (100, 6), 0),  # a partial block of 4 along the contraction axis
    ("nvfp4", "activation", (5, 40), -1),
    ("nvfp4", "weight", (40, 24), 0),  # 16x16 blocks, partial on both axes
    ("blockwise", "gradient", (3, 300), -1),
    ("blockwise", "weight", (130, 200), 0),
]


def _inputs(shape):
    x = _wide_range(jax.random.key(sum(shape)), shape)
    x = x.copy()
    x.reshape(-1)[:16] = 0.0  # a zero run (a whole zero block for the 1-D-block cases)
    x.reshape(-1)[-1] = 3.0e4  # a single outlier in the last block
    return x


@pytest.mark.parametrize(
    "scaling, role, shape, axis, jit", [(*c, True) for c in CASES] + [(*CASES[3], False)]
)
def test_matches_the_spec(scaling, role, shape, axis, jit):
    x = _inputs(shape)
    fn = lambda v: quantize_blocks(v, Fp8Recipe(scaling=scaling), axis=axis, role=role)
    bq = (jax.jit(fn) if jit else fn)(jnp.asarray(x))
    assert bq.block == block_shape(scaling, len(shape), axis, role)
    exact, data, scales, tensor = _reference(x, bq, scaling)
    np.testing.assert_array_equal(np.asarray(bq.scales, np.float64), scales)
    _assert_rounded(np.asarray(bq.data, np.float64), exact, data)
    assert (bq.tensor_scale is None) == (tensor is None)
    got_data = np.asarray(bq.data, np.float64)
    block = bq.block
    expect = (
        got_data * np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[: shape[0], : shape[1]]
    )
    if tensor is not None:
        expect = expect / np.float64(tensor)
    got = np.asarray(dequantize_blocks(bq), np.float64)
    tiny = np.abs(expect) < np.finfo(np.float32).tiny  # XLA:CPU flushes float32 subnormals
    np.testing.assert_allclose(got[~tiny], expect[~tiny], rtol=2**-22)


def test_blockwise_power_of_two_scales_round_up():
    x = _inputs((2, 256))
    bq = _q(jnp.asarray(x), Fp8Recipe(scaling="blockwise", power_of_two_scale=True))
    exact, data, scales, _ = _reference(x, bq, "blockwise", power_of_two=True)
    np.testing.assert_array_equal(np.asarray(bq.scales, np.float64), scales)
    np.testing.assert_array_equal(np.asarray(bq.data, np.float64), data)  # exact scaling
    assert np.all(np.log2(scales) == np.round(np.log2(scales)))


def test_mxfp8_scales_are_the_smallest_power_of_two_that_avoids_saturation():
    # 448 fits at scale 1; 449 needs scale 2 (NVIDIA's round-up: nothing saturates).
    x = jnp.array([[448.0] + [1.0] * 31, [449.0] + [1.0] * 31, [0.0] * 32])
    bq = _q(x, "mxfp8")
    assert np.asarray(bq.scales, np.float64).ravel().tolist() == [1.0, 2.0, 2.0**-127]
    assert float(_dq(bq)[1, 0]) == 448.0  # 449 / 2 = 224.5 -> 224 (even)


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
def test_inf_or_nan_poisons_only_its_block(scaling):
    x = np.ones((3, 256), np.float32)
    x[0, 5], x[1, 200] = np.inf, np.nan
    out = np.asarray(_dq(_q(jnp.asarray(x), scaling)))
    size = block_shape(scaling, 2, -1)[1]
    assert np.isnan(out[0, :size]).all() and np.isfinite(out[0, size:]).all()
    start = (200 // size) * size
    assert np.isnan(out[1, start : start + size]).all()
    assert np.isfinite(out[1, :start]).all() and np.isfinite(out[2]).all()


def test_nvfp4_inf_or_nan_poisons_the_tensor():
    x = np.ones((2, 32), np.float32)
    x[0, 3] = np.inf
    out = np.asarray(_dq(_q(jnp.asarray(x), "nvfp4")))
    assert np.isnan(out).all()


def test_nvfp4_stochastic_rounding_is_unbiased_and_keyed():
    x = jnp.asarray(_wide_range(jax.random.key(3), (4, 64), binades=6))
    q = jax.jit(jax.vmap(lambda k: _dq(_q(x, "nvfp4", role="gradient", key=k))))
    keys = jax.random.split(jax.random.key(0), 2000)
    samples = np.asarray(q(keys), np.float64)
    near = _q(x, "nvfp4")
    nearest = np.asarray(_dq(near), np.float64)
    # Away from saturation (a block's largest element can exceed 6 after the e4m3 rounding
    # of its scale, and is then clipped), the mean converges to x; nearest keeps its bias.
    inside = np.abs(np.asarray(near.data, np.float64)) < 6
    err = np.abs(samples.mean(0) - np.asarray(x, np.float64))[inside]
    spread = (samples.std(0) / np.sqrt(len(keys)))[inside]
    assert inside.mean() > 0.8
    assert np.all(err <= 5 * spread + 1e-6)
    assert np.abs(nearest - np.asarray(x))[inside].mean() > 10 * err.mean()
    same = q(jnp.stack([keys[0], keys[0]]))
    np.testing.assert_array_equal(same[0], same[1])
    # values already on the grid never move
    on_grid = jnp.asarray(nearest, jnp.float32)
    again = np.asarray(_dq(_q(on_grid, "nvfp4", key=keys[1])))
    np.testing.assert_array_equal(again, nearest.astype(np.float32))


def test_axis_is_the_contraction_axis():
    x = jnp.asarray(_inputs((64, 96)))
    a = _q(x, "mxfp8", axis=0)
    b = _q(x.T, "mxfp8", axis=-1)
    np.testing.assert_array_equal(np.asarray(a.data, np.float32), np.asarray(b.data, np.float32).T)
    np.testing.assert_array_equal(
        np.asarray(a.scales, np.float32), np.asarray(b.scales, np.float32).T
    )


def test_is_a_pytree_that_survives_jit():
    bq = _q(jnp.ones((4, 64)), "blockwise")
    assert isinstance(bq, BlockQuantized)
    out = jax.jit(lambda b: dequantize_blocks(b, jnp.bfloat16))(bq)
    assert out.dtype == jnp.bfloat16 and float(out.sum()) == 256.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_blocks(jnp.ones((4, 32)), "tensorwise"), "not block-scaled"),
        (lambda: quantize_blocks(jnp.ones((4, 32)), "mxfp8", role="bias"), "role='bias'"),
        (lambda: quantize_blocks(jnp.ones((2, 4, 32)), "nvfp4", role="weight"), "2-D weight"),
        (lambda: quantize_blocks(jnp.ones((4, 32)), "mxfp8", axis=2), "axis=2"),
        (lambda: quantize_blocks(jnp.ones((4, 32)), "mxfp8", axis=1.0), "axis=1.0 must be an int"),
        (lambda: block_shape("mxfp8", 2, axis=True), "axis=True must be an int"),
        (lambda: quantize_blocks(jnp.ones((4, 32), jnp.int32), "mxfp8"), "int32"),
        (lambda: quantize_blocks(jnp.ones((4, 32)), "mxfp8", key=jax.random.key(0)), "nvfp4"),
        (lambda: dequantize_blocks(jnp.ones(3)), "BlockQuantized"),
    ],
)
def test_bad_input_names_the_culprit(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4", "blockwise"])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_nan_in_a_block_makes_its_scale_nan_along_either_axis_under_jit(scaling, axis):
    # XLA:CPU's vectorised column reductions can drop a NaN from a max: the block's scale
    # must still be NaN (its elements dequantise to NaN), never a finite scale
    x = jnp.ones((256, 256)).at[159, 198].set(jnp.nan)
    q = jax.jit(lambda x: quantize_blocks(x, scaling, axis=axis))(x)
    out = np.asarray(dequantize_blocks(q))
    assert np.isnan(out[159, 198])
    blocks = block_shape(scaling, 2, axis)
    i, j = 159 // blocks[0], 198 // blocks[1]
    assert np.isnan(np.asarray(q.scales.astype(jnp.float32))[i, j])
