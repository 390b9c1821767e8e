"""Dtype predicates shared by `mpjax.scaling` and `mpjax.pallas`; imports nothing from mpjax."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_floating", "wide_dtype"]


def is_floating(x: Any) -> bool:
    """Whether `x` has a (non-extended) floating dtype; False for objects without a dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return jnp.issubdtype(dtype, jnp.floating)


def wide_dtype(dtype) -> np.dtype:
    """float32 for half types, the dtype itself for float32/float64."""
    return jnp.promote_types(dtype, jnp.float32)
