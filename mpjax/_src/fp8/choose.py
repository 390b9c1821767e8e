"""`Fp8Recipe(choose="roofline")`: each GEMM's format from a roofline of it on a target GPU.

For a GEMM `[M, K] x [K, N]` trained with its two backward GEMMs, each candidate format is
timed as the kernels its compiled program launches, each as the cost model
(`mpjax._src.analysis.hlo_cost`) times a kernel: a GEMM `max(2MKN / peak, bytes / bandwidth)`,
any other kernel `bytes / bandwidth` (no launch latency), with the target's data-sheet
peaks (`mpjax._src.core.gpu_peaks`), each part then divided by its kernel class's measured
efficiency on the target's GPU class (`mpjax._src.core.calibration`: the calibrated model;
a class never measured there costs `UNMEASURED_EFFICIENCY` of its peak). `c` is the compute dtype's
size; the tensors are `x` (`MK` elements), `w` (`KN`) and `g` (`MN`), the outputs the
forward's `MN`, the input gradient's `MK` and the weight gradient's `KN` elements
(`O = MN + MK + KN`); `S = MK + KN + MN`. Bytes counted per part (`GemmChoice.parts`):

- compute dtype: three GEMMs reading `c`-byte operands and writing `c`-byte outputs;
- tensorwise (current scaling, `fp8_dot_general`): an amax pass (`c S`) and a quantise pass
  (`(c + 1) S`) per tensor, once (the fp8 copy serves both GEMMs it feeds); fp8 GEMMs
  (1-byte operands, `c`-byte outputs); each output rescaled by its operands' scales in a pass
  of its own (`2c O`: XLA's fp8 GEMM does not take the scales);
- rowwise: the amax and quantise passes per orientation (`2 (2c + 1) S`), the same rescale;
- block-scaled (`e` element and `s` scale bytes per element: MXFP8 `1 + 1/32`, NVFP4
  `1/2 + 1/16`, blockwise `1 + 4/128`): the fused quantiser reads each tensor once and writes
  each orientation it is used in (`c S + (e + s)(2MK + o KN + 2MN)`, `o = 1` for weights in 2-D
  blocks, NVFP4 and blockwise; else 2); the GEMMs read `e + s` bytes per operand element.
  Blockwise (mpjax's Pallas GEMM) and MXFP8 write `c`-byte outputs. MXFP8 and NVFP4 run as
  cuDNN block-scaled GEMMs (`jax.nn.scaled_matmul`), which add a kernel per GEMM operand
  rewriting its scales in cuDNN's layout (read and written: `2s (2MK + 2KN + 2MN)`). NVFP4's
  GEMMs write float32 (4 bytes), each output cast to the compute dtype in a pass of its own,
  its tensor scales divided out there (`(4 + c) O`). NVFP4 also reads `x` and `w` once for
  their tensor scales (`c (MK + KN)`); its gradient `g` (Hadamard-rotated and rounded
  stochastically for the weight gradient, by the fused quantiser too) moves
  `NVFP4_GRADIENT_BYTES` bytes per element over its kernels (the quantiser, the two copies'
  tensor-scale amaxes, the seed's sum), counted from the deviceless B200 program, in place
  of the fused quantiser's `c + 2(e + s)`.

Not counted: how XLA fuses these passes with the GEMM's neighbours (an amax or quantise pass
fused into the producer of `x` or `g`, a producer fused into a compute-dtype GEMM, a
float32 producer the quantiser reads), and layout copies of the gradients.

A block format is a candidate only where the target multiplies it natively (`"b200"`:
MXFP8, NVFP4; blockwise, mpjax's own kernel, only with `block_lowering="native"` or where
the calibration table measured it faster, which no GPU class has: `native_block_gemms`),
else tensorwise fp8 stands in. The fastest
candidate wins; the compute dtype is kept unless a format is strictly faster, and the
recipe's own format beats tensorwise on a tie.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mpjax._src.core.calibration import efficiency, gpu_class, native_measured_faster
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
_CUDNN = ("mxfp8", "nvfp4")  # block formats run as cuDNN block-scaled GEMMs (float32 out)
# Bytes per element of a bfloat16 `g` that NVFP4's gradient quantisation (the fused
# quantiser with stochastic rounding, the tensor-scale amaxes, the seed) reads and writes,
# summed over its kernels in the deviceless B200 program (`tests/fp8/test_choose_gpu.py`
# recounts them: 7.63); each read of `g` itself is 2 of them.
NVFP4_GRADIENT_BYTES = 7.6
_NVFP4_GRADIENT_READS = 3  # reads of `g` in its own dtype among them (quantiser, amaxes)
COMPUTE = "compute"


class GemmChoice(NamedTuple):
    """A GEMM's format under `choose="roofline"`.

    Attributes:
      format: the recipe's scaling (`"mxfp8"`, `"tensorwise"`, ...) or `"compute"` (the
        compute dtype).
      reason: the roofline times behind the choice, in microseconds.
      seconds: each candidate's modelled time (forward and both gradients).
      parts: each candidate's time by part (`"gemms"`, `"quantise"`, `"amax"`,
        `"rescale"`, `"scale layout"`, `"output cast"`), seconds.
    """

    format: str
    reason: str
    seconds: dict
    parts: dict = {}


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


# The calibration class (`core.calibration.KERNEL_CLASSES`) of each part's kernels; the
# GEMMs by format (`_GEMM_CLASS`), the other parts XLA's bandwidth-bound fusions.
_GEMM_CLASS = {
    "tensorwise": "fp8 gemm",
    "rowwise": "fp8 gemm",
    "blockwise": "pallas blockwise gemm",
    "mxfp8": "block-scaled gemm",
    "nvfp4": "block-scaled gemm",
}


def _eff(target: str, kernel_class: str) -> float:
    return efficiency(target, kernel_class).value


def _calibrated(fmt: str, parts: dict, c: int, target: str) -> dict:
    """`parts` (timed at the peaks) over each part's calibrated efficiency on `target`."""
    out = {}
    for part, seconds in parts.items():
        if part == "gemms":
            cls = _GEMM_CLASS.get(fmt, "f32 gemm" if c >= 4 else "bf16 gemm")
        elif part == "quantise" and fmt == "blockwise":
            cls = "pallas block quantise"
        else:
            cls = "fusion"
        out[part] = seconds / _eff(target, cls)
    return out


def gemm_parts(fmt: str, m: int, k: int, n: int, c: int, target: str) -> dict[str, float]:
    """The calibrated seconds of one GEMM trained in `fmt` on `target`, by part.

    Each part's roofline (below) is divided by its kernel class's measured efficiency on
    `target`'s GPU class (`core.calibration`; a class never measured there at
    `UNMEASURED_EFFICIENCY`): the GEMMs by format (XLA's bf16 or fp8 GEMMs, mpjax's Pallas
    blockwise GEMM, cuDNN's block-scaled GEMMs), blockwise's quantiser as mpjax's Pallas
    quantiser, every other part as XLA's bandwidth-bound fusions.

    Args:
      fmt: `"compute"`, `"tensorwise"`, `"rowwise"` or a block format of `_BLOCK`.
      m, k, n: the forward GEMM's sizes (`[M, K] x [K, N]`).
      c: the compute dtype's size in bytes.
      target: a key of `GPU_PEAKS`.

    Returns:
      `{part: seconds}` (the module docstring's bytes per part); parts the format does not
      run are absent.

    Example:
      >>> from mpjax._src.fp8.choose import gemm_parts
      >>> sorted(gemm_parts("nvfp4", 8192, 768, 3072, 2, "b200"))
      ['amax', 'gemms', 'output cast', 'quantise', 'scale layout']
    """
    return _calibrated(fmt, _peak_parts(fmt, m, k, n, c, target), c, target)


def _peak_parts(fmt: str, m: int, k: int, n: int, c: int, target: str) -> dict[str, float]:
    """`gemm_parts` at the data-sheet peaks (every kernel at its roofline)."""
    peaks = GPU_PEAKS[target]
    bw, flops = peaks.hbm_bytes_per_s, peaks.tensor_flops
    x, w, g = m * k, k * n, m * n
    s, outs = x + w + g, m * n + m * k + k * n
    if fmt == COMPUTE:
        return {"gemms": _gemms(m, k, n, c, c, flops["bf16"], bw)}
    if fmt in ("tensorwise", "rowwise"):
        passes = 1 if fmt == "tensorwise" else 2
        return {
            "gemms": _gemms(m, k, n, 1, c, flops["fp8"], bw),
            "amax": passes * c * s / bw,
            "quantise": passes * (c + 1) * s / bw,
            "rescale": 2 * c * outs / bw,
        }
    elem, scale, peak, w_orient = _BLOCK[fmt]
    eb = elem + scale
    quantise = c * s + eb * (2 * x + w_orient * w + 2 * g)
    if fmt == "nvfp4":  # g: the seeded quantiser plus its amax and seed passes
        g_bytes = NVFP4_GRADIENT_BYTES + _NVFP4_GRADIENT_READS * (c - 2)
        quantise += (g_bytes - c - 2 * eb) * g
    if fmt not in _CUDNN:  # blockwise: mpjax's Pallas GEMM writes the compute dtype
        return {"gemms": _gemms(m, k, n, eb, c, flops[peak], bw), "quantise": quantise / bw}
    out = {"quantise": quantise / bw, "scale layout": 2 * scale * 2 * s / bw}
    if fmt == "mxfp8":  # cuDNN writes the compute dtype
        return {"gemms": _gemms(m, k, n, eb, c, flops[peak], bw), **out}
    # NVFP4: float32 outputs, the tensor scales divided out as each is cast
    out["gemms"] = _gemms(m, k, n, eb, 4, flops[peak], bw)
    out["output cast"] = (4 + c) * outs / bw
    out["amax"] = c * (x + w) / bw  # g's amaxes are among NVFP4_GRADIENT_BYTES
    return out


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
    if own == "blockwise" and recipe.block_lowering != "native":  # mpjax's own kernel
        # runs natively under "auto" only where measured faster (`native_block_gemms`)
        native = recipe.block_lowering == "auto" and native_measured_faster(own, gpu_class(target))
    candidates = [COMPUTE] + ([own] if native else [])
    if own in _BLOCK:
        candidates.append("tensorwise")
    parts = {f: gemm_parts(f, m, k, n, c, target) for f in candidates}
    seconds = {f: sum(p.values()) for f, p in parts.items()}
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
    return GemmChoice(best, reason, seconds, parts)


def recipe_for_format(recipe: Fp8Recipe, fmt: str) -> Fp8Recipe:
    """`recipe` running `fmt` with no further choice (what the chosen GEMM runs with); a
    block-scaled `fmt` takes no margin (its scales come from each block's amax)."""
    margin = 0.0 if fmt in BLOCK_SCALINGS else recipe.margin
    return dataclasses.replace(recipe, scaling=fmt, choose="fixed", target=None, margin=margin)
