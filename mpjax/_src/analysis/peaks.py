"""Data-sheet peaks of a GPU and the roofline time of an analysed program on it.

`hlo_cost.analyze` times kernels with the H100's peaks; `roofline_seconds(report, B200)`
re-times the same kernels on another GPU (tensor FLOPs by operand dtype, vector FLOPs and
bytes per kernel, no overlap between kernels), e.g. a program compiled for the deviceless
B200 target.
"""

from __future__ import annotations

from typing import NamedTuple

from mpjax._src.analysis.hlo_cost import HBM_BYTES_PER_S, PEAK_FLOPS, PEAK_VECTOR, HloReport
from mpjax._src.core.gpu_peaks import GPU_PEAKS

__all__ = ["B200", "H100", "H200", "PEAKS", "Peaks", "roofline_seconds"]


class Peaks(NamedTuple):
    """A GPU's dense peaks.

    Attributes:
      name: the GPU.
      tensor_flops: tensor-core FLOP/s by HLO operand dtype (`"bf16"`, `"f8e4m3fn"`, ...).
      vector_flops: float32 FLOP/s off the tensor cores.
      hbm_bytes_per_s: memory bandwidth.
    """

    name: str
    tensor_flops: dict
    vector_flops: float
    hbm_bytes_per_s: float


H100 = Peaks("H100 SXM", dict(PEAK_FLOPS), PEAK_VECTOR, HBM_BYTES_PER_S)
# The B200's dense data-sheet peaks (`core.gpu_peaks`, shared with the fp8 layer's per-GEMM
# choice) by HLO operand dtype; block-scaled GEMMs are keyed by their element dtype
# (MXFP8: f8e4m3fn, NVFP4: f4e2m1fn). TF32 1.1 PFLOP/s, float64 40 TFLOP/s, vector 80.
# The H200: the H100's tensor and vector peaks, HBM3e at 4.8 TB/s.
H200 = H100._replace(name=GPU_PEAKS["h200"].name, hbm_bytes_per_s=GPU_PEAKS["h200"].hbm_bytes_per_s)
_B200 = GPU_PEAKS["b200"]
B200 = Peaks(
    _B200.name,
    {
        "f4e2m1fn": _B200.tensor_flops["fp4"],
        "f8e4m3fn": _B200.tensor_flops["fp8"],
        "f8e5m2": _B200.tensor_flops["fp8"],
        "bf16": _B200.tensor_flops["bf16"],
        "f16": _B200.tensor_flops["bf16"],
        "f32": 1.1e15,
        "f64": 40e12,
    },
    80e12,
    _B200.hbm_bytes_per_s,
)

PEAKS = {"h100": H100, "h200": H200, "b200": B200}  # by cost-model target


def roofline_seconds(report: HloReport, peaks: Peaks = H100) -> float:
    """The summed per-kernel roofline time of `report`'s kernels on `peaks`' GPU.

    Args:
      report: `hlo_cost.analyze` of an optimized HLO module.
      peaks: the GPU (`H100` gives `report.roofline_s` back).

    Returns:
      Seconds: per kernel `max(tensor FLOPs / peak(dtype) + vector FLOPs / vector peak,
      bytes / bandwidth)`, summed.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.analysis.hlo_cost import analyze
      >>> from mpjax._src.analysis.peaks import B200, H100, roofline_seconds
      >>> text = jax.jit(lambda x: x @ x).trace(jnp.ones((64, 64))).lower().compile().as_text()
      >>> report = analyze(text)
      >>> roofline_seconds(report, H100) == report.roofline_s
      True
    """
    total = 0.0
    for kernel in report.kernels:
        compute = kernel.other_flops / peaks.vector_flops
        for key, flops in kernel.tensor_flops.items():
            rate = min(peaks.tensor_flops.get(d, peaks.vector_flops) for d in key.split("x"))
            compute += flops / rate
        total += max(compute, kernel.bytes / peaks.hbm_bytes_per_s)
    return total
