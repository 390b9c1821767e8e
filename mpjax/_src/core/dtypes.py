"""Dtype predicates and the unscale's arithmetic, shared by `mpjax.scaling` and `mpjax.pallas`;
imports nothing from mpjax."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_floating", "unscale", "unscale_factors", "wide_dtype"]


def is_floating(x: Any) -> bool:
    """Whether `x` has a (non-extended) floating dtype; False for objects without a dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return jnp.issubdtype(dtype, jnp.floating)


def wide_dtype(dtype) -> np.dtype:
    """float32 for half types, the dtype itself for float32/float64."""
    return jnp.promote_types(dtype, jnp.float32)


# Above this, 1 / scale is subnormal in float32, which XLA and the GPU flush to zero.
_TOP_NORMAL_RECIPROCAL = 2.0**126


def unscale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(p, r)` such that `(g * p) * r` is `g` unscaled by `scale`, in `scale`'s dtype.

    `r = 1 / (scale * p)` rounded once: the unscale is a reciprocal multiply, as
    `torch.amp.GradScaler`'s, the same on every backend and jax version (XLA rewrites a
    division by a broadcast scalar into one on some versions only). `p` is 1, or 1/4 for a
    scale above 2**126, whose reciprocal would be subnormal and flushed to zero (silently
    zeroing every gradient); both are powers of two, so for any other scale `(g * p) * r` is
    exactly `g * (1 / scale)`.
    """
    p = jnp.where(scale > _TOP_NORMAL_RECIPROCAL, 0.25, 1.0).astype(scale.dtype)
    return p, 1 / (scale * p)


def unscale(g: jax.Array, scale: jax.Array) -> jax.Array:
    """`g` unscaled by `scale` (both already in the compute dtype): `(g * p) * r`, see
    `unscale_factors`."""
    p, r = unscale_factors(scale)
    return (g * p) * r
