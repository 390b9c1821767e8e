"""mpjax: mixed-precision training for JAX and Flax."""

from mpjax import fp8, inference, nn, pallas, policy, scaling
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
    get_policy,
)
from mpjax.scaling import (
    DynamicLossScale,
    LossScale,
    LossScaledState,
    NoOpLossScale,
    StaticLossScale,
    TrainingDivergedError,
    all_finite,
    find_loss_scaled_state,
    get_loss_scale,
    loss_scaled,
    nonfinite_report,
    scale_loss,
    scaling_metrics,
    select_tree,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULTS",
    "ConditionalFP32",
    "Defaults",
    "NO_DEFAULTS",
    "DynamicLossScale",
    "FoldReport",
    "Fp8Recipe",
    "InferenceModel",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "OpLists",
    "Policy",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "apply_policy",
    "autocast",
    "convert_for_inference",
    "find_loss_scaled_state",
    "fp8",
    "get_loss_scale",
    "get_policy",
    "inference",
    "loss_scaled",
    "nn",
    "nonfinite_report",
    "pallas",
    "policy",
    "scale_loss",
    "scaling",
    "scaling_metrics",
    "select_tree",
]
