"""8-bit optimizer state: blockwise-scaled int8 codes of a dynamic (decade) codebook.

A float array is cut (flattened, in blocks of `block_size` elements) into blocks; each
block keeps its absolute maximum as a float32 scale, and each element an int8 code: its
sign, and the index of its magnitude over the scale in `CODEBOOK`, 127 magnitudes in
[1e-6, 1] spread over six decades with the most points in the top one (64 in [0.1, 1], 32
in [0.01, 0.1], ..., 1 at 1e-6) plus zero: fine steps near each block's maximum, range
down to a millionth of it (the idea of bitsandbytes' and torchao's dynamic quantisation
map, for Adam's moments whose magnitudes span decades within a block). 1 + 4 / block_size
bytes per element.

Rounding between the two neighbouring codes is to nearest, or stochastic (up with
probability proportional to the distance, so unbiased: `E[dequantize(quantize(x))] == x`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["CODEBOOK", "Blockwise8", "codebook", "dequantize", "quantize"]

_DECADE_POINTS = (64, 32, 16, 8, 4, 2, 1)  # [0.1, 1], [0.01, 0.1], ..., {1e-6}


def codebook() -> np.ndarray:
    """The 128 magnitudes a code's low 7 bits index: 0, then ascending to exactly 1.0."""
    mags = [0.0]
    for decade, n in reversed(list(enumerate(_DECADE_POINTS))):
        top = 10.0**-decade
        # n points spaced evenly in (top / 10, top], the last one exactly `top`
        mags += [top * (0.1 + 0.9 * (k + 1) / n) for k in range(n)]
    out = np.asarray(mags, np.float32)
    out.setflags(write=False)
    return out


CODEBOOK = codebook()  # read-only


class Blockwise8(NamedTuple):
    """One array stored in 8 bits.

    Attributes:
      codes: int8, shaped like the array: the sign of each element times the `CODEBOOK`
        index of its magnitude over the scale.
      scales: float32, one per block of `block_size` consecutive elements (flattened order):
        the block's absolute maximum (1 for an all-zero block).
    """

    codes: jax.Array
    scales: jax.Array


def _gathered(x: jax.Array) -> tuple[jax.Array, Any]:
    """`x` replicated, and its sharding, when its type is sharded over Explicit mesh axes.

    Blocks run over the flattened array, across shards: the leaf is gathered for its
    quantisation (one leaf at a time) and the codes are given its sharding back, so the
    stored state stays sharded and the codes equal the unsharded run's. Else `(x, None)`.
    """
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty or all(p is None for p in sharding.spec):
        return x, None
    return jax.sharding.reshard(x, sharding.update(spec=P())), sharding


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    flat = x.reshape(-1)
    pad = (-flat.size) % block_size
    return jnp.pad(flat, (0, pad)).reshape(-1, block_size)


def _unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    size = int(np.prod(shape, dtype=np.int64))
    return blocks.reshape(-1)[:size].reshape(shape)


def quantize(x: jax.Array, block_size: int = 256, seed: jax.Array | None = None) -> Blockwise8:
    """Quantizes float `x` blockwise to int8 codes: nearest, or stochastic given a `seed`.

    Args:
      x: a floating array (computed in float32).
      block_size: elements per scale.
      seed: None rounds to the nearest code; a uint32 scalar rounds stochastically
        (unbiased), the same seed giving the same codes.

    Returns:
      A `Blockwise8`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.blockwise8 import dequantize, quantize
      >>> x = jnp.asarray([1.0, -0.5, 0.0, 1e-3])
      >>> q = quantize(x, block_size=4)
      >>> q.codes.dtype, q.scales.tolist()
      (dtype('int8'), [1.0])
      >>> bool(jnp.allclose(dequantize(q, (4,), block_size=4), x, rtol=0.02))
      True
    """
    from mpjax._src.scaling.low_precision import _random_bits16

    x, sharding = _gathered(x)
    blocks = _blocks(x.astype(jnp.float32), block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
    scales = jnp.where(absmax > 0, absmax, jnp.float32(1.0))
    a = jnp.abs(blocks) / scales  # in [0, 1]
    book = jnp.asarray(CODEBOOK)
    lo = jnp.clip(jnp.searchsorted(book, a, side="right") - 1, 0, 126)
    lo_v, hi_v = book[lo], book[lo + 1]
    frac = (a - lo_v) / (hi_v - lo_v)  # where a lies between its two codes, in [0, 1]
    if seed is None:
        up = frac > 0.5
    else:
        u = (_random_bits16(blocks.shape, seed).astype(jnp.float32) + 0.5) / 65536.0
        up = u < frac
    index = (lo + up.astype(lo.dtype)).astype(jnp.int8)
    codes = jnp.where(jnp.signbit(blocks), -index, index).astype(jnp.int8)
    codes = _unblock(codes, x.shape)
    codes = codes if sharding is None else jax.sharding.reshard(codes, sharding)
    return Blockwise8(codes, scales[:, 0])


def dequantize(q: Blockwise8, shape: tuple[int, ...], block_size: int = 256) -> jax.Array:
    """The float32 array a `Blockwise8` stands for.

    Args:
      q: the quantized array.
      shape: its shape (that of `q.codes`).
      block_size: elements per scale, as given to `quantize`.

    Returns:
      A float32 array of `shape`.
    """
    codes, sharding = _gathered(q.codes)
    codes = _blocks(codes, block_size).astype(jnp.int32)
    mags = jnp.asarray(CODEBOOK)[jnp.abs(codes)]
    values = _unblock(jnp.where(codes < 0, -mags, mags) * q.scales[:, None], shape)
    return values if sharding is None else jax.sharding.reshard(values, sharding)
