"""`random_hadamard`: the 16x16 random Hadamard transform of NVIDIA's NVFP4 recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["random_hadamard"]

_F32 = jnp.float32
_RHT = 16


def random_hadamard(x: jax.Array, axis: int, seed: int = 0) -> jax.Array:
    """`x` times an orthogonal 16x16 random Hadamard matrix along `axis` (zero-padded to 16).

    `T = H16 @ diag(signs) / 4` with Sylvester's `H16` and fixed random signs, applied to
    each run of 16 consecutive elements along `axis`. `T` is orthogonal, so
    `(T x)^T (T g) = x^T g`: a GEMM contracting `axis` is unchanged, while outliers are
    spread across their run before quantisation (NVIDIA's NVFP4 weight-gradient recipe).

    Args:
      x: a floating array.
      axis: the axis transformed (the contraction axis of the GEMM that follows).
      seed: the random signs' seed (both GEMM operands must use the same).

    Returns:
      The transformed array in float32, `axis` padded to a multiple of 16.
    """
    h = np.array([[1.0]])
    while h.shape[0] < _RHT:
        h = np.block([[h, h], [h, -h]])
    signs = np.where(np.random.default_rng(seed).random(_RHT) < 0.5, -1.0, 1.0)
    t = jnp.asarray(h * signs / np.sqrt(_RHT), _F32)
    x = jnp.moveaxis(x.astype(_F32), axis, -1)
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % _RHT)])
    runs = x.reshape(*x.shape[:-1], -1, _RHT)
    out = jnp.einsum("...r,sr->...s", runs, t).reshape(x.shape)
    return jnp.moveaxis(out, -1, axis)
