"""The calibrated cost model: each kernel's roofline time over its class's measured efficiency.

`kernel_class` sorts the kernels of an analysed program (`hlo_cost.analyze`) into the classes
of the calibration table (`mpjax._src.core.calibration.KERNEL_CLASSES`); `seconds_by_class`
sums their roofline seconds at a GPU's data-sheet peaks; `calibrated_seconds` divides each
class's sum by its efficiency on that GPU (`core.calibration.efficiency`: measured, or
`UNMEASURED_EFFICIENCY` for a class never measured there) and names the unmeasured classes
that the program spends time in.

`fit_efficiencies` derives the efficiencies from measured steps: for rows with a measured
step time `t` and modelled peak seconds per class `T[c]`, it solves
`t ~ sum_c T[c] / e[c]` for `1 / e[c] >= 1` (no class beats its peak) by bounded linear least
squares on the residuals relative to `t` (every row weighs the same, whatever its length).
A class whose peak seconds never reach `MIN_SHARE` of a row's modelled time is not
identifiable from the rows: it is left unmeasured (fixed at `UNMEASURED_EFFICIENCY`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from mpjax._src.analysis.decomposition import kernel_seconds
from mpjax._src.analysis.hlo_cost import HloReport, Kernel
from mpjax._src.analysis.peaks import PEAKS
from mpjax._src.core.calibration import (
    KERNEL_CLASSES,
    UNMEASURED_EFFICIENCY,
    efficiency,
)

__all__ = [
    "MIN_SHARE",
    "Calibrated",
    "calibrated_seconds",
    "fit_efficiencies",
    "kernel_class",
    "model_seconds",
    "seconds_by_class",
]

MIN_SHARE = 0.05  # a class is fitted only where it is this share of some row's peak time
_QUANTISE_NAMES = ("block_quantize", "quantize")


class Calibrated(NamedTuple):
    """A program's calibrated time on one GPU.

    Attributes:
      seconds: the calibrated time (each class's roofline seconds over its efficiency).
      peak_seconds: the uncalibrated roofline time (every kernel at its peaks).
      by_class: `{class: calibrated seconds}` for the classes the program runs.
      unmeasured: the classes it runs that no measurement calibrated on this GPU's class
        (costed at `UNMEASURED_EFFICIENCY`), sorted.
    """

    seconds: float
    peak_seconds: float
    by_class: dict
    unmeasured: tuple


def kernel_class(kernel: Kernel) -> str:
    """The calibration class (`core.calibration.KERNEL_CLASSES`) of one analysed kernel."""
    dtypes = {d for key in kernel.tensor_flops for d in key.split("x")}
    if "attention" in kernel.kind:
        return "attention"
    if "block-scaled" in kernel.kind:
        return "block-scaled gemm"
    if "pallas" in kernel.kind:
        if dtypes:
            return "pallas blockwise gemm"
        if any(n in kernel.op_name for n in _QUANTISE_NAMES):
            return "pallas block quantise"
        return "pallas kernel"
    if kernel.kind == "cudnn conv" or kernel.conv_flops:
        return "conv"
    if any(d.startswith("f8") for d in dtypes):
        return "fp8 gemm"
    if dtypes & {"f32", "f64"}:
        return "f32 gemm"
    if dtypes:
        return "bf16 gemm"
    return "fusion"


def seconds_by_class(report: HloReport, target: str = "h100") -> dict[str, float]:
    """Roofline seconds at `target`'s peaks (`analysis.peaks.PEAKS`) per kernel class.

    Args:
      report: `hlo_cost.analyze` of an optimized XLA:GPU HLO module.
      target: `"h100"`, `"h200"` or `"b200"`.

    Returns:
      `{class: seconds}` for the classes with kernels in `report`; the values sum to its
      roofline time on that GPU.
    """
    peaks = PEAKS[target]
    out: dict[str, float] = {}
    for kernel in report.kernels:
        cls = kernel_class(kernel)
        out[cls] = out.get(cls, 0.0) + kernel_seconds(kernel, peaks)
    return out


def model_seconds(
    by_class: Mapping[str, float], target: str, table: dict | None = None
) -> Calibrated:
    """The calibrated time of a program from its peak seconds per class (`seconds_by_class`).

    Args:
      by_class: `{class: roofline seconds at target's peaks}`.
      target: `"h100"`, `"h200"` or `"b200"` (its GPU class's efficiencies apply).
      table: a calibration table (default: the committed one).

    Returns:
      A `Calibrated`.
    """
    out, unmeasured = {}, []
    for cls, seconds in by_class.items():
        eff = efficiency(target, cls, table)
        out[cls] = seconds / eff.value
        if not eff.measured and seconds > 0:
            unmeasured.append(cls)
    return Calibrated(sum(out.values()), sum(by_class.values()), out, tuple(sorted(unmeasured)))


def calibrated_seconds(report: HloReport, target: str = "h100", table=None) -> Calibrated:
    """The calibrated time of an analysed program on `target`'s GPU.

    Args:
      report: `hlo_cost.analyze` of an optimized XLA:GPU HLO module.
      target: `"h100"`, `"h200"` or `"b200"`.
      table: a calibration table (default: the committed `core/calibration.json`).

    Returns:
      A `Calibrated`: the time, the uncalibrated roofline, per class, the unmeasured classes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.analysis.calibrated import calibrated_seconds
      >>> from mpjax._src.analysis.hlo_cost import analyze
      >>> text = jax.jit(lambda x: x @ x).trace(jnp.ones((64, 64))).lower().compile().as_text()
      >>> model = calibrated_seconds(analyze(text), "h100")
      >>> model.seconds >= model.peak_seconds
      True
    """
    return model_seconds(seconds_by_class(report, target), target, table)


def _joint_groups(a, classes: list) -> list[list]:
    """Classes the rows cannot tell apart (a null-space direction of the row matrix `a`
    touches them all: e.g. two kernels only ever measured in the same step), grouped; every
    other class alone."""
    import numpy as np

    _, sv, vt = np.linalg.svd(a)
    rank = int(np.sum(sv > 1e-9 * sv.max()))
    null = vt[rank:]
    groups = [[c] for c in classes]
    for direction in null:
        touched = {classes[i] for i in np.flatnonzero(np.abs(direction) > 1e-9)}
        merged = [c for g in groups if touched & set(g) for c in g]
        groups = [g for g in groups if not touched & set(g)] + [merged]
    order = {c: i for i, c in enumerate(classes)}
    return sorted((sorted(g, key=order.get) for g in groups), key=lambda g: order[g[0]])


def fit_efficiencies(
    rows: Sequence[tuple[float, Mapping[str, float]]],
) -> dict[str, tuple[float, tuple[str, ...]]]:
    """Efficiencies per class that best explain measured step times (module docstring).

    Classes the rows cannot tell apart (only ever measured together, in a fixed proportion)
    are fitted as one: they share one efficiency, and each names the others it was fitted
    with.

    Args:
      rows: `(measured seconds, {class: peak seconds on the measuring GPU})` per step.

    Returns:
      `{class: (efficiency in (0, 1], the classes fitted jointly with it)}` for the classes
      the rows identify (those reaching `MIN_SHARE` of some row's peak time); the others are
      absent (unmeasured).
    """
    import numpy as np
    from scipy.optimize import lsq_linear

    if not rows:
        raise ValueError("fit_efficiencies: rows is empty; pass measured steps")
    fitted = [
        c
        for c in KERNEL_CLASSES
        if any(r.get(c, 0.0) >= MIN_SHARE * sum(r.values()) for _, r in rows)
    ]
    if not fitted:
        return {}
    a = np.array([[r.get(c, 0.0) / t for c in fitted] for t, r in rows])
    groups = _joint_groups(a, fitted)
    a = np.array([[sum(r.get(c, 0.0) for c in g) / t for g in groups] for t, r in rows])
    fixed = [sum(s for c, s in r.items() if c not in fitted) for _, r in rows]
    b = np.array(
        [1.0 - f / UNMEASURED_EFFICIENCY / t for f, (t, _) in zip(fixed, rows, strict=True)]
    )
    sol = lsq_linear(a, b, bounds=(1.0, np.inf), method="bvls")
    out = {}
    for g, x in zip(groups, sol.x, strict=True):
        for c in g:
            out[c] = (float(1.0 / x), tuple(o for o in g if o != c))
    return out
