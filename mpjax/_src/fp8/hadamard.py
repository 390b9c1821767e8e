"""`random_hadamard`: the 16x16 random Hadamard transform of NVIDIA's NVFP4 recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["hadamard_runs", "hadamard_signs", "random_hadamard"]

_F32 = jnp.float32
_RHT = 16


def random_hadamard(x: jax.Array, axis: int, seed: int = 0) -> jax.Array:
    """`x` times an orthogonal 16x16 random Hadamard matrix along `axis` (zero-padded to 16).

    `T = H16 @ diag(signs) / 4` with Sylvester's `H16` and fixed random signs, applied to
    each run of 16 consecutive elements along `axis`. `T` is orthogonal, so
    `(T x)^T (T g) = x^T g`: a GEMM contracting `axis` is unchanged, while outliers are
    spread across their run before quantisation (NVIDIA's NVFP4 weight-gradient recipe).
    Each output is the signed sum of its run in a fixed order (`hadamard_runs`), so that the
    block quantiser kernel makes the same bits.

    Args:
      x: a floating array.
      axis: the axis transformed (the contraction axis of the GEMM that follows).
      seed: the random signs' seed (both GEMM operands must use the same).

    Returns:
      The transformed array in float32, `axis` padded to a multiple of 16.
    """
    signs = hadamard_signs(seed)
    x = jnp.moveaxis(x.astype(_F32), axis, -1)
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % _RHT)])
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // _RHT, _RHT)  # -1 fails for size 0
    out = jnp.stack(hadamard_runs([runs[..., r] for r in range(_RHT)], signs), axis=-1)
    return jnp.moveaxis(out.reshape(x.shape), -1, axis)


def hadamard_signs(seed: int = 0) -> np.ndarray:
    """The 16x16 matrix `H16 @ diag(signs)` of +-1 (`random_hadamard`'s transform times 4)."""
    h = np.array([[1.0]])
    while h.shape[0] < _RHT:
        h = np.block([[h, h], [h, -h]])
    signs = np.where(np.random.default_rng(seed).random(_RHT) < 0.5, -1.0, 1.0)
    return h * signs


def hadamard_runs(xs: list[jax.Array], signs: np.ndarray) -> list[jax.Array]:
    """The transform of a run given as its 16 float32 elements `xs` (arrays of one shape).

    Output `s` is `(((+-x_0 +- x_1) +- x_2) ... +- x_15) / 4`, summed in this order with
    the signs of row `s` of `signs`: a fixed order, so that a kernel gets the same bits.
    """
    out = []
    for row in signs:
        acc = xs[0] if row[0] > 0 else -xs[0]
        for r in range(1, _RHT):
            acc = acc + xs[r] if row[r] > 0 else acc - xs[r]
        out.append(acc * _F32(0.25))
    return out
