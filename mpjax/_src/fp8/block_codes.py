"""The element and scale codes of the block quantiser kernel, from integer and float32 ops.

Triton has no fp4 or E8M0 type (and its fp8 casts differ across GPUs), so the kernel computes
each code's bits itself, as `uint8`: `float8_e4m3fn` bits, `float4_e2m1fn` codes (one per
byte, packed in pairs by the kernel) and E8M0 exponent bits; XLA bitcasts them afterwards.
Each function equals XLA's conversion bit for bit on the values the quantiser gives it
(`tests/fp8/test_block_quantize_kernel.py` checks them exhaustively), and the scale and element
arithmetic repeats `mpjax._src.fp8.blocks` op for op, with each division correctly rounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from mpjax._src.fp8.blocks import (
    _E2M1_MAX,
    _E4M3_MAX,
    _TINY,
    _exp2,
    _pow2_at_least,
)

__all__ = [
    "blockwise_tile",
    "divide",
    "e2m1_code",
    "e4m3_bits",
    "mxfp8_tile",
    "nvfp4_tile",
    "stochastic_e2m1_code",
]

_F32 = jnp.float32
_U32 = jnp.uint32


def divide(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """`a / b` correctly rounded (Triton's `/` is the approximate `div.full.f32` on GPUs)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, _F32), jnp.asarray(b, _F32))
    if interpret:  # XLA: a constant or broadcast divisor would become a reciprocal's product
        return a / lax.optimization_barrier(b)
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, _F32)],
    )
    return out


def _bits(v: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(v.astype(_F32), _U32)


def e4m3_bits(v: jax.Array) -> jax.Array:
    """`float8_e4m3fn` bits (uint8) of float32 `v` with `|v| <= 448` or NaN, nearest even."""
    b = _bits(v)
    sign = (b >> 24) & _U32(0x80)
    a = b & _U32(0x7FFFFFFF)
    # normal: round the mantissa to 3 bits (ties to even), rebias 127 -> 7
    normal = ((a + _U32(0x7FFFF) + ((a >> 20) & _U32(1))) >> 20) - _U32(120 << 3)
    # subnormal (below 2**-6): the float32 addition rounds |v| to a multiple of 2**-9
    sub = _bits(jnp.abs(v.astype(_F32)) + _F32(2.0**14)) - _U32(0x46800000)  # 2**14's bits
    mag = jnp.where(a >= _U32(121 << 23), normal, sub)
    mag = jnp.where(jnp.isnan(v), _U32(0x7F), mag)
    return (sign | mag).astype(jnp.uint8)


def e4m3_value(bits: jax.Array) -> jax.Array:
    """The float32 value of non-negative `float8_e4m3fn` bits (0x7F and 0xFF: NaN)."""
    b = bits.astype(_U32) & _U32(0x7F)
    e, m = b >> 3, b & _U32(7)
    normal = lax.bitcast_convert_type(((e + _U32(120)) << 23) | (m << 20), _F32)
    value = jnp.where(e == 0, m.astype(_F32) * _F32(2.0**-9), normal)
    return jnp.where(b == _U32(0x7F), jnp.nan, value)


def e2m1_code(v: jax.Array) -> jax.Array:
    """The `float4_e2m1fn` code (uint8, 0-15) of float32 `v` with `|v| <= 6`, nearest even;
    NaN gives 0x8 (-0), as XLA's conversion does."""
    a = jnp.abs(v)
    up = [(0.25, False), (0.75, True), (1.25, False), (1.75, True)]
    up += [(2.5, False), (3.5, True), (5.0, False)]
    mag = jnp.zeros(v.shape, _U32)
    for edge, inclusive in up:  # a tie rounds to the even code
        mag = mag + jnp.where(a >= edge if inclusive else a > edge, _U32(1), _U32(0))
    sign = (_bits(v) >> 28) & _U32(0x8)
    return jnp.where(jnp.isnan(v), _U32(0x8), sign | mag).astype(jnp.uint8)


def mxfp8_tile(xf: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP8 element bits and E8M0 scale bits of `xf` given its blocks' `amax` (broadcast)."""
    bad = ~jnp.isfinite(amax)
    k = jnp.where(amax == 0, -127, _pow2_at_least(amax, _E4M3_MAX)).clip(-127, 127)
    k = jnp.where(bad, 0, k)
    data = jnp.clip(xf * _exp2(-k), -_E4M3_MAX, _E4M3_MAX)
    scale = jnp.where(bad, 255, k.astype(jnp.int32) + 127).astype(jnp.uint8)
    return e4m3_bits(data), scale


def blockwise_tile(xf, amax, *, power_of_two: bool, interpret: bool):
    """Blockwise element bits and float32 scales of `xf` given its blocks' `amax`."""
    bad = ~jnp.isfinite(amax)
    if power_of_two:
        scales = _exp2(_pow2_at_least(amax, _E4M3_MAX).clip(-126, 127))
    else:
        scales = jnp.maximum(divide(amax, _E4M3_MAX, interpret=interpret), _F32(_TINY))
    scales = jnp.where(amax == 0, _F32(1.0), scales)
    scales = jnp.where(bad, jnp.nan, scales).astype(_F32)
    q = divide(xf, scales, interpret=interpret)
    return e4m3_bits(jnp.clip(q, -_E4M3_MAX, _E4M3_MAX)), scales


def stochastic_e2m1_code(v: jax.Array, uniform: jax.Array) -> jax.Array:
    """`mpjax._src.fp8.blocks._round_e2m1` with draws `uniform`, as codes (uint8).

    `|v|` passes each grid point `g_i` (spacing `s_i` below it) when it is more than
    `uniform * s_i` above `g_i - s_i`: in its own interval that is the reference's
    `uniform < (|v| - low) / ulp` (both sides exact), below it always true, above it false.
    Seven compares, like `e2m1_code`. The reference's form (the spacing by selects, floor,
    two divisions, sign) made XLA's Triton pipeline spend ~14 s of CPU per 8x8 quadrant
    (its fixed-point rewrite passes), minutes per kernel; this compiles as fast as nearest.

    Args:
      v: float32 with `|v| <= 6`, or NaN (code 0x8, as `e2m1_code`).
      uniform: float32 draws in [0, 1), `v`'s shape.

    Returns:
      uint8 `float4_e2m1fn` codes.
    """
    a = jnp.abs(v)
    mag = jnp.zeros(v.shape, _U32)
    below = 0.0
    for edge in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
        step = uniform * _F32(edge - below)  # exact: a power of two times the draw
        mag = mag + jnp.where(a - _F32(below) > step, _U32(1), _U32(0))
        below = edge
    sign = (_bits(v) >> 28) & _U32(0x8)
    return jnp.where(jnp.isnan(v), _U32(0x8), sign | mag).astype(jnp.uint8)


def _round_e2m1(v, uniform):
    """`mpjax._src.fp8.blocks._round_e2m1` as codes."""
    return e2m1_code(v) if uniform is None else stochastic_e2m1_code(v, uniform)


def nvfp4_tile(xf, amax, tensor_scale, uniform, *, interpret: bool):
    """NVFP4 element codes and `float8_e4m3fn` scale bits of `xf` given its blocks' `amax`
    and the tensor scale (`uniform`: None, or a [0, 1) draw per element)."""

    def div(a, b):
        return divide(a, b, interpret=interpret)

    t = tensor_scale
    decode = jnp.where(
        amax < _F32(_E2M1_MAX * _TINY), amax * div(t, _E2M1_MAX), div(amax, _E2M1_MAX) * t
    )
    scale = e4m3_bits(jnp.minimum(decode, _F32(_E4M3_MAX)))
    block_scale = e4m3_value(scale)
    ratio = div(t, block_scale)
    v = jnp.where(jnp.isinf(ratio), div(xf * t, block_scale), xf * ratio)
    v = jnp.where(block_scale == 0, 0.0, jnp.clip(v, -_E2M1_MAX, _E2M1_MAX))
    return _round_e2m1(v, uniform), scale
