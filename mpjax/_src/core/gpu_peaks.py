"""Data-sheet dense peaks of the GPUs mpjax plans for (H100 SXM, H200, B200), by operand format.

The lowest layer holds them so that the fp8 layer (choosing a GEMM's format) and the
analysis layer (timing compiled programs) can share one set of numbers.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["GPU_PEAKS", "GpuPeaks"]


class GpuPeaks(NamedTuple):
    """A GPU's dense tensor-core peaks and memory bandwidth.

    Attributes:
      name: the GPU.
      tensor_flops: FLOP/s by operand format (`"bf16"`, `"fp8"`, `"fp4"`).
      hbm_bytes_per_s: memory bandwidth.
      block_formats: the block-scaled recipes mpjax runs natively on it (tensor cores that
        take block scales, or fp8 GEMMs promoted per block: blockwise).
    """

    name: str
    tensor_flops: dict
    hbm_bytes_per_s: float
    block_formats: tuple[str, ...]


GPU_PEAKS = {
    # H100 SXM: bf16 989 TFLOP/s, fp8 1979, HBM3 3.35 TB/s; no block-scaled tensor cores
    # (blockwise: fp8 GEMMs promoted per K block, mpjax's Pallas kernel).
    "h100": GpuPeaks("H100 SXM", {"bf16": 989e12, "fp8": 1979e12}, 3.35e12, ("blockwise",)),
    # H200: the H100's chip (same tensor-core peaks) with HBM3e at 4.8 TB/s.
    "h200": GpuPeaks("H200", {"bf16": 989e12, "fp8": 1979e12}, 4.8e12, ("blockwise",)),
    # B200: bf16 2.25 PFLOP/s, fp8 4.5, fp4 9.0, HBM3e 8 TB/s; MXFP8 and NVFP4 natively.
    "b200": GpuPeaks(
        "B200",
        {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9.0e15},
        8.0e12,
        ("mxfp8", "nvfp4", "blockwise"),
    ),
}
