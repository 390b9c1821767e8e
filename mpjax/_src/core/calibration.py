"""Measured kernel efficiencies by GPU class: the calibration table of the cost model.

The roofline cost model (`mpjax._src.analysis.hlo_cost`, `mpjax._src.fp8.choose`) times a
kernel at its GPU's data-sheet peaks. The table (`calibration.json`, next to this module)
holds what real GPUs measured instead: per GPU class (`"hopper"`: H100, H200; `"blackwell"`:
B200) and kernel class (`KERNEL_CLASSES`), the fraction of the roofline time's peak that the
kernels of that class reached, each entry with the GPU, the command and the date that
measured it. It is derived from the measured rows of `benchmarks/results-gpu.json` by
`mpjax._src.analysis.calibrated.fit_efficiencies` (run by `benchmarks/calibrate.py`), never
by hand.

A kernel class never measured on a GPU class is costed at `UNMEASURED_EFFICIENCY` of its
peak (pessimistic, never the peak) and `report` flags it. An efficiency measured on one GPU
of a class applies to the others as the same fraction of their own peaks (H100 and H200 are
one chip, GH100, with the same SMs and tensor-core peaks; the H200 has more HBM bandwidth,
so bandwidth-bound classes transfer as a fraction of each GPU's bandwidth).

The table also records, per GPU class and block-scaled recipe, the measured step ratio of
each lowering (`"native"`, `"emulated"`) against the bf16 step: `block_lowering="auto"`
picks a lowering of mpjax's own kernels natively only where a measurement says it is
faster (`native_measured_faster`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "GPU_CLASSES",
    "KERNEL_CLASSES",
    "TABLE_PATH",
    "UNMEASURED_EFFICIENCY",
    "Efficiency",
    "efficiency",
    "gpu_class",
    "gpu_class_of_capability",
    "load_table",
    "native_measured_faster",
]

TABLE_PATH = Path(__file__).resolve().parent / "calibration.json"

# The kernel classes of the calibrated model (`analysis.calibrated.kernel_class` sorts a
# compiled program's kernels into them).
KERNEL_CLASSES = (
    "bf16 gemm",  # XLA's GEMMs with 16-bit operands (cuBLAS / XLA's Triton GEMMs)
    "f32 gemm",  # XLA's float32 GEMMs (TF32 at XLA's default precision)
    "fp8 gemm",  # XLA's fp8 GEMMs (cuBLASLt)
    "attention",  # cuDNN fused attention
    "conv",  # cuDNN convolutions
    "block-scaled gemm",  # cuDNN block-scaled GEMMs (MXFP8, NVFP4)
    "pallas blockwise gemm",  # mpjax's Pallas blockwise fp8 GEMM
    "pallas block quantise",  # mpjax's Pallas fused block quantiser
    "pallas kernel",  # mpjax's other Pallas kernels (unscale_and_check, conv_epilogue, ...)
    "fusion",  # XLA's other kernels: bandwidth-bound fusions, copies, reductions
)

# The GPU targets of the cost model by class (a measurement on one applies to the class).
GPU_CLASSES = {"h100": "hopper", "h200": "hopper", "b200": "blackwell"}

# An unmeasured kernel class runs at 0.3 of its roofline peak: below every efficiency
# measured for a library or XLA kernel class on the H200 (`calibration.json`: the lowest,
# cuDNN attention, 0.34; `tests/analysis/test_calibration.py` checks it stays below), so an
# unmeasured kernel is never credited with more than a measured one of XLA's or a library's.
# The one mpjax Pallas kernel measured ran at about half of even this (0.16), which is why
# such a class is also flagged in `report` rather than trusted.
UNMEASURED_EFFICIENCY = 0.3


class Efficiency(NamedTuple):
    """A kernel class's efficiency on a GPU class.

    Attributes:
      value: the fraction of the roofline peak its kernels reach (time = roofline / value).
      measured: whether a measurement gave it (else `UNMEASURED_EFFICIENCY`).
      source: the GPU, command and date that measured it, or why it is unmeasured.
    """

    value: float
    measured: bool
    source: str


@functools.cache
def load_table(path: str | None = None) -> dict:
    """The calibration table (`calibration.json`, or the JSON file at `path`)."""
    return json.loads(Path(path or TABLE_PATH).read_text())


def gpu_class(target: str) -> str:
    """The GPU class of a cost-model target (`"h100"` -> `"hopper"`); raises for others."""
    if target not in GPU_CLASSES:
        raise ValueError(
            f"calibration: target={target!r} is not a GPU the cost model knows; pass one of "
            f"{sorted(GPU_CLASSES)}"
        )
    return GPU_CLASSES[target]


def gpu_class_of_capability(capability: float) -> str | None:
    """The GPU class of a CUDA compute capability (9.x Hopper, 10+ Blackwell), else None."""
    if capability >= 10:
        return "blackwell"
    if capability >= 9:
        return "hopper"
    return None


def efficiency(target: str, kernel_class: str, table: dict | None = None) -> Efficiency:
    """The measured efficiency of `kernel_class` on `target`'s GPU class.

    Args:
      target: a key of `GPU_CLASSES` (`"h100"`, `"h200"`, `"b200"`).
      kernel_class: one of `KERNEL_CLASSES`.
      table: a calibration table (default: the committed `calibration.json`).

    Returns:
      An `Efficiency`; `UNMEASURED_EFFICIENCY` (`measured=False`) where the table has none.

    Example:
      >>> from mpjax._src.core.calibration import efficiency
      >>> efficiency("b200", "pallas kernel").measured
      False
    """
    if kernel_class not in KERNEL_CLASSES:
        raise ValueError(
            f"calibration: kernel_class={kernel_class!r} is not one of {KERNEL_CLASSES}"
        )
    table = load_table() if table is None else table
    cls = gpu_class(target)
    entry = table.get("entries", {}).get(cls, {}).get(kernel_class)
    if not entry:
        why = f"unmeasured on {cls}: costed at {UNMEASURED_EFFICIENCY} of its peak"
        return Efficiency(UNMEASURED_EFFICIENCY, False, why)
    source = f"{entry['gpu']}, {entry['date']}: {entry['command']}"
    return Efficiency(float(entry["efficiency"]), True, source)


def native_measured_faster(scaling: str, cls: str | None, table: dict | None = None) -> bool:
    """Whether a measurement on GPU class `cls` says `scaling`'s native lowering is faster.

    Native is faster where its measured step ratio (against bf16) is below the emulated
    lowering's measured ratio, or, the emulated lowering unmeasured, below 1 (the emulated
    lowering runs bf16 GEMMs plus dequantisation, so it cannot beat the bf16 step).
    Unmeasured native lowerings are not faster.

    Args:
      scaling: a block-scaled recipe (`"blockwise"`, `"mxfp8"`, `"nvfp4"`).
      cls: a GPU class (`"hopper"`, `"blackwell"`) or None (no GPU: False).
      table: a calibration table (default: the committed one).

    Returns:
      True if native was measured faster.
    """
    if cls is None:
        return False
    table = load_table() if table is None else table
    lowerings = table.get("lowerings", {}).get(cls, {}).get(scaling, {})
    native = (lowerings.get("native") or {}).get("ratio")
    emulated = (lowerings.get("emulated") or {}).get("ratio")
    if native is None:
        return False
    return native < (1.0 if emulated is None else emulated)
