"""The master weights of `loss_scaled`: kept in float32, as int16 remainders, or not at all.

A master leaf is `optax.MaskedNode()` (no master: the param itself, widened, is the
master), a float32 (or float64) array (the master), or, with
`master_weights="remainder"`, an int16 array: the low half of the float32 master of a
bfloat16 param (see `remainder.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype
from mpjax._src.scaling.remainder import join_master, split_master

__all__ = ["MASTER_MODES", "init_master", "next_master", "rounded", "view"]

_MASKED = optax.MaskedNode
MASTER_MODES = ("auto", True, False, "remainder")


def _is_masked(x: Any) -> bool:
    return isinstance(x, _MASKED)


def _is_remainder(m: Any) -> bool:
    return not _is_masked(m) and m.dtype == jnp.int16


def _wide(x: jax.Array) -> jax.Array:
    wide = _wide_dtype(x.dtype)
    return x if x.dtype == wide else x.astype(wide)


def _keeps_master(p: Any, master_weights: bool | str) -> bool:
    if not _is_floating(p):
        return False
    if master_weights in ("auto", "remainder"):
        return jnp.dtype(p.dtype).itemsize < 4
    return bool(master_weights)


def init_master(p: Any, master_weights: bool | str) -> Any:
    """The master leaf of param `p`: a remainder, a float32 copy, or `MaskedNode()`."""
    if not _keeps_master(p, master_weights):
        return _MASKED()
    if master_weights == "remainder" and p.dtype == jnp.bfloat16:
        return split_master(p.astype(jnp.float32))[1]  # zeros: a bf16 value is exact
    # Copy, so that a master never aliases a float32 param buffer.
    return jnp.array(_wide(p), copy=True)


def view(params: Any, master: Any) -> Any:
    """The float32 view the inner optimizer works on; non-floating leaves are masked."""

    def one(p, m):
        if not _is_floating(p):
            return _MASKED()
        if _is_masked(m):
            return _wide(p)
        return join_master(p, m) if _is_remainder(m) else m

    return jax.tree.map(one, params, master)


def rounded(p: Any, m: Any, value: jax.Array) -> jax.Array:
    """A new wide value rounded to the param's dtype.

    A bfloat16 param with a float32 master, kept whole or as a remainder, is rounded by the
    remainder's rule (nearest, ties away from zero), so the two modes give the same params
    bit for bit, hence the same training. A NaN master keeps a NaN param (the remainder's
    split may carry a NaN's top half into a zero; its join restores the NaN master).
    Other params are rounded to nearest even.
    """
    if _is_remainder(m):
        return split_master(value)[0]
    cast = value.astype(p.dtype)
    if _is_masked(m) or p.dtype != jnp.bfloat16 or value.dtype != jnp.float32:
        return cast
    return jnp.where(jnp.isnan(value), cast, split_master(value)[0])


def next_master(ok: jax.Array, m: Any, value: jax.Array) -> Any:
    """The master leaf after a step: the new value where `ok`, else the old leaf."""
    if _is_masked(m):
        return m
    new = split_master(value)[1] if _is_remainder(m) else value
    return jnp.where(ok, new, m)
