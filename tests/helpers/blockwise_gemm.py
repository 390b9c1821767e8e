"""Operands and the float64 definition of a blockwise fp8 GEMM, for the kernels' tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mpjax._src.kernels.blockwise_gemm import BLOCK_K

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def operands(m, n, k, dtype=E4M3, seed=0):
    """fp8 operands and per-(row, K block) scales spanning 2^-20..2^20."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // BLOCK_K)
    a = jnp.asarray(rng.normal(size=(m, k)) * 50, jnp.float32).astype(dtype)
    b = jnp.asarray(rng.normal(size=(n, k)) * 50, jnp.float32).astype(dtype)
    sa = jnp.asarray(2.0 ** rng.integers(-20, 21, (m, blocks)) * rng.uniform(1, 2, (m, blocks)))
    sb = jnp.asarray(2.0 ** rng.integers(-20, 21, (n, blocks)) * rng.uniform(1, 2, (n, blocks)))
    return a, sa.astype(jnp.float32), b, sb.astype(jnp.float32)


def float64_blockwise(a, sa, b, sb):
    """sum over K blocks of a_scale * b_scale * (a_block . b_block), in float64 (the spec)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k = a64.shape[1]
    out = np.zeros((a64.shape[0], b64.shape[0]))
    for kb in range(-(-k // BLOCK_K)):
        cols = slice(kb * BLOCK_K, min(k, (kb + 1) * BLOCK_K))
        part = a64[:, cols] @ b64[:, cols].T
        out += part * np.asarray(sa, np.float64)[:, kb : kb + 1] * np.asarray(sb, np.float64)[:, kb]
    return out
