"""Loss scales and the `loss_scaled` optax wrapper."""

from mpjax.scaling.diagnostics import NonfiniteReport, TrainingDivergedError, nonfinite_report
from mpjax.scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
    unscale_tree,
)
from mpjax.scaling.loss_scaled import LossScaledState, loss_scaled, xla_unscale_and_check
from mpjax.scaling.model_state import (
    StateSnapshot,
    keep_if_skipped,
    restore_if_skipped,
    snapshot_state,
)
from mpjax.scaling.state_helpers import (
    find_loss_scaled_state,
    get_loss_scale,
    scale_loss,
    scaling_metrics,
)

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "NonfiniteReport",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "find_loss_scaled_state",
    "get_loss_scale",
    "keep_if_skipped",
    "loss_scaled",
    "nonfinite_report",
    "restore_if_skipped",
    "snapshot_state",
    "StateSnapshot",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
    "unscale_tree",
    "xla_unscale_and_check",
]
