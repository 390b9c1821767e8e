"""Loss scales and the `loss_scaled` optax wrapper."""

from mpjax._src.flax.model_state import (
    StateSnapshot,
    keep_if_skipped,
    restore_if_skipped,
    snapshot_state,
)
from mpjax._src.flax.upgrade import upgrade_state
from mpjax._src.scaling.blockwise8 import Blockwise8
from mpjax._src.scaling.config import default_max_consecutive_skips, loss_scale_for
from mpjax._src.scaling.diagnostics import NonfiniteReport, TrainingDivergedError, nonfinite_report
from mpjax._src.scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
    unscale_tree,
)
from mpjax._src.scaling.loss_scaled import LossScaledState, loss_scaled
from mpjax._src.scaling.low_precision import LowPrecisionState, low_precision_state
from mpjax._src.scaling.migrate import loss_scale_from_flax, with_loss_scale, with_master_weights
from mpjax._src.scaling.state_helpers import (
    find_loss_scaled_state,
    get_loss_scale,
    master_params,
    raise_if_diverged,
    scale_loss,
    scaling_metrics,
)

__all__ = [
    "Blockwise8",
    "DynamicLossScale",
    "LossScale",
    "LossScaledState",
    "LowPrecisionState",
    "NoOpLossScale",
    "NonfiniteReport",
    "StateSnapshot",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "default_max_consecutive_skips",
    "find_loss_scaled_state",
    "get_loss_scale",
    "keep_if_skipped",
    "loss_scale_for",
    "loss_scale_from_flax",
    "loss_scaled",
    "low_precision_state",
    "master_params",
    "nonfinite_report",
    "raise_if_diverged",
    "restore_if_skipped",
    "scale_loss",
    "scaling_metrics",
    "select_tree",
    "snapshot_state",
    "unscale_tree",
    "upgrade_state",
    "with_loss_scale",
    "with_master_weights",
]


def __getattr__(name: str):
    # Exported once, from `mpjax.pallas`; the old spelling keeps working with a warning.
    if name == "xla_unscale_and_check":
        import warnings

        from mpjax._src.kernels.unscale import xla_unscale_and_check

        warnings.warn(
            "mpjax.scaling.xla_unscale_and_check moved: use mpjax.pallas.xla_unscale_and_check",
            DeprecationWarning,
            stacklevel=2,
        )
        return xla_unscale_and_check
    raise AttributeError(f"module 'mpjax.scaling' has no attribute {name!r}")
