"""Shared test helpers: fp8 saved activations (residual dtypes, the e4m3 gradient bound)."""

import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

E4M3 = np.dtype(jnp.float8_e4m3fn)
BF16 = np.dtype(jnp.bfloat16)
SAVED = "params=float32,compute=bfloat16,output=float32,saved=float8_e4m3fn"
PLAIN = "params=float32,compute=bfloat16,output=float32"


def residuals(fn, *args):
    """`(dtype, shape)` of every value `jax.vjp(fn, *args)` keeps for the backward pass."""
    return [(np.dtype(aval.dtype), tuple(aval.shape)) for aval, _ in saved_residuals(fn, *args)]


def bf16_exact(rng, shape, scale=1.0):
    """float32 values that bfloat16 represents exactly (so inputs add no rounding)."""
    x = rng.standard_normal(shape).astype(np.float32) * scale
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def weight_grad_bound(x, c, bf16: bool = True):
    """Elementwise bound on |dW - x^T c| when dW is computed from `x` stored in e4m3.

    Rowwise current scaling maps each row's amax onto 448. A normal e4m3 value is rounded
    to 3 mantissa bits: relative error <= 2**-4; below 2**-6 (scaled) it is subnormal,
    absolute error <= 2**-10 / scale = 2**-10 * amax / 448. So
    |x_hat - x| <= 2**-4 |x| + 2**-10 amax_row / 448 per element, and
    |x_hat^T c - x^T c| <= (2**-4 |x| + 2**-10 amax / 448)^T |c|.
    A bfloat16 GEMM adds x_hat's rounding to bf16, c's and the output's (3 * 2**-9 <= 2**-7
    relative to |x|^T |c|, accumulation in float32).
    """
    x, c = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(c, np.float64))
    amax = x.max(axis=1, keepdims=True)
    per_element = 2.0**-4 * x + 2.0**-10 * amax / 448.0
    bound = per_element.T @ c
    if bf16:
        bound += 2.0**-7 * (x.T @ c)
    return bound * 1.001
