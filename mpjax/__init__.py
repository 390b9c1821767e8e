"""mpjax: mixed-precision training for JAX and Flax.

The public API is this module and its submodules `mpjax.policy`, `mpjax.scaling`, `mpjax.fp8`,
`mpjax.pallas`, `mpjax.nn`, `mpjax.inference` and `mpjax.export`; everything under
`mpjax._src` is private and may move between releases.
"""

from mpjax import fp8, inference, nn, pallas, policy, scaling
from mpjax._src.flax import serialization as _serialization  # noqa: F401 (registers checkpoints)
from mpjax._src.flax.remat_ladder import MEMORY_LADDER, MemoryRung
from mpjax._src.report.build import report
from mpjax._src.report.memory_plan import MemoryCandidate, MemoryPlan, memory_plan
from mpjax._src.report.numerics import numerics
from mpjax.fp8 import Fp8Recipe
from mpjax.inference import FoldReport, InferenceModel, convert_for_inference
from mpjax.policy import (
    DEFAULTS,
    NO_DEFAULTS,
    ConditionalFP32,
    Defaults,
    OpLists,
    Policy,
    apply_policy,
    autocast,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from mpjax.scaling import (
    DynamicLossScale,
    LossScale,
    LossScaledState,
    NoOpLossScale,
    StaticLossScale,
    TrainingDivergedError,
    all_finite,
    default_max_consecutive_skips,
    find_loss_scaled_state,
    get_loss_scale,
    keep_if_skipped,
    loss_scale_for,
    loss_scale_from_flax,
    loss_scaled,
    low_precision_state,
    master_params,
    nonfinite_report,
    raise_if_diverged,
    restore_if_skipped,
    scale_loss,
    scaling_metrics,
    select_tree,
    snapshot_state,
    upgrade_state,
    with_loss_scale,
    with_master_weights,
)

__version__ = "0.1.0"

__all__ = [
    "ConditionalFP32",
    "DEFAULTS",
    "Defaults",
    "DynamicLossScale",
    "FoldReport",
    "Fp8Recipe",
    "InferenceModel",
    "LossScale",
    "LossScaledState",
    "MEMORY_LADDER",
    "MemoryCandidate",
    "MemoryPlan",
    "MemoryRung",
    "NO_DEFAULTS",
    "NoOpLossScale",
    "OpLists",
    "Policy",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "apply_policy",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "convert_for_inference",
    "default_max_consecutive_skips",
    "find_loss_scaled_state",
    "fp8",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "inference",
    "keep_if_skipped",
    "loss_scale_for",
    "loss_scale_from_flax",
    "loss_scaled",
    "low_precision_state",
    "master_params",
    "memory_plan",
    "nn",
    "nonfinite_report",
    "numerics",
    "pallas",
    "policy",
    "raise_if_diverged",
    "report",
    "restore_if_skipped",
    "scale_loss",
    "scaling",
    "scaling_metrics",
    "select_tree",
    "snapshot_state",
    "upgrade_state",
    "with_loss_scale",
    "with_master_weights",
]
