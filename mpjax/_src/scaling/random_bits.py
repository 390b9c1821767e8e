"""Counter-based pseudo-random bits for stochastic rounding (bf16 and 8-bit optimizer state).

A hash of an iota and a seed: elementwise integer arithmetic that XLA fuses into the
rounding's kernel. Shared by `low_precision` and `blockwise8`, below both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["fmix32", "random_bits16"]


def fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: an invertible mix with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


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
    index = jax.lax.iota(jnp.uint32, size).reshape(shape)
    return fmix32(index * jnp.uint32(0x9E3779B9) + seed) >> 16
