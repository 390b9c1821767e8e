"""Block recipes on blocks of tiny magnitude: finite, zeros kept, against float64.

A block whose amax lies in 1e-38..1e-30 (a near-zero ReLU row, a loss scaled by 1e-37) and
that holds zeros must quantise to finite values: the spec's scales (DeepSeek-V3: amax / 448;
NVFP4: a float32 tensor scale 2688 / amax and E4M3 block scales amax / 6 * t; MXFP8: the
smallest power of two) computed in float64 never underflow, so the float64 reference below
dequantises every element within its format's rounding error. Float32 scales that flushed to
zero made 0 / 0 = NaN of the zeros, or zeroed the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpjax import Fp8Recipe
from mpjax.fp8 import block_scaled_dot_general, dequantize_blocks, quantize_blocks

SCALINGS = ("blockwise", "nvfp4", "mxfp8")
AMAXES = (1e-38, 1e-37, 5e-36, 1e-35, 1e-34, 1e-33, 1e-30)
TINY = float(np.finfo(np.float32).tiny)  # XLA:CPU flushes float32 subnormals
E4M3, E2M1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn


def _blocks_of(x: np.ndarray, block: tuple[int, int]):
    for i in range(0, x.shape[0], block[0]):
        for j in range(0, x.shape[1], block[1]):
            yield np.s_[i : i + block[0], j : j + block[1]]


def _reference(x: np.ndarray, scaling: str, block: tuple[int, int]) -> np.ndarray:
    """Quantise-dequantise per the spec, in float64 (ml_dtypes rounds to nearest even)."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    amax_t = np.abs(x).max()
    t = 448.0 * 6.0 / amax_t if amax_t else 1.0
    for sl in _blocks_of(x, block):
        amax = np.abs(x[sl]).max()
        if not amax:
            continue
        if scaling == "blockwise":
            s = amax / 448.0
            out[sl] = np.clip(x[sl] / s, -448, 448).astype(E4M3).astype(np.float64) * s
        elif scaling == "mxfp8":
            s = 2.0 ** np.ceil(np.log2(amax / 448.0))
            out[sl] = np.clip(x[sl] / s, -448, 448).astype(E4M3).astype(np.float64) * s
        else:
            s = float(np.float64(min(amax / 6.0 * t, 448.0)).astype(E4M3))
            out[sl] = np.clip(x[sl] * t / s, -6, 6).astype(E2M1).astype(np.float64) * s / t
    return out


def _error_bound(x: np.ndarray, scaling: str, block) -> np.ndarray:
    """Each element's rounding error bound: half a grid step of its format at its value
    (E4M3: 2**-4 relative, 2**-10 of the block scale among subnormals; E2M1: a quarter of
    the value, 1/24 of the block's amax near zero, plus E4M3's block-scale rounding), plus
    the float32 subnormals XLA flushes."""
    bound = np.zeros_like(x, np.float64)
    for sl in _blocks_of(x, block):
        amax = np.abs(x[sl]).max()
        a = np.abs(x[sl]).astype(np.float64)
        if scaling == "nvfp4":
            bound[sl] = 0.25 * a + amax / 24 + 2**-3 * a
        else:
            bound[sl] = 2**-4 * a + 2**-9 * amax / 448
    return bound + 2 * TINY


def _tiny_rows(amax: float) -> np.ndarray:
    """[8, 256]: row 0 tiny values (magnitudes amax / 8 .. amax, signs mixed, zeros among
    them), row 1 half 1.5e-38 and half zeros, every other row zero (whole blocks of zeros,
    in 2-D weight blocks too)."""
    rng = np.random.default_rng(0)
    x = np.zeros((8, 256), np.float32)
    row = amax * rng.uniform(0.125, 1.0, 256) * rng.choice([-1.0, 1.0], 256)
    row[::3] = 0.0
    row[np.argmax(np.abs(row))] = amax
    x[0] = row.astype(np.float32)
    # 1.5e-38 (normal) next to zeros: at amax 1e-34 NVFP4's tensor scale over this block's
    # scale overflows float32
    x[1, ::2] = 1.5e-38
    return x


def _round_trip(x, scaling, role):
    return dequantize_blocks(quantize_blocks(x, scaling, axis=1, role=role))


@pytest.mark.parametrize("role", ["activation", "weight"])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_tiny_blocks_quantise_finite_and_match_float64(scaling, role):
    for amax in AMAXES:
        x = _tiny_rows(amax)
        bq = quantize_blocks(x, scaling, axis=1, role=role)
        got = np.asarray(jax.jit(_round_trip, static_argnums=(1, 2))(x, scaling, role))
        assert (got == np.asarray(dequantize_blocks(bq))).all()  # eager as jitted
        assert np.isfinite(got).all(), (scaling, role, amax, np.isnan(got).sum())
        assert (got[x == 0] == 0).all(), (scaling, role, amax)
        block = bq.block
        bound = _error_bound(x, scaling, block)
        want = _reference(x, scaling, block)
        assert (np.abs(want - x) <= bound).all()  # the bound holds for the spec itself
        err = np.abs(got - x)
        assert (err <= bound).all(), (scaling, role, amax, np.max(err / bound))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_tiny_forward_and_gradients_are_finite_and_match_float64(scaling):
    """A near-zero ReLU row forward, and the gradient of `1e-37 * loss`, emulated lowering."""
    rng = np.random.default_rng(1)
    x = np.maximum(rng.standard_normal((16, 128)), 0).astype(np.float32)
    x[3] = np.maximum(rng.standard_normal(128), 0) * 1e-36  # a near-zero ReLU row
    w = rng.standard_normal((128, 32)).astype(np.float32)
    c = rng.standard_normal((16, 32)).astype(np.float32)
    recipe = Fp8Recipe(scaling, block_lowering="emulated", min_dim=16)
    dims = (((1,), (0,)), ((), ()))

    def loss(x, w, factor):
        out = block_scaled_dot_general(x, w, dims, recipe, jnp.float32)
        return factor * jnp.sum(out * c), out

    x64, w64, c64 = (np.asarray(v, np.float64) for v in (x, w, c))
    errors = {}
    for factor in (1.0, 1e-37):
        (_, out), (gx, gw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w, factor)
        for name, got, want in [
            ("row", out[3], x64[3] @ w64),
            ("dx", gx, factor * c64 @ w64.T),
            ("dw", gw, factor * x64.T @ c64),
        ]:
            got = np.asarray(got, np.float64)
            assert np.isfinite(got).all(), (scaling, factor, name, np.isnan(got).sum())
            errors[factor, name] = np.linalg.norm(got - want) / np.linalg.norm(want)
    for name in ("row", "dx", "dw"):  # tiny magnitudes lose no more than unit ones
        assert errors[1e-37, name] <= 1.5 * errors[1.0, name] + 1e-3, (name, errors)


def test_nvfp4_block_whose_ratio_overflows_gets_x_times_t_over_s():
    """A tiny block next to a 1e-35 one: the tensor scale is 2**125 (its cap), the block scale
    about 0.1, and `t / s` overflows float32. Its elements are then `(x * t) / s` rounded to
    E2M1 (4 or 6 here: the block's normal values span 1.2e-38..1.7e-38), as in float64, not
    `x * inf` (all 6)."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1e-35
    x[0, 16:] = np.linspace(1.2e-38, 1.7e-38, 16, dtype=np.float32) * np.resize([1, -1], 16)
    for fn in (quantize_blocks, jax.jit(quantize_blocks, static_argnums=1)):
        bq = fn(x, "nvfp4")
        t, s = float(bq.tensor_scale), float(np.asarray(bq.scales, np.float64)[0, 1])
        assert t == 2.0**125 and np.isinf(np.float32(t) / np.float32(s))
        want = np.clip(x[0, 16:].astype(np.float64) * t / s, -6, 6).astype(E2M1)
        got = np.asarray(bq.data)[0, 16:]
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
        assert set(np.abs(got.astype(np.float64))) == {4.0, 6.0}
