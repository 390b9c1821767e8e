"""Counter-based pseudo-random bits for stochastic rounding (bf16 and 8-bit optimizer state).

A hash of an iota and a seed: elementwise integer arithmetic that XLA fuses into the
rounding's kernel. Shared by `low_precision` and `blockwise8`, below both. Written with
`lax` primitives: each `jnp` operator is a jitted function whose every call while tracing
costs a `jit` dispatch, and these run once per state leaf per step (the bulk of the trace
time of a GPT-2 step with bfloat16 state, which traced these hashes ~9000 `jit` calls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["fmix32", "random_bits16", "u32"]


def u32(like: jax.Array, value: int) -> jax.Array:
    """The uint32 constant `value` broadcast to the shape of `like`."""
    return lax.full(np.shape(like), np.uint32(value & 0xFFFFFFFF), jnp.uint32)


def fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: an invertible mix with full avalanche (uint32 in and out)."""
    h = lax.bitwise_xor(h, lax.shift_right_logical(h, u32(h, 16)))
    h = lax.mul(h, u32(h, 0x85EBCA6B))
    h = lax.bitwise_xor(h, lax.shift_right_logical(h, u32(h, 13)))
    h = lax.mul(h, u32(h, 0xC2B2AE35))
    return lax.bitwise_xor(h, lax.shift_right_logical(h, u32(h, 16)))


def random_bits16(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
    """16 pseudo-random bits per element (uint32 in [0, 2**16)) from a counter hash of `seed`.

    Elementwise integer arithmetic on an iota, which XLA fuses into the rounding's kernel
    (no random-number kernel, no extra memory traffic).

    Args:
      shape: the shape of the result.
      seed: a uint32 scalar.

    Returns:
      A uint32 array of `shape`, each element in [0, 2**16).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.random_bits import random_bits16
      >>> bits = random_bits16((4,), jnp.uint32(7))
      >>> bits.dtype, bool((bits < 2**16).all())
      (dtype('uint32'), True)
    """
    size = 1
    for d in shape:
        size *= d
    index = lax.reshape(lax.iota(jnp.uint32, size), tuple(shape))
    seed = lax.broadcast_in_dim(lax.convert_element_type(seed, jnp.uint32), tuple(shape), ())
    h = fmix32(lax.add(lax.mul(index, u32(index, 0x9E3779B9)), seed))
    return lax.shift_right_logical(h, u32(h, 16))
