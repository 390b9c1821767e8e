"""The representable ranges of the low-precision formats `numerics` checks values against.

Thresholds are those of a cast with round-to-nearest-even: a value flushes to zero when its
magnitude is at most half the smallest subnormal, lands on a subnormal up to half a subnormal
step below the smallest normal, and overflows (to inf, or NaN for the `fn` fp8 formats) from
half a step above the largest finite value (from just above it when the largest finite value
has an even significand, as float8_e4m3fn's 448, to which the tie rounds).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["FormatRange", "format_range"]


class FormatRange(NamedTuple):
    """The magnitudes a format represents, and the cast thresholds between its regimes."""

    name: str
    smallest_subnormal: float
    smallest_normal: float
    max: float
    flush_below: float  # |x| <= this casts to 0
    normal_from: float  # |x| >= this casts to a normal number
    overflow_from: float  # |x| >= this casts to inf/NaN (> this when not overflow_at_tie)
    overflow_at_tie: bool  # whether |x| == overflow_from overflows


def format_range(name: str) -> FormatRange:
    """The `FormatRange` of a floating-point dtype name ("float16", "float8_e4m3fn", ...).

    Args:
      name: a NumPy / ml_dtypes floating dtype name.

    Returns:
      Its `FormatRange` (float64 thresholds).

    Example:
      >>> from mpjax._src.report.formats import format_range
      >>> format_range("float16").flush_below == 2.0**-25
      True
    """
    try:
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        info = ml_dtypes.finfo(dtype)
    except (TypeError, ValueError) as err:
        raise ValueError(f"mpjax.numerics: {name!r} is not a floating-point format") from err
    if dtype.itemsize > 8:  # np.dtype("f16") is NumPy's 16-byte long double, not float16
        raise ValueError(
            f"mpjax.numerics: {name!r} is {dtype.name}, not a format of float64 or narrower; "
            "write 'float16' for IEEE half precision"
        )
    sub = float(info.smallest_subnormal)
    tiny = float(info.smallest_normal)
    top = float(info.max)
    ulp_top = 2.0 ** (np.floor(np.log2(top)) - info.nmant)
    odd = int(round(top / ulp_top)) % 2 == 1
    return FormatRange(
        dtype.name, sub, tiny, top, sub / 2, tiny - sub / 2, float(top + ulp_top / 2), odd
    )
