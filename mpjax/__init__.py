"""mpjax: mixed-precision training for JAX and Flax."""

from mpjax.policy import DEFAULTS, NO_DEFAULTS, Defaults, Policy, apply_policy, get_policy
from mpjax.scaling import (
    DynamicLossScale,
    LossScale,
    LossScaledState,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    get_loss_scale,
    loss_scaled,
    scale_loss,
    scaling_metrics,
    select_tree,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULTS",
    "Defaults",
    "NO_DEFAULTS",
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "apply_policy",
    "get_loss_scale",
    "get_policy",
    "loss_scaled",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
]
