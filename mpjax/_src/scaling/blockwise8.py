"""8-bit optimizer state: blockwise-scaled int8 codes of a dynamic (decade) code.

An array is cut along its last axis into blocks; each block keeps its absolute maximum as a
float32 scale, and each element an int8 code: its sign, and the index of its magnitude over
the scale among 127 magnitudes in [1e-6, 1] spread over six decades with the most points in
the top one (64 in (0.1, 1], 32 in (0.01, 0.1], ..., 1 at 1e-6) plus zero: fine steps near
each block's maximum, range down to a millionth of it (the idea of bitsandbytes' and
torchao's dynamic quantisation map, for Adam's moments whose magnitudes span decades within
a block).

The default layout (`block_size=None`) is a function of the array's shape alone: the last
axis, `L` elements, is cut into `p` equal segments, `p` the largest power of two up to 64
dividing `L` whose segments keep at least 32 elements (at least 128 beyond 8 segments;
`default_pieces`), and each segment into blocks of `min(256, L / p)` elements, its last
block zero-padded. So an array split over a power-of-two number of devices along any axis
but the last, or evenly along its last axis into `k <= p` pieces (every even split into up
to 8 pieces of at least 32 elements, up to 64 pieces of at least 128), holds whole blocks
on each device, wherever and however it was created. Bytes per element (1 + 4 x blocks per
row / L): 1.042 for L = 768 (8 blocks of 96), 1.031 for 1024 (8 of 128) and 4096 (32 of
128), 1.016 for 50257 (197 of up to 256: odd, so one segment), 1.125 for 64 (2 of 32), 2.33
for 3 (one block of 3). An int `block_size` gives one segment in blocks of
`min(block_size, L)` (the layout of mpjax 3d03840's int option).

The code is arithmetic: decade `k` (magnitudes in (10**-(k+1), 10**-k]) holds `n = 2**(6-k)`
evenly spaced points `10**-k * (0.1 + 0.9 * (j + 1) / n)`, `j = 0 .. n - 1`, at indices
`n + j`, so the index of a magnitude is `n + round(j)` (the point below the first one,
`j = -1`, is the previous decade's top) and its decade is the index's highest set bit: no
table, no search, no gather; quantising and dequantising fuse into the optimizer's
elementwise kernels.

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
from jax.sharding import PartitionSpec as P

from mpjax._src.scaling.random_bits import random_bits16

__all__ = [
    "CODEBOOK",
    "Blockwise8",
    "codebook",
    "default_pieces",
    "dequantize",
    "geometry",
    "quantize",
    "scales_shape",
    "stored_block_length",
]

DEFAULT_BLOCK = 256  # the default layout's longest block
MAX_PIECES = 64  # the most segments the default layout cuts a last axis into
FEW_PIECES = 8  # up to this many segments, each keeps at least MIN_PIECE elements
MIN_PIECE = 32
MIN_SEGMENT = 128  # beyond FEW_PIECES, a segment keeps at least this many elements

DECADES = 7  # decade k = 0 .. 6 holds 2 ** (6 - k) points; the last one is the point 1e-6
_LN10 = math.log(10.0)

BlockSize = int | Callable[[tuple[int, ...]], int] | None


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


def default_pieces(last: int) -> int:
    """The segments the default layout cuts a last axis of `last` elements into: the largest
    power of two `p <= 64` dividing `last` whose segments keep at least 32 elements (128
    beyond 8 segments); 1 for `last == 0`."""
    p = 1
    while (
        last
        and 2 * p <= MAX_PIECES
        and last % (2 * p) == 0
        and last // (2 * p) >= (MIN_PIECE if 2 * p <= FEW_PIECES else MIN_SEGMENT)
    ):
        p *= 2
    return p


def geometry(shape: tuple[int, ...], block_size: BlockSize = None) -> tuple[int, int]:
    """How an array of `shape` is cut into blocks along its last axis.

    Args:
      shape: the array's shape.
      block_size: None (the default layout: the last axis cut into `default_pieces`
        equal segments, each into blocks of `min(256, segment)`), an int (blocks of
        `min(block_size, shape[-1])`, one segment) or a callable `shape -> int` (one
        segment, blocks of that length).

    Returns:
      `(pieces, block)`: the segments of the last axis and the elements per scale within
      each; each segment's last block is zero-padded.
    """
    last = shape[-1] if shape else 1
    if last == 0:  # no elements along the last axis: no blocks, any length holds them
        return 1, 1
    if block_size is None:
        p = default_pieces(last)
        return p, min(DEFAULT_BLOCK, last // p)
    b = block_size(tuple(shape)) if callable(block_size) else min(block_size, last)
    if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1:
        raise ValueError(
            f"block_size: the block length of shape {shape} must be an int >= 1, got {b!r}"
        )
    return 1, int(b)


LEGACY_BLOCK = 256  # the block length of `low_precision_state`'s int default before "auto"


def stored_block_length(shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> int:
    """The block length of a `Blockwise8` of `shape` written by mpjax 3d03840 or earlier with
    its default block length, read from its scales' shape: the 256-long layout where the
    block count is its count (or the scales are in 6a474e7's flattened layout), else
    `shape[-1] / count` (3d03840's blocks from the sharding, which never shared the 256-long
    count). A count that fits neither gets the 256-long layout, which `dequantize` then
    refuses with the shapes. (Reads old checkpoints in `upgrade_state`.)
    """
    last = shape[-1] if shape else 1
    count = scales_shape[-1] if scales_shape else 1
    if last == 0 or tuple(scales_shape[:-1]) != tuple(shape[:-1]):
        return LEGACY_BLOCK if last else 1
    if count == -(-last // min(LEGACY_BLOCK, last)) or last % count:
        return min(LEGACY_BLOCK, last)
    return last // count


def _straddled(x: jax.Array, pieces: int) -> tuple | None:
    """`x`'s PartitionSpec (one entry per axis) where its type splits its last axis over
    Explicit mesh axes into a count of pieces that does not divide `pieces` (its blocks then
    straddle the devices: they are computed on the gathered axis); None elsewhere."""
    sharding = getattr(jax.typeof(x), "sharding", None) if x.ndim else None
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    spec = (*spec, *[None] * (x.ndim - len(spec)))
    if spec[-1] is None:
        return None
    axes = (spec[-1],) if isinstance(spec[-1], str) else tuple(spec[-1])
    k = math.prod(sharding.mesh.shape[a] for a in axes)
    return spec if pieces % k else None


def _gathered(x: jax.Array, spec: tuple | None) -> jax.Array:
    return x if spec is None else jax.sharding.reshard(x, P(*spec[:-1], None))


def _blocks(x: jax.Array, pieces: int, b: int) -> jax.Array:
    """[..., L] -> [..., pieces * ceil(L / pieces / b), b]: `pieces` segments of the last
    axis, each zero-padded to whole blocks of `b`."""
    x = x.reshape(1) if x.ndim == 0 else x
    seg = x.shape[-1] // pieces
    x = x.reshape(*x.shape[:-1], pieces, seg)
    pad = (-seg) % b
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    n = x.shape[-1] // b
    return x.reshape(*x.shape[:-2], pieces * n, b)  # no -1: a size-0 array has none


def _unblock(blocks: jax.Array, shape: tuple[int, ...], pieces: int) -> jax.Array:
    last = shape[-1] if shape else 1
    seg = last // pieces
    lead = blocks.shape[:-2]
    per = blocks.reshape(*lead, pieces, (blocks.shape[-2] // pieces) * blocks.shape[-1])
    return per[..., :seg].reshape(shape)


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
    x: jax.Array, block_size: BlockSize = None, seed: jax.Array | None = None
) -> Blockwise8:
    """Quantizes float `x` blockwise to int8 codes: nearest, or stochastic given a `seed`.

    Args:
      x: a floating array (computed in float32).
      block_size: the blocks along the last axis (see `geometry`; None: the default
        layout).
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
    if not isinstance(x, jax.core.Tracer):  # eagerly: one compile per shape, not one per op
        return _quantize_jitted(x, block_size, seed)
    return _quantize(x, block_size, seed)


def _quantize(x: jax.Array, block_size: BlockSize, seed: jax.Array | None) -> Blockwise8:
    pieces, b = geometry(x.shape, block_size)
    spec = _straddled(x, pieces)
    blocks = _blocks(_gathered(x.astype(jnp.float32), spec), pieces, b)
    absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scales = jnp.where(absmax > 0, absmax, jnp.float32(1.0))
    index = _code_index(jnp.abs(blocks) / scales, seed).astype(jnp.int8)
    codes = jnp.where(jnp.signbit(blocks), -index, index).astype(jnp.int8)
    codes = _unblock(codes, x.shape, pieces)
    if spec is not None:  # the codes split as the array was
        codes = jax.sharding.reshard(codes, P(*spec))
    return Blockwise8(codes, scales[..., 0])


_quantize_jitted = jax.jit(_quantize, static_argnums=1)


def _values(codes: jax.Array) -> jax.Array:
    c = codes.astype(jnp.int32)
    mags = _magnitudes(jnp.abs(c))
    return jnp.where(c < 0, -mags, mags)


def scales_shape(shape: tuple[int, ...], block_size: BlockSize = None) -> tuple[int, ...]:
    """The shape of the scales of an array of `shape` (`block_size` as in `geometry`)."""
    pieces, b = geometry(shape, block_size)
    last = shape[-1] if shape else 1
    return (*shape[:-1], pieces * -(-(last // pieces) // b))


def dequantize(q: Blockwise8, shape: tuple[int, ...], block_size: BlockSize = None) -> jax.Array:
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
        if not isinstance(q.codes, jax.core.Tracer):  # eagerly: one compile per shape
            return _dequantize_jitted(q, shape, block_size)
        return _dequantize(q, shape, block_size)
    size = int(np.prod(shape, dtype=np.int64))
    if isinstance(block_size, int) and q.scales.shape == (-(-size // block_size),):
        return _dequantize_flat(q, shape, block_size)
    raise ValueError(
        f"Blockwise8: scales of shape {tuple(q.scales.shape)} do not match an array of shape "
        f"{shape} in blocks of block_size={block_size!r} (expected "
        f"{scales_shape(shape, block_size)}): the state was written with another block_size"
    )


def _dequantize(q: Blockwise8, shape: tuple[int, ...], block_size: BlockSize) -> jax.Array:
    pieces, b = geometry(shape, block_size)
    spec = _straddled(q.codes, pieces)
    values = _values(_blocks(_gathered(q.codes, spec), pieces, b))
    values = _unblock(values * _gathered(q.scales, spec)[..., None], shape, pieces)
    return values if spec is None else jax.sharding.reshard(values, P(*spec))


_dequantize_jitted = jax.jit(_dequantize, static_argnums=(1, 2))


def _dequantize_flat(q: Blockwise8, shape: tuple[int, ...], block_size: int) -> jax.Array:
    """The old layout: blocks of `block_size` consecutive elements of the flattened array."""
    flat = q.codes.reshape(-1)
    pad = (-flat.size) % block_size
    values = _values(jnp.pad(flat, (0, pad)).reshape(-1, block_size)) * q.scales[:, None]
    return values.reshape(-1)[: flat.size].reshape(shape)
