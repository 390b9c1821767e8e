"""Where a step's roofline time goes: low-precision GEMMs, other GEMMs, quantisation passes.

`decompose(report, peaks)` sorts each kernel of an analysed program (`hlo_cost.analyze`)
into one part, first match wins, and sums the parts' roofline seconds on `peaks`' GPU:

- `"low-precision gemms"`: GEMMs with 8-bit or 4-bit operands (fp8, MXFP8, NVFP4, blockwise);
- `"other gemms"`: every other GEMM, convolution and attention kernel;
- `"quantise"`: a kernel that writes an 8-bit or 4-bit array (or a Pallas kernel that runs
  under a quantise call's name);
- `"transpose"`: a kernel that transposes (a fused transpose, or a standalone layout copy);
- `"amax"`: a kernel that runs a max reduction;
- `"other"`: the rest (normalisation, activations, the loss, optimizer updates...).

A bf16 step has transposes and max reductions of its own (the loss's max over the logits):
compare a recipe's parts with its bf16 anchor's.
"""

from __future__ import annotations

from mpjax._src.analysis.hlo_cost import HloReport, Kernel
from mpjax._src.analysis.peaks import H100, Peaks

__all__ = ["PARTS", "decompose", "kernel_seconds", "part_of"]

PARTS = ("low-precision gemms", "other gemms", "quantise", "transpose", "amax", "other")
_LOW = ("f8", "f4", "u8")  # u8: packed 4-bit elements or E8M0 scales written by a kernel
_QUANTISE_NAMES = ("block_quantize", "quantize")


def kernel_seconds(kernel: Kernel, peaks: Peaks = H100) -> float:
    """One kernel's roofline seconds on `peaks`' GPU (as `peaks.roofline_seconds` sums)."""
    compute = kernel.other_flops / peaks.vector_flops
    for key, flops in kernel.tensor_flops.items():
        rate = min(peaks.tensor_flops.get(d, peaks.vector_flops) for d in key.split("x"))
        compute += flops / rate
    return max(compute, kernel.bytes / peaks.hbm_bytes_per_s)


def part_of(kernel: Kernel) -> str:
    """The part of `PARTS` that `kernel` belongs to."""
    if kernel.tensor_flops:
        low = any(d.startswith(_LOW[:2]) for key in kernel.tensor_flops for d in key.split("x"))
        return "low-precision gemms" if low else "other gemms"
    if "attention" in kernel.kind:
        return "other gemms"
    writes_low = any(d.startswith(_LOW[:2]) for d in kernel.results)
    named = "pallas" in kernel.kind and any(n in kernel.op_name for n in _QUANTISE_NAMES)
    if writes_low or named:
        return "quantise"
    if "transpose" in kernel.features or kernel.kind == "copy":
        return "transpose"
    if "reduce-max" in kernel.features:
        return "amax"
    return "other"


def decompose(report: HloReport, peaks: Peaks = H100) -> dict[str, float]:
    """Roofline seconds per part of `PARTS` of an analysed program on `peaks`' GPU.

    Args:
      report: `hlo_cost.analyze` of an optimized XLA:GPU HLO module.
      peaks: the GPU (`peaks.H100`, `peaks.B200`).

    Returns:
      `{part: seconds}` for every part of `PARTS`; the values sum to
      `roofline_seconds(report, peaks)`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.analysis.decomposition import decompose
      >>> from mpjax._src.analysis.hlo_cost import analyze
      >>> text = jax.jit(lambda x: (x @ x).T).trace(jnp.ones((64, 64))).lower().compile().as_text()
      >>> sorted(k for k, v in decompose(analyze(text)).items() if v > 0)
      ['other gemms']
    """
    out = dict.fromkeys(PARTS, 0.0)
    for kernel in report.kernels:
        out[part_of(kernel)] += kernel_seconds(kernel, peaks)
    return out
