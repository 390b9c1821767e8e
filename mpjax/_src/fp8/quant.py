"""Float8 quantisation with current scaling: amax, scale, saturating cast and dequantisation.

`q = saturate(x * scale)` with `scale = fp8_max / amax * 2**-margin`, so the largest magnitude
maps to the format's largest finite value; `x ~= q / scale`. Scales are float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["amax", "compute_scale", "dequantize", "fp8_max", "quantize"]

_F32 = jnp.float32


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax(x: jnp.ndarray, axis: int | Sequence[int] | None = None) -> jnp.ndarray:
    """Max `|x|` in float32 over `axis` (all axes if None), keeping dims; NaN propagates.

    Args:
      x: a floating array.
      axis: the axes reduced (for rowwise scaling, the GEMM's contracting axes).

    Returns:
      A float32 array with the reduced axes kept as size 1 (a scalar for `axis=None`).
    """
    keep = axis is not None
    a = jnp.abs(x.astype(_F32))
    top = jnp.max(a, axis=axis, keepdims=keep)

    def with_nan(top):
        # XLA:CPU's jitted max can drop a NaN: propagate it with a second (standard)
        # reduction. A custom NaN-keeping reducer makes a sharded amax an all-reduce XLA:GPU
        # cannot classify (it aborts compiling an FSDP step).
        return jnp.where(jnp.any(jnp.isnan(a), axis=axis, keepdims=keep), jnp.nan, top)

    # XLA:GPU's max propagates NaN (unless --xla_gpu_enable_fast_min_max): the second
    # reduction is for the CPU only (it cost a GPT-2 small tensorwise step 5 % on the B200)
    return jax.lax.platform_dependent(top, cpu=with_nan, default=lambda top: top)


def compute_scale(
    amax_value: jnp.ndarray, dtype: Any, margin: float = 0.0, power_of_two: bool = False
) -> jnp.ndarray:
    """The float32 scale `fp8_max(dtype) / amax * 2**-margin` that maps amax onto fp8's range.

    An amax of 0 gives scale 1 (finite); a scale that would overflow float32 (a subnormal
    amax) is clamped to float32's largest power of two. A NaN amax gives a NaN scale and an
    infinite amax a scale of 0, so a non-finite input makes the GEMM output NaN (never a
    silently finite result: loss scaling still sees the overflow).

    Args:
      amax_value: float32 amax (any shape).
      dtype: the fp8 format.
      margin: headroom exponent (>= 0).
      power_of_two: round finite positive scales down to a power of two (exact scaling).

    Returns:
      float32 scales, the shape of `amax_value`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.fp8 import compute_scale
      >>> float(compute_scale(jnp.float32(2.0), jnp.float8_e4m3fn))
      224.0
    """
    a = jnp.asarray(amax_value, _F32)
    limit = np.float32(2.0**127)
    scale = jnp.float32(fp8_max(dtype) * 2.0 ** (-margin)) / a
    scale = jnp.where(a == 0, jnp.float32(1.0), scale)
    scale = jnp.where(jnp.isposinf(scale), limit, jnp.minimum(scale, limit))
    if power_of_two:
        mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent, m in [0.5, 1)
        rounded = jnp.ldexp(jnp.ones_like(scale), exponent - 1)
        usable = jnp.isfinite(scale) & (scale > 0)
        scale = jnp.where(usable, rounded, scale)
        del mantissa
    return scale


def quantize(x: jnp.ndarray, scale: jnp.ndarray, dtype: Any) -> jnp.ndarray:
    """Saturating cast of `x * scale` to `dtype` (float32 arithmetic); NaN stays NaN.

    Values beyond the format's range become +-fp8_max (never inf, and never the NaN that
    a plain float8_e4m3fn cast gives for out-of-range values).

    Args:
      x: a floating array.
      scale: float32 scale broadcastable to `x`.
      dtype: the fp8 format.

    Returns:
      `x`'s shape in `dtype`.
    """
    top = np.float32(fp8_max(dtype))
    return jnp.clip(x.astype(_F32) * scale, -top, top).astype(dtype)


def dequantize(q: jnp.ndarray, scale: jnp.ndarray, dtype: Any = _F32) -> jnp.ndarray:
    """`q / scale` in `dtype` (float32 by default): the inverse of `quantize`."""
    # a barrier: XLA:GPU would drop a float32 -> fp8 -> float32 round trip (excess precision)
    return (jax.lax.optimization_barrier(q).astype(_F32) / scale).astype(dtype)
