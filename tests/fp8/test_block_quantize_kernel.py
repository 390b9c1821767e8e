"""The fused block quantiser kernel (`impl="interpret"`: Pallas interpret mode on the CPU) is
bit for bit `quantize_orientations`' XLA reference, both orientations, every recipe and role."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpjax._src.fp8.block_codes import e2m1_code, e4m3_bits, stochastic_e2m1_code
from mpjax._src.fp8.block_quantize_kernel import _flat_amax, _rotated_amax, unsupported
from mpjax._src.fp8.blocks import _magnitude, _round_e2m1
from mpjax._src.fp8.hadamard import random_hadamard
from mpjax.fp8 import quantize_orientations

ROLES = ("activation", "weight", "gradient")
# ragged: neither a multiple of the blocks (32, 16, 128) nor of the kernel's tiles
SHAPES = {
    "mxfp8": [(37, 70), (160, 66)],
    "blockwise": [(37, 70), (130, 134)],
    "nvfp4": [(38, 70), (18, 36)],
}


@functools.partial(jax.jit, static_argnames=("scaling", "impl", "options"))
def _oriented(x, seed, scaling, impl, options):  # both jitted: same rounding of x / s
    return quantize_orientations(x, scaling, column_seed=seed, impl=impl, **dict(options))


def _wide(shape, dtype, special, seed=0):
    """Normal values over 40 binades (per row and per column); `special`: an all-zero block
    and a block with inf, one with NaN (NVFP4: the whole tensor's tensor scale is NaN)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    m, k = shape
    x = jax.random.normal(k1, shape) * jnp.exp2(
        jax.random.uniform(k2, (m, 1), minval=-20, maxval=20)
        + jax.random.uniform(k3, (1, k), minval=-4, maxval=4)
    )
    x = x.at[:16, :32].set(0.0)
    if special:
        x = x.at[m - 3, 1].set(-jnp.inf).at[m - 1, k - 2].set(jnp.nan)
    return x.astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(_bits(g), _bits(w))


def _check(x, scaling, seed=None, **options):
    options = tuple(sorted(options.items()))
    want = _oriented(x, seed, scaling, "xla", options)
    got = _oriented(x, seed, scaling, "interpret", options)
    _assert_same(got, want)
    return got


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise", "nvfp4"])
def test_kernel_is_the_reference_bit_for_bit(scaling, role, dtype):
    """The first ragged shape finite (zero blocks, 40 binades), the second also with an inf
    and a NaN block: each interpreted compile costs CI seconds, so one shape each."""
    for i, shape in enumerate(SHAPES[scaling]):
        x = _wide(shape, dtype, special=i == 1, seed=i)
        q = _check(x, scaling, role=role)
        assert q.rows.data.shape == shape and q.columns.data.shape == shape[::-1]


@pytest.mark.parametrize(
    ("role", "rows", "special"), [("gradient", True, False), ("weight", False, True)]
)
def test_nvfp4_hadamard_columns_with_a_seed(role, rows, special):
    """Ragged, a zero block, 40 binades; the second case also an inf and a NaN block."""
    x = _wide((38, 70), jnp.bfloat16, special=special, seed=5)
    seed = jnp.uint32(987654321)
    q = _check(x, "nvfp4", seed, role=role, rows=rows, column_hadamard=True)
    assert q.columns.data.shape == (70, 48)  # M padded to the rotation's 16
    nearest = _oriented(x, None, "nvfp4", "interpret", (("column_hadamard", True),))
    # the draws change the rounding (with a NaN block every element is NaN's code)
    assert np.array_equal(_bits(q.columns.data), _bits(nearest.columns.data)) == special


def test_stochastic_e2m1_code_is_the_reference_rounding():
    """The kernel's stochastic codes (seven compares) are the reference's floor-and-divide
    rounding, bit for bit: every e2m1 value, the midpoints and quarter points between them,
    their float32 neighbours, zeros of both signs, NaN, tiny values; each with draws at 0,
    at and beside every threshold `(|v| - low) / ulp`, and just below 1."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    points = [grid, (grid[1:] + grid[:-1]) / 2, grid[:-1] + (grid[1:] - grid[:-1]) / 4]
    v = np.concatenate(points + [np.array([1e-30, 3e-5], np.float32)])
    v = np.concatenate([v, np.nextafter(v, 0), np.nextafter(v, 7)]).astype(np.float32)
    v = np.unique(np.clip(v, 0, 6))
    v = np.concatenate([v, -v, [np.nan, -np.nan]]).astype(np.float32)
    ulp = np.where(np.abs(v) < 2, 0.5, np.where(np.abs(v) < 4, 1.0, 2.0)).astype(np.float32)
    frac = np.nan_to_num((np.abs(v) - np.floor(np.abs(v) / ulp) * ulp) / ulp)
    u = [np.zeros_like(v), frac, np.nextafter(frac, 0), np.nextafter(frac, 1)]
    u = np.clip(np.stack(u + [np.full_like(v, 1 - 2.0**-24)]), 0, 1 - 2.0**-24)
    v = np.broadcast_to(v, u.shape).astype(np.float32)
    got = np.asarray(jax.jit(stochastic_e2m1_code)(v, u.astype(np.float32)))
    want = _xla_bits(v, None, lambda v, u: _round_e2m1(v, u), u.astype(np.float32))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) == 16  # every code, both signs


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise", "nvfp4"])
def test_one_orientation_only(scaling):
    x = _wide((38, 70), jnp.float32, special=False, seed=2)
    for rows, columns in ((True, False), (False, True)):
        q = _check(x, scaling, rows=rows, columns=columns)
        assert (q.rows is None) != rows and (q.columns is None) != columns


def test_power_of_two_blockwise_scales():
    from mpjax import Fp8Recipe

    x = _wide((37, 140), jnp.float32, special=True)
    recipe = Fp8Recipe("blockwise", power_of_two_scale=True)
    for impl in ("xla", "interpret"):
        q = jax.jit(lambda x, impl=impl: quantize_orientations(x, recipe, impl=impl))(x)
        scales = np.asarray(q.rows.scales)
        finite = scales[np.isfinite(scales)]
        assert np.all(np.frexp(finite)[0] == 0.5)
        if impl == "xla":
            want = q
    _assert_same(q, want)


def _xla_bits(v, dtype, convert=None, *args):
    out = jax.jit(convert or (lambda v: v.astype(dtype)))(v, *args)
    return np.asarray(out).view(np.uint8)


def test_e4m3_bits_are_xlas_conversion():
    """Every float32 the quantiser can hand over: each e4m3 value, its neighbours and the
    midpoints between values (ties to even), subnormals, zeros of both signs, NaN."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.sort(grid[np.isfinite(grid)])
    mid = (grid[1:] + grid[:-1]) / 2
    v = np.concatenate([grid, mid, np.nextafter(mid, 0), np.nextafter(mid, 1000)])
    v = np.concatenate([v, -v, [np.nan, -np.nan, 3e-5, 1e-37]]).astype(np.float32)
    v = jnp.asarray(v[np.abs(np.nan_to_num(v)) <= 448])
    got = np.asarray(jax.jit(e4m3_bits)(v))
    np.testing.assert_array_equal(got, _xla_bits(v, jnp.float8_e4m3fn))


def test_e2m1_codes_are_xlas_conversion():
    v = np.linspace(-6, 6, 24001, dtype=np.float32)
    edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    near = np.concatenate([edges, np.nextafter(edges, 0), np.nextafter(edges, 9)])
    v = jnp.asarray(np.concatenate([v, near, -near, [0.0, -0.0, np.nan, -np.nan]]))
    got = np.asarray(jax.jit(e2m1_code)(v))
    np.testing.assert_array_equal(got, _xla_bits(v, jnp.float4_e2m1fn))


def test_unsupported_inputs_go_to_the_reference():
    x16 = jnp.ones((32, 64), jnp.float16)
    assert "float16" in unsupported(x16, "mxfp8", "activation", True, True, False)
    odd = jnp.ones((32, 63))
    assert "K=63 is odd" in unsupported(odd, "nvfp4", "activation", True, False, False)
    with pytest.raises(ValueError, match="impl='interpret' cannot run.*float16"):
        quantize_orientations(x16, "mxfp8", impl="interpret")
    auto = quantize_orientations(x16, "mxfp8", impl="auto")
    _assert_same(auto, quantize_orientations(x16, "mxfp8", impl="xla"))
    with pytest.raises(ValueError, match="impl must be one of"):
        quantize_orientations(x16, "mxfp8", impl="triton")


@pytest.mark.parametrize("shape", [(38, 70), (64, 48), (3, 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("special", [False, True])
def test_rotated_amax_is_the_rotated_copys_amax(shape, dtype, special):
    """NVFP4's columns tensor scale comes from `_rotated_amax` (no moved axis): bit for bit
    the amax of `random_hadamard(x, 0)` (ragged M padded, 40 binades, inf and NaN); the rows
    one from `_flat_amax`."""
    x = _wide(shape, dtype, special) if min(shape) > 16 else jnp.full(shape, -3.0, dtype)
    want = jnp.max(_magnitude(random_hadamard(x, 0)))
    np.testing.assert_array_equal(_bits(_rotated_amax(x)), _bits(want))
    xf = x.astype(jnp.float32)  # and the rows tensor scale's amax, of x as 1-D
    np.testing.assert_array_equal(_bits(_flat_amax(xf)), _bits(jnp.max(_magnitude(xf))))
