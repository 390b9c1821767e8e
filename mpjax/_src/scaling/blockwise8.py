"""8-bit optimizer state: blockwise-scaled int8 codes of a dynamic (decade) code.

An array is cut along its last axis into blocks (of `min(block_size, last)` elements, the
last block of each row padded); each block keeps its absolute maximum as a float32 scale,
and each element an int8 code: its sign, and the index of its magnitude over the scale
among 127 magnitudes in [1e-6, 1] spread over six decades with the most points in the top
one (64 in (0.1, 1], 32 in (0.01, 0.1], ..., 1 at 1e-6) plus zero: fine steps near each
block's maximum, range down to a millionth of it (the idea of bitsandbytes' and torchao's
dynamic quantisation map, for Adam's moments whose magnitudes span decades within a block).
1 + 4 / block bytes per element.

The code is arithmetic: decade `k` (magnitudes in (10**-(k+1), 10**-k]) holds `n = 2**(6-k)`
evenly spaced points `10**-k * (0.1 + 0.9 * (j + 1) / n)`, `j = 0 .. n - 1`, at indices
`n + j`, so the index of a magnitude is `n + round(j)` (the point below the first one,
`j = -1`, is the previous decade's top) and its decade is the index's highest set bit: no
table, no search, no gather; quantising and dequantising fuse into the optimizer's
elementwise kernels. Blocks follow the array's own layout, so an array split over devices
along any axis keeps whole blocks on each device (along the last axis: when each piece holds
a whole number of blocks, see `block_size` in `low_precision_state`).

Rounding between the two neighbouring codes is to nearest, or stochastic (up with
probability proportional to the distance, so unbiased: `E[dequantize(quantize(x))] == x`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.scaling.random_bits import random_bits16

__all__ = [
    "CODEBOOK",
    "Blockwise8",
    "block_length",
    "codebook",
    "dequantize",
    "quantize",
    "sharded_block_length",
    "stored_block_length",
]

DECADES = 7  # decade k = 0 .. 6 holds 2 ** (6 - k) points; the last one is the point 1e-6
_LN10 = math.log(10.0)

BlockSize = int | Callable[[tuple[int, ...]], int]


class Blockwise8(NamedTuple):
    """One array stored in 8 bits.

    Attributes:
      codes: int8, shaped like the array: the sign of each element times the index of its
        magnitude over its block's scale in the decade code (`CODEBOOK`).
      scales: float32, shaped like the array with its last axis counting blocks: each
        block's absolute maximum (1 for an all-zero block).
    """

    codes: jax.Array
    scales: jax.Array


def _magnitudes(index: jax.Array) -> jax.Array:
    """The float32 magnitude (over the scale) of integer code indices in [0, 127]."""
    index = index.astype(jnp.int32)
    e = 31 - lax.clz(jnp.maximum(index, 1))  # the highest set bit: n = 2**e, decade 6 - e
    n = lax.shift_left(jnp.int32(1), e).astype(jnp.float32)
    top = jnp.exp((e - (DECADES - 1)).astype(jnp.float32) * _LN10)  # 10 ** -(6 - e)
    j = (index - lax.shift_left(jnp.int32(1), e)).astype(jnp.float32)
    mags = top * (0.1 + 0.9 * (j + 1.0) / n)
    return jnp.where(index > 0, mags, 0.0)


def codebook() -> np.ndarray:
    """The 128 magnitudes a code's low 7 bits index (the spec, rounded to float32): 0, then
    ascending to exactly 1.0. `dequantize` computes them arithmetically (within an ulp)."""
    mags = [0.0]
    for k in reversed(range(DECADES)):
        n, top = 2 ** (DECADES - 1 - k), 10.0**-k
        mags += [top * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    out = np.asarray(mags, np.float32)
    out.setflags(write=False)
    return out


CODEBOOK = codebook()  # read-only


def block_length(shape: tuple[int, ...], block_size: BlockSize) -> int:
    """The elements per scale, along the last axis, of an array of `shape`.

    Args:
      shape: the array's shape.
      block_size: an int (blocks of `min(block_size, shape[-1])`) or a callable
        `shape -> int` choosing each array's block length.

    Returns:
      An int >= 1.
    """
    last = shape[-1] if shape else 1
    if last == 0:  # no elements along the last axis: no blocks, any length holds them
        return 1
    b = block_size(tuple(shape)) if callable(block_size) else min(block_size, last)
    if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1:
        raise ValueError(
            f"block_size: the block length of shape {shape} must be an int >= 1, got {b!r}"
        )
    return int(b)


LEGACY_BLOCK = 256  # the block length of `low_precision_state`'s int default before "auto"


def sharded_block_length(shape: tuple[int, ...], piece: int) -> int:
    """The default block length of an array of `shape` whose last axis each device holds
    `piece` elements of: the largest divisor of `piece` up to 256, so no block straddles
    two devices (skipping one whose block count a 256-long layout would share, so that
    `stored_block_length` reads it back unambiguously).

    Args:
      shape: the array's shape.
      piece: the elements of the last axis on each device (`shape[-1]` when not split).

    Returns:
      An int >= 1 dividing `piece` (and `shape[-1]`).
    """
    last = shape[-1] if shape else 1
    legacy = -(-last // LEGACY_BLOCK)
    for b in range(min(LEGACY_BLOCK, piece), 0, -1):
        if piece % b == 0 and (b == min(LEGACY_BLOCK, last) or last // b != legacy):
            return b
    return 1  # piece == 0: no elements


def stored_block_length(shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> int:
    """The block length a `Blockwise8` of `shape` was written with under the default
    `block_size=None`, read from its scales' shape: the 256-long layout where the block
    count is its count (or the scales are in the old flattened layout), else
    `shape[-1] / count` (a `sharded_block_length`). A count that fits neither gets the
    256-long layout, which `dequantize` then refuses with the shapes.
    """
    last = shape[-1] if shape else 1
    count = scales_shape[-1] if scales_shape else 1
    if last == 0 or tuple(scales_shape[:-1]) != tuple(shape[:-1]):
        return LEGACY_BLOCK if last else 1
    if count == -(-last // min(LEGACY_BLOCK, last)) or last % count:
        return min(LEGACY_BLOCK, last)
    return last // count


def _blocks(x: jax.Array, b: int) -> jax.Array:
    """[..., L] -> [..., ceil(L / b), b], the last axis zero-padded."""
    x = x.reshape(1) if x.ndim == 0 else x
    pad = (-x.shape[-1]) % b
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)  # no -1: a size-0 array has none


def _unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    last = shape[-1] if shape else 1
    flat = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
    return flat[..., :last].reshape(shape)


def _code_index(a: jax.Array, seed: jax.Array | None) -> jax.Array:
    """The code index (int32 in [0, 127]) of magnitudes `a` in [0, 1]: nearest or stochastic."""
    k = jnp.clip(jnp.floor(-jnp.log10(a)), 0.0, DECADES - 1.0)  # a's decade; 0 -> 6
    n = jnp.exp2(DECADES - 1.0 - k)
    top = jnp.exp(-k * _LN10)
    last = k == DECADES - 1  # below 1e-6 the point under 1e-6 is zero, not 1e-7
    lo = jnp.where(last, 0.0, 0.1 * top)
    step = jnp.where(last, top, 0.9 * top / n)
    t = (a - lo) / step - 1.0  # the position among the decade's points j = -1 .. n - 1
    if seed is None:
        j = jnp.ceil(t - 0.5)  # to nearest, ties down
    else:
        u = (_bits16(a.shape, seed).astype(jnp.float32) + 0.5) / 65536.0
        down = jnp.floor(t)
        j = down + (u < t - down).astype(jnp.float32)
    return (n + jnp.clip(j, -1.0, n - 1.0)).astype(jnp.int32)


def _bits16(shape, seed):
    return random_bits16(shape, seed)


def quantize(
    x: jax.Array, block_size: BlockSize = 256, seed: jax.Array | None = None
) -> Blockwise8:
    """Quantizes float `x` blockwise to int8 codes: nearest, or stochastic given a `seed`.

    Args:
      x: a floating array (computed in float32).
      block_size: elements per scale along the last axis (see `block_length`).
      seed: None rounds to the nearest code; a uint32 scalar rounds stochastically
        (unbiased), the same seed giving the same codes.

    Returns:
      A `Blockwise8`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.blockwise8 import dequantize, quantize
      >>> x = jnp.asarray([[1.0, -0.5, 0.0, 1e-3], [2.0, 0.0, 0.0, 0.0]])
      >>> q = quantize(x, block_size=4)
      >>> q.codes.dtype, q.scales.tolist()
      (dtype('int8'), [[1.0], [2.0]])
      >>> bool(jnp.allclose(dequantize(q, (2, 4), block_size=4), x, rtol=0.02))
      True
    """
    blocks = _blocks(x.astype(jnp.float32), block_length(x.shape, block_size))
    absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scales = jnp.where(absmax > 0, absmax, jnp.float32(1.0))
    index = _code_index(jnp.abs(blocks) / scales, seed).astype(jnp.int8)
    codes = jnp.where(jnp.signbit(blocks), -index, index).astype(jnp.int8)
    return Blockwise8(_unblock(codes, x.shape), scales[..., 0])


def _values(codes: jax.Array) -> jax.Array:
    c = codes.astype(jnp.int32)
    mags = _magnitudes(jnp.abs(c))
    return jnp.where(c < 0, -mags, mags)


def scales_shape(shape: tuple[int, ...], block_size: BlockSize) -> tuple[int, ...]:
    """The shape of the scales of an array of `shape`."""
    b = block_length(shape, block_size)
    last = shape[-1] if shape else 1
    return (*shape[:-1], -(-last // b))


def dequantize(q: Blockwise8, shape: tuple[int, ...], block_size: BlockSize = 256) -> jax.Array:
    """The float32 array a `Blockwise8` stands for.

    Codes written in earlier versions' flattened layout (one 1-D run of scales for the whole
    array, blocks of `block_size` consecutive elements in flattened order) are read too.

    Args:
      q: the quantized array.
      shape: its shape (that of `q.codes`).
      block_size: elements per scale, as given to `quantize`.

    Returns:
      A float32 array of `shape`.

    Raises:
      ValueError: the scales fit neither layout.
    """
    shape = tuple(shape)
    if tuple(q.scales.shape) == scales_shape(shape, block_size):
        b = block_length(shape, block_size)
        return _unblock(_values(_blocks(q.codes, b)) * q.scales[..., None], shape)
    size = int(np.prod(shape, dtype=np.int64))
    if isinstance(block_size, int) and q.scales.shape == (-(-size // block_size),):
        return _dequantize_flat(q, shape, block_size)
    raise ValueError(
        f"Blockwise8: scales of shape {tuple(q.scales.shape)} do not match an array of shape "
        f"{shape} in blocks of block_size={block_size!r} (expected "
        f"{scales_shape(shape, block_size)}): the state was written with another block_size"
    )


def _dequantize_flat(q: Blockwise8, shape: tuple[int, ...], block_size: int) -> jax.Array:
    """The old layout: blocks of `block_size` consecutive elements of the flattened array."""
    flat = q.codes.reshape(-1)
    pad = (-flat.size) % block_size
    values = _values(jnp.pad(flat, (0, pad)).reshape(-1, block_size)) * q.scales[:, None]
    return values.reshape(-1)[: flat.size].reshape(shape)
