"""`Fp8Recipe(choose="roofline")`: each GEMM's format from a roofline of it on a target GPU.

For a GEMM `[M, K] x [K, N]` trained with its two backward GEMMs, each candidate format is
timed as the sum of its quantisation passes (memory bound: bytes / bandwidth) and its three
GEMMs (each `max(2MKN / peak, bytes / bandwidth)`), with the target's data-sheet peaks
(`mpjax._src.core.gpu_peaks`). Bytes counted, `c` the compute dtype's size and `S` the three
matrices' elements (`MK + KN + MN`):

- compute dtype: each GEMM reads its two operands and writes its output, `c` bytes each;
- tensorwise (current scaling): an amax pass and a quantise pass per tensor, once
  (`(2c + 1) S`; the fp8 copy serves both GEMMs it feeds); GEMM operands 1 byte;
- rowwise: the same per orientation (each tensor is re-quantised for its second GEMM);
- block-scaled: one fused pass per tensor that reads it once and writes each orientation it
  is used in (elements plus block scales: MXFP8 1 + 1/32 bytes, NVFP4 1/2 + 1/16, blockwise
  1 + 4/128); weights in 2-D blocks (NVFP4, blockwise) need one orientation; NVFP4 adds a
  per-tensor amax pass. A block format is a candidate only where the target multiplies it
  natively (`"b200"`: MXFP8, NVFP4; `"h100"`: none), else tensorwise fp8 stands in.

The fastest candidate wins; the compute dtype is kept unless a format is strictly faster,
and the recipe's own format beats tensorwise on a tie.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mpjax._src.core.gpu_peaks import GPU_PEAKS
from mpjax._src.fp8.blocks import BLOCK_SCALINGS
from mpjax._src.fp8.layouts import free_axes
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["GemmChoice", "choose_gemm_format", "gemm_mkn", "recipe_for_format"]

# (element bytes, scale bytes per element, peak key, weight orientations)
_BLOCK = {
    "mxfp8": (1.0, 1 / 32, "fp8", 2),
    "nvfp4": (0.5, 1 / 16, "fp4", 1),
    "blockwise": (1.0, 4 / 128, "fp8", 1),
}
COMPUTE = "compute"


class GemmChoice(NamedTuple):
    """A GEMM's format under `choose="roofline"`.

    Attributes:
      format: the recipe's scaling (`"mxfp8"`, `"tensorwise"`, ...) or `"compute"` (the
        compute dtype).
      reason: the roofline times behind the choice, in microseconds.
      seconds: each candidate's modelled time (forward and both gradients).
    """

    format: str
    reason: str
    seconds: dict


def gemm_mkn(site: Fp8Site) -> tuple[int, int, int]:
    """`(M, K, N)` of a `dot_general` site without batch axes (free and contracted sizes)."""
    (lc, rc), _ = site.dimension_numbers
    lhs, rhs = site.lhs_shape, site.rhs_shape
    k = math.prod(lhs[i] for i in lc)
    m = math.prod(lhs[i] for i in free_axes(len(lhs), lc, ()))
    n = math.prod(rhs[i] for i in free_axes(len(rhs), rc, ()))
    return m, k, n


def _gemms(m, k, n, operand_bytes, out_bytes, peak, bw) -> float:
    """The three GEMMs (forward, input gradient, weight gradient), each a roofline."""
    total = 0.0
    for a, b, out in ((m * k, k * n, m * n), (m * n, k * n, m * k), (m * k, m * n, k * n)):
        moved = operand_bytes * (a + b) + out_bytes * out
        total += max(2 * m * k * n / peak, moved / bw)
    return total


def _seconds(fmt: str, m: int, k: int, n: int, c: int, target: str) -> float:
    peaks = GPU_PEAKS[target]
    bw, flops = peaks.hbm_bytes_per_s, peaks.tensor_flops
    s = m * k + k * n + m * n
    if fmt == COMPUTE:
        return _gemms(m, k, n, c, c, flops["bf16"], bw)
    if fmt in ("tensorwise", "rowwise"):
        passes = 1 if fmt == "tensorwise" else 2
        quant = passes * (2 * c + 1) * s
        return quant / bw + _gemms(m, k, n, 1, c, flops["fp8"], bw)
    elem, scale, peak, w_orient = _BLOCK[fmt]
    written = (elem + scale) * (2 * m * k + 2 * m * n + w_orient * k * n)
    quant = c * s + written + (c * s if fmt == "nvfp4" else 0)
    return quant / bw + _gemms(m, k, n, elem + scale, c, flops[peak], bw)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


def choose_gemm_format(recipe: Fp8Recipe, site: Fp8Site, compute_dtype) -> GemmChoice:
    """The format of one eligible GEMM under `recipe.choose="roofline"` on `recipe.target`.

    Args:
      recipe: an `Fp8Recipe` with `choose="roofline"`.
      site: the GEMM (no batch axes).
      compute_dtype: the compute dtype (its size counts in the bytes moved).

    Returns:
      A `GemmChoice`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax._src.fp8.choose import choose_gemm_format
      >>> from mpjax._src.fp8.recipe import Fp8Site
      >>> recipe = Fp8Recipe("mxfp8", choose="roofline", target="b200")
      >>> dims = (((1,), (0,)), ((), ()))
      >>> big = Fp8Site("", (8192, 8192), (8192, 8192), dims)
      >>> choose_gemm_format(recipe, big, jnp.bfloat16).format
      'mxfp8'
    """
    target = recipe.target
    m, k, n = gemm_mkn(site)
    c = np.dtype(compute_dtype).itemsize
    own = recipe.scaling
    native = own not in _BLOCK or own in GPU_PEAKS[target].block_formats
    candidates = [COMPUTE] + ([own] if native else [])
    if own in _BLOCK:
        candidates.append("tensorwise")
    seconds = {f: _seconds(f, m, k, n, c, target) for f in candidates}
    best = COMPUTE
    for fmt in candidates[1:]:  # strictly faster only: ties keep the more precise choice
        if seconds[fmt] < seconds[best]:
            best = fmt
    dtype = np.dtype(compute_dtype).name
    label = {COMPUTE: dtype}
    times = ", ".join(f"{label.get(f, f)} {_us(seconds[f])}" for f in candidates)
    no_native = "" if native else f"; no native {own} on {target}"
    if best == COMPUTE:
        reason = (
            f"memory bound on {target} ({m}x{k}x{n}): quantising costs more than the low "
            f"precision GEMMs save: {times}{no_native}"
        )
    else:
        reason = f"pays on {target} ({m}x{k}x{n}): {times}{no_native}"
    return GemmChoice(best, reason, seconds)


def recipe_for_format(recipe: Fp8Recipe, fmt: str) -> Fp8Recipe:
    """`recipe` running `fmt` with no further choice (what the chosen GEMM runs with); a
    block-scaled `fmt` takes no margin (its scales come from each block's amax)."""
    margin = 0.0 if fmt in BLOCK_SCALINGS else recipe.margin
    return dataclasses.replace(recipe, scaling=fmt, choose="fixed", target=None, margin=margin)
