"""Block-scaled quantisation: MXFP8, NVFP4 and DeepSeek-V3's blockwise fp8, with their scales.

Each recipe splits a tensor into blocks along the GEMM's contraction axis (and, for 2-D weight
blocks, along the other axis too) and gives every block its own scale, so an outlier only
costs precision inside its block:

- `"mxfp8"` (OCP Microscaling v1.0, NVIDIA's round-up convention): blocks of 32 along the
  contraction axis for every role; the scale is the smallest power of two `2**k` (stored as
  `float8_e8m0fnu`, `k` in [-127, 127]) with `amax / 2**k <= 448`, so nothing saturates;
  elements `float8_e4m3fn`, round to nearest even.
- `"nvfp4"` (NVIDIA's NVFP4 recipe): a float32 per-tensor scale `t = 448 * 6 / amax(x)`;
  blocks of 16 along the contraction axis (16x16 for weights); each block's scale
  `e4m3(amax_b / 6 * t)` (round to nearest even, at most 448); elements
  `float4_e2m1fn(x * t / scale_b)` saturated to +-6, round to nearest even, or stochastically
  when a `key` is given (NVIDIA rounds gradients stochastically).
- `"blockwise"` (DeepSeek-V3): 1x128 tiles along the contraction axis for activations and
  gradients, 128x128 blocks for weights; float32 scales `amax_b / 448` (rounded up to a power
  of two with `power_of_two_scale=True`); elements `float8_e4m3fn` saturated to +-448.

Dequantisation is `data * scale_b` (divided by `t` for NVFP4). Special values: a block
holding inf or NaN gets a NaN scale, so its whole block dequantises to NaN (OCP: a NaN shared
scale); for NVFP4 the per-tensor scale is NaN then, so the whole tensor does. An all-zero
block gets the smallest scale (`2**-127` for MXFP8; 1 for blockwise; its NVFP4 scale is 0)
and zero elements. A trailing partial block is scaled by the amax of the elements it has.
Each division by a constant (blockwise's `amax / 448`, NVFP4's `amax / 6`) and blockwise's
`x / scale_b` is correctly rounded, as the formulas say (XLA would otherwise multiply by the
rounded reciprocal, an ulp off for some amaxes and, at e4m3 ties, an element off). A size-0
input gives empty elements and scales (and NVFP4's tensor scale of an all-zero tensor, 1).
Tiny blocks stay finite where float32 (whose subnormals XLA flushes to zero) cannot hold the
spec's scale: a blockwise scale is at least float32's smallest normal (amax below ~5e-36),
NVFP4's tensor scale at most `2**125` (amax below ~6e-35), and MXFP8's `2**-127` dequantises
as `2**-126` then halved.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.dataclass import field, pytree_dataclass

__all__ = [
    "BLOCK_SCALINGS",
    "BlockQuantized",
    "block_shape",
    "dequantize_blocks",
    "quantize_blocks",
]

BLOCK_SCALINGS = ("mxfp8", "nvfp4", "blockwise")
_ROLES = ("activation", "weight", "gradient")
_F32 = jnp.float32
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal: XLA flushes subnormals
# NVFP4's tensor scale at most 2**125: dequantising divides by it, which XLA computes with
# its reciprocal, a normal float32 only up to 2**126
_TENSOR_SCALE_MAX = 2.0**125
# (block along the contraction axis, block along the other axis of a 2-D weight)
_BLOCKS = {"mxfp8": (32, 1), "nvfp4": (16, 16), "blockwise": (128, 128)}


@pytree_dataclass
class BlockQuantized:
    """A block-quantised tensor: elements, one scale per block, and NVFP4's tensor scale.

    Attributes:
      data: the elements, the input's shape, in `float8_e4m3fn` (MXFP8, blockwise) or
        `float4_e2m1fn` (NVFP4).
      scales: one scale per block, the input's shape with each blocked axis divided by its
        block size (rounded up): `float8_e8m0fnu` (MXFP8), `float8_e4m3fn` (NVFP4) or
        float32 (blockwise).
      tensor_scale: NVFP4's float32 per-tensor scale `448 * 6 / amax`; None otherwise.
      block: the block size along each axis of `data` (1 where an axis is not blocked).
    """

    data: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array | None
    block: tuple[int, ...] = field(static=True)


def block_shape(scaling: str, ndim: int, axis: int, role: str = "activation") -> tuple[int, ...]:
    """The block size along each axis for `scaling`, contraction `axis` and `role`.

    Args:
      scaling: one of `BLOCK_SCALINGS`.
      ndim: the tensor's rank.
      axis: the contraction axis (negative counts from the end).
      role: `"activation"`, `"weight"` or `"gradient"`; weights of NVFP4 and blockwise use
        2-D blocks over the two axes of a 2-D array.

    Returns:
      A tuple of `ndim` block sizes.

    Example:
      >>> from mpjax.fp8 import block_shape
      >>> block_shape("blockwise", 2, axis=0, role="weight")
      (128, 128)
    """
    if scaling not in BLOCK_SCALINGS:
        raise ValueError(f"block_shape: scaling={scaling!r}; expected one of {BLOCK_SCALINGS}")
    if role not in _ROLES:
        raise ValueError(f"block_shape: role={role!r}; expected one of {_ROLES}")
    _check_axis(axis, "block_shape")
    if not -ndim <= axis < ndim:
        raise ValueError(f"block_shape: axis={axis} is out of range for a {ndim}-d tensor")
    axis %= ndim
    along, across = _BLOCKS[scaling]
    blocks = [1] * ndim
    blocks[axis] = along
    if role == "weight" and across > 1:
        if ndim != 2:
            raise ValueError(
                f"block_shape: role='weight' with {scaling} uses {along}x{across} blocks over "
                f"a 2-D weight; got a {ndim}-d tensor (reshape it to 2-D, or use "
                "role='activation' for 1-D blocks)"
            )
        blocks[1 - axis] = across
    return tuple(blocks)


def _check_axis(axis: Any, caller: str) -> None:
    """Refuses an `axis` that is not an int (`1.0`, `True`), naming `caller`."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        hint = int(axis) if isinstance(axis, float) and axis.is_integer() else -1
        raise TypeError(
            f"{caller}: axis={axis!r} must be an int (the contraction axis; negative counts "
            f"from the end), e.g. axis={hint}"
        )


def _scaling_of(recipe: Any) -> tuple[str, bool]:
    scaling = getattr(recipe, "scaling", recipe)
    if scaling not in BLOCK_SCALINGS:
        raise ValueError(
            f"quantize_blocks: recipe scaling={scaling!r} is not block-scaled; use "
            f"Fp8Recipe(scaling=...) with one of {BLOCK_SCALINGS}"
        )
    return scaling, bool(getattr(recipe, "power_of_two_scale", None))


def _magnitude(xf: jax.Array) -> jax.Array:
    """`|x|` with NaN as inf: a max reduction keeps an inf, while XLA:CPU's vectorised
    column reductions can drop a NaN (a NaN block would get a finite scale)."""
    a = jnp.abs(xf)
    return jnp.where(jnp.isnan(a), jnp.inf, a)


_BITS = {np.dtype(jnp.float32): jnp.int32, np.dtype(jnp.bfloat16): jnp.int16,
         np.dtype(jnp.float16): jnp.int16}  # fmt: skip


def _block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """The float32 amax of each block of `x` (`_magnitude`'s: NaN as inf), for XLA.

    Read in `x`'s own dtype (the max of a bfloat16 or float16 `|x|` is exact) and without a
    compare: `|x|` is `x`'s bits with the sign cleared, capped at inf's bits (a NaN's bits are
    above them). With `_magnitude`'s `isnan` (and one float32 `|x|` for every block shape),
    XLA:GPU wrote the NaN mask and the float32 `|x|` out to memory and read them back for
    each orientation: 4x the bytes of `x` more per quantisation."""
    if x.dtype not in _BITS:
        return _reduce_blocks(_magnitude(x.astype(_F32)), block)
    bits = _BITS[x.dtype]
    inf = jax.lax.bitcast_convert_type(jnp.asarray(np.inf, x.dtype), bits)
    sign_cleared = jax.lax.bitcast_convert_type(x, bits) & jnp.iinfo(bits).max
    magnitude = jnp.minimum(sign_cleared, inf)
    return _reduce_blocks(jax.lax.bitcast_convert_type(magnitude, x.dtype), block).astype(_F32)


def _reduce_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Max over each block of `x` (zero-padded to whole blocks): the blocks' amax."""
    pad = [(0, -n % b) for n, b in zip(x.shape, block, strict=True)]
    x = jnp.pad(x, pad)
    split = []
    for n, b in zip(x.shape, block, strict=True):
        split += [n // b, b]
    return jnp.max(x.reshape(split), axis=tuple(range(1, 2 * x.ndim, 2)))


def divide_by(a: jax.Array, c: float) -> jax.Array:
    """`a / c` for a constant `c`, correctly rounded: XLA rewrites a division by a constant
    (or by a broadcast scalar) as a multiplication by its rounded reciprocal, an ulp off
    `a / c` for some `a` (e.g. blockwise's `amax / 448`). The divisor is a full array behind an
    optimization barrier, which XLA cannot see as a constant."""
    a = jnp.asarray(a, _F32)
    return a / jax.lax.optimization_barrier(jnp.full_like(a, c, dtype=_F32))


def _expand_blocks(s: jax.Array, block: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """Each block's value repeated over the block's elements, cut to `shape`."""
    for d, b in enumerate(block):
        if b > 1:
            s = jnp.repeat(s, b, axis=d)
    return s[tuple(slice(0, n) for n in shape)]


def _pow2_at_least(ratio_num: jax.Array, top: float) -> jax.Array:
    """The exponent k of the smallest power of two with `ratio_num / 2**k <= top` (exact)."""
    mantissa, exponent = jnp.frexp(ratio_num)  # ratio_num = m * 2**e, m in [0.5, 1)
    top_m, top_e = math.frexp(top)
    return jnp.where(mantissa <= top_m, exponent - top_e, exponent - top_e + 1)


def _exp2(k: jax.Array) -> jax.Array:
    """`2.0**k` in float32 for integer k in [-126, 127], exact (built from its bits)."""
    bits = (k.astype(jnp.int32).clip(-126, 127) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, _F32)


def _e8m0(k: jax.Array, bad: jax.Array) -> jax.Array:
    """The E8M0 scale `2**k` (k in [-127, 127]) from its bits; NaN (0xFF) where `bad`."""
    bits = jnp.where(bad, 255, k.astype(jnp.int32) + 127).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)


def _quantize_mxfp8(xf, amax_b, block):
    bad = ~jnp.isfinite(amax_b)
    k = jnp.where(amax_b == 0, -127, _pow2_at_least(amax_b, _E4M3_MAX)).clip(-127, 127)
    k = jnp.where(bad, 0, k)  # a NaN-scaled block's elements: x saturated (defined bits)
    inverse = _expand_blocks(_exp2(-k), block, xf.shape)  # 2**-k: normal for k >= -126
    data = jnp.clip(xf * inverse, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    return data, _e8m0(k, bad), None


def _quantize_blockwise(xf, amax_b, block, power_of_two):
    bad = ~jnp.isfinite(amax_b)
    if power_of_two:
        k = _pow2_at_least(amax_b, _E4M3_MAX).clip(-126, 127)
        scales = _exp2(k)
    else:
        # at least the smallest normal: amax / 448 of a block below ~5e-36 would flush to 0
        # (0 / 0 = NaN for its zeros); its elements then span less of e4m3's range
        scales = jnp.maximum(divide_by(amax_b, _E4M3_MAX), _F32(_TINY))
    scales = jnp.where(amax_b == 0, _F32(1.0), scales)
    scales = jnp.where(bad, jnp.nan, scales).astype(_F32)
    # x / s correctly rounded: XLA:CPU (jaxlib 0.10.2) multiplies by the reciprocal of a
    # broadcast divisor, an ulp off that moves exact e4m3 ties (x = 0.75 amax: 336, between 320
    # and 352) to the odd side. `+ x * 0` (0, or NaN in a NaN-scaled block) makes the divisor
    # no broadcast, fused (an optimization barrier wrote it out: 2x the bytes of a float32 x)
    q = xf / (_expand_blocks(scales, block, xf.shape) + xf * 0)
    data = jnp.clip(q, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    return data, scales, None


def hash_uniform(seed: jax.Array, index: jax.Array) -> jax.Array:
    """Uniform floats in [0, 1) from a uint32 `seed` and uint32 element indices: a counter
    hash (Wellons' lowbias32 of `index * golden + seed`), cheap in XLA and in a kernel."""
    x = index.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + seed.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).astype(_F32) * _F32(2.0**-24)


def key_seed(key: jax.Array) -> jax.Array:
    """The uint32 seed of stochastic rounding drawn from a PRNG `key`."""
    return jax.random.bits(key, (), jnp.uint32)


def row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major linear index in an array of `shape`, as uint32 (wrapping)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
        stride = (stride * shape[d]) % 2**32
    return index


def _round_e2m1(v: jax.Array, uniform: jax.Array | None) -> jax.Array:
    """`v` (|v| <= 6) to float4_e2m1fn: nearest even, or stochastic (unbiased) given
    `uniform`, a [0, 1) draw per element."""
    if uniform is None:
        return v.astype(jnp.float4_e2m1fn)
    a = jnp.abs(v)
    ulp = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(_F32)
    low = jnp.floor(a / ulp) * ulp
    up = uniform < (a - low) / ulp
    return (jnp.sign(v) * jnp.minimum(low + ulp * up, _E2M1_MAX)).astype(jnp.float4_e2m1fn)


def nvfp4_tensor_scale(amax_t: jax.Array) -> jax.Array:
    """NVFP4's float32 tensor scale `448 * 6 / amax_t` (1 for 0, NaN for a non-finite amax)."""
    # 2688 / amax overflows for amax below ~8e-36, and its reciprocal flushes to zero below
    # ~6e-35: at most 2**125 (block scales below amax_t / 2**20 then shrink, as they do)
    t = jnp.minimum(_F32(_E4M3_MAX * _E2M1_MAX) / amax_t, _F32(_TENSOR_SCALE_MAX))
    tensor_scale = jnp.where(amax_t == 0, _F32(1.0), t)
    return jnp.where(jnp.isfinite(amax_t), tensor_scale, jnp.nan).astype(_F32)


def _quantize_nvfp4(xf, amax_b, block, uniform):
    tensor_scale = nvfp4_tensor_scale(jnp.max(amax_b, initial=0.0))  # 0: size 0
    # the spec's amax / 6 * t, unless amax / 6 would flush to zero (amax below ~7e-38)
    decode = jnp.where(
        amax_b < _F32(_E2M1_MAX * _TINY),
        amax_b * divide_by(tensor_scale, _E2M1_MAX),
        divide_by(amax_b, _E2M1_MAX) * tensor_scale,
    )
    scales = jnp.minimum(decode, _F32(_E4M3_MAX)).astype(jnp.float8_e4m3fn)
    s = scales.astype(_F32)
    ratio = tensor_scale / s
    huge = jnp.isinf(ratio)  # a huge t over a tiny s: then (x * t) / s
    # x * ratio / 1 or x * t / s, per block: one expression XLA fuses into a single pass
    # (with a select of the two, it wrote both out in float32); `+ x * 0`: `_quantize_blockwise`
    times = _expand_blocks(jnp.where(huge, tensor_scale, ratio), block, xf.shape)
    over = _expand_blocks(jnp.where(huge, s, 1.0), block, xf.shape)
    v = xf * times / (over + xf * 0)
    v = jnp.where(_expand_blocks(s, block, xf.shape) == 0, 0.0, jnp.clip(v, -_E2M1_MAX, _E2M1_MAX))
    return _round_e2m1(v, uniform), scales, tensor_scale


def quantize_blocks(
    x: jax.Array,
    recipe: Any,
    *,
    axis: int = -1,
    role: str = "activation",
    key: jax.Array | None = None,
) -> BlockQuantized:
    """Quantises `x` with a block-scaled recipe (`"mxfp8"`, `"nvfp4"` or `"blockwise"`).

    Args:
      x: a floating array (computed in float32).
      recipe: an `Fp8Recipe` whose `scaling` is block-scaled (or the scaling's name);
        `power_of_two_scale=True` rounds blockwise scales up to powers of two.
      axis: the contraction axis, along which blocks run.
      role: `"activation"`, `"weight"` (2-D blocks for NVFP4 and blockwise) or `"gradient"`.
      key: a PRNG key: round NVFP4 elements stochastically (unbiased; the draws are a
        counter hash of the key's bits and each element's index); None rounds to nearest
        even. MXFP8 and blockwise always round to nearest even.

    Returns:
      A `BlockQuantized`; `dequantize_blocks` maps it back to float32.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.fp8 import dequantize_blocks, quantize_blocks
      >>> bq = quantize_blocks(jnp.linspace(-1.0, 1.0, 64).reshape(2, 32), "mxfp8")
      >>> bq.scales.shape, bq.scales.dtype
      ((2, 1), dtype(float8_e8m0fnu))
      >>> float(abs(dequantize_blocks(bq)[0, 0] + 1.0))
      0.0
    """
    scaling, power_of_two = _scaling_of(recipe)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize_blocks: x has dtype {x.dtype}; expected a floating array")
    if x.ndim == 0:
        raise ValueError("quantize_blocks: x is a scalar; it needs a contraction axis")
    if key is not None and scaling != "nvfp4":
        raise ValueError(
            f"quantize_blocks: key= (stochastic rounding) applies to 'nvfp4' elements only; "
            f"{scaling} rounds to nearest even: pass key=None"
        )
    _check_axis(axis, "quantize_blocks")
    block = block_shape(scaling, x.ndim, axis, role)
    uniform = None if key is None else hash_uniform(key_seed(key), row_major_index(x.shape))
    return quantize_with_blocks(x, scaling, block, power_of_two, uniform)


def quantize_with_blocks(
    x: jax.Array,
    scaling: str,
    block: tuple[int, ...],
    power_of_two: bool = False,
    uniform: jax.Array | None = None,
) -> BlockQuantized:
    """`quantize_blocks` given the block sizes (and NVFP4's stochastic draws) explicitly.

    Args:
      x: a floating array.
      scaling: one of `BLOCK_SCALINGS`.
      block: the block size along each axis of `x`.
      power_of_two: blockwise scales rounded up to powers of two.
      uniform: None (round to nearest even) or, for NVFP4, a [0, 1) draw per element of `x`.

    Returns:
      A `BlockQuantized`.
    """
    if x.dtype != _F32:  # the stored input: under jit XLA may keep a bfloat16 producer's
        x = jax.lax.optimization_barrier(x)  # float32 result (excess precision), not eagerly
    xf = x.astype(_F32)
    amax_b = _block_amax(x, block)
    if scaling == "mxfp8":
        parts = _quantize_mxfp8(xf, amax_b, block)
    elif scaling == "blockwise":
        parts = _quantize_blockwise(xf, amax_b, block, power_of_two)
    else:
        parts = _quantize_nvfp4(xf, amax_b, block, uniform)
    return BlockQuantized(*parts, block=block)


def dequantize_blocks(bq: BlockQuantized, dtype: Any = _F32) -> jax.Array:
    """`data * scale` per block (divided by the tensor scale for NVFP4), in `dtype`.

    Args:
      bq: a `BlockQuantized` from `quantize_blocks`.
      dtype: the result's dtype (float32 by default).

    Returns:
      An array of `bq.data`'s shape.
    """
    if not isinstance(bq, BlockQuantized):
        raise TypeError(f"dequantize_blocks: expected a BlockQuantized, got {type(bq).__name__}")
    # XLA:GPU drops a float32 -> 8/4-bit -> float32 round trip (excess precision): the
    # barrier keeps the rounding, so emulated GEMMs compute the format's numbers on a GPU too
    data = jax.lax.optimization_barrier(bq.data).astype(_F32)
    if bq.scales.dtype == jnp.float8_e8m0fnu:
        out = _times_e8m0(data, bq.scales, bq.block)
    else:
        out = data * _expand_blocks(bq.scales.astype(_F32), bq.block, bq.data.shape)
    if bq.tensor_scale is not None:
        # correctly rounded: `+ out * 0` keeps XLA from multiplying by the reciprocal of a
        # broadcast divisor (see `_quantize_blockwise`), fused, where a barrier wrote it out
        out = out / (bq.tensor_scale + out * 0)
    return out.astype(np.dtype(dtype))


def _times_e8m0(data: jax.Array, scales: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """`data * 2**k` per block: E8M0's `2**-127` is a float32 subnormal (flushed to zero by
    XLA), so that scale multiplies as `2**-126` and then halves the (normal) product."""
    bits = _expand_blocks(jax.lax.bitcast_convert_type(scales, jnp.uint8), block, data.shape)
    bits = bits.astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(jnp.maximum(bits, 1) << 23, _F32)
    out = data * jnp.where(bits == 255, jnp.nan, scale)
    return jnp.where(bits == 0, out * _F32(0.5), out)
