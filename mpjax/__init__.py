"""mpjax: mixed-precision training for JAX and Flax."""

from mpjax.policy import ConditionalFP32, OpLists, Policy, autocast, get_policy
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
    "ConditionalFP32",
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "OpLists",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "get_loss_scale",
    "get_policy",
    "loss_scaled",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
]
