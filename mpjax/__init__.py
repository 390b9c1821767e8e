"""mpjax: mixed-precision training for JAX and Flax."""

from mpjax import nn, pallas
from mpjax.policy import Policy, get_policy
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
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "get_loss_scale",
    "get_policy",
    "loss_scaled",
    "nn",
    "pallas",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
]
