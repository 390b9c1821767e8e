"""Loss scales and the `loss_scaled` optax wrapper."""

# config-driven precision, dead-run threshold, Flax DynamicScale migration
from mpjax.nnx_model_state import StateSnapshot, restore_if_skipped, snapshot_state
from mpjax.scaling.config import default_max_consecutive_skips, loss_scale_for
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
from mpjax.scaling.migrate import loss_scale_from_flax, with_loss_scale
from mpjax.scaling.model_state import keep_if_skipped
from mpjax.scaling.state_helpers import (
    find_loss_scaled_state,
    get_loss_scale,
    raise_if_diverged,
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
    "raise_if_diverged",
    "restore_if_skipped",
    "snapshot_state",
    "StateSnapshot",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
    "unscale_tree",
    "xla_unscale_and_check",
    # config-driven precision, dead-run threshold, Flax DynamicScale migration
    "default_max_consecutive_skips",
    "loss_scale_for",
    "loss_scale_from_flax",
    "with_loss_scale",
]
