"""mpjax: mixed-precision training for JAX and Flax."""

from mpjax import policy, scaling
from mpjax.policy import Policy, get_policy
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
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "find_loss_scaled_state",
    "get_loss_scale",
    "get_policy",
    "loss_scaled",
    "nonfinite_report",
    "policy",
    "scale_loss",
    "scaling",
    "scaling_metrics",
    "select_tree",
]
