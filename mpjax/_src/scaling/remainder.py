"""Exact float32 master weights in 16 extra bits: a bfloat16 param plus an int16 remainder.

A float32 value's bits are `hi << 16 | lo`. The bfloat16 param is `hi` rounded to nearest
by the dropped half: `hi + 1` when `lo >= 0x8000` (ties away from zero, in magnitude: the
same nearest value as round-to-nearest-even except on exact ties), else `hi`. The
remainder is `lo` read as a signed int16, so it is negative exactly when the param was
rounded up; joining subtracts that carry again. Split and join are exact inverses on
every bit pattern (signed zeros, denormals, infinities and NaNs included), the scheme of
Transformer Engine's `store_param_remainders`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["join_master", "split_master"]


def split_master(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits a float32 master into (bfloat16 param rounded to nearest, int16 remainder).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.remainder import split_master
      >>> param, rem = split_master(jnp.float32(1.0 + 2.0**-9))
      >>> param.dtype, rem.dtype
      (dtype(bfloat16), dtype('int16'))
    """
    if master.dtype != jnp.float32:
        raise TypeError(f"split_master: needs a float32 master, got {master.dtype}")
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    rem = jax.lax.bitcast_convert_type((bits & 0xFFFF).astype(jnp.uint16), jnp.int16)
    hi = (bits >> 16) + (rem < 0).astype(jnp.uint32)  # round up when lo >= 0x8000
    return jax.lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.bfloat16), rem


def join_master(param: jax.Array, rem: jax.Array) -> jax.Array:
    """The float32 master a bfloat16 param and its int16 remainder stand for, bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.remainder import join_master, split_master
      >>> x = jnp.float32(1.0 + 2.0**-9)
      >>> bool(join_master(*split_master(x)) == x)
      True
    """
    if param.dtype != jnp.bfloat16 or rem.dtype != jnp.int16:
        raise TypeError(
            f"join_master: needs a bfloat16 param and an int16 remainder, got "
            f"{param.dtype} and {rem.dtype}"
        )
    hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32)
    hi = hi - (rem < 0).astype(jnp.uint32)  # undo the round-up carry (wraps like split)
    lo = jax.lax.bitcast_convert_type(rem, jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type((hi << 16) | lo, jnp.float32)
