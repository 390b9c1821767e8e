"""Pallas GPU kernels (Triton backend) with interpret-mode and XLA fallbacks."""

from mpjax._src.kernels.dispatch import IMPLS, dispatch
from mpjax._src.kernels.epilogue import ACTIVATIONS, conv_epilogue, conv_epilogue_reference
from mpjax._src.kernels.stats import channel_stats, channel_stats_reference
from mpjax._src.kernels.unscale import (
    all_finite_unscaled,
    unscale_and_check,
    xla_all_finite_unscaled,
    xla_unscale_and_check,
)

__all__ = [
    "ACTIVATIONS",
    "all_finite_unscaled",
    "channel_stats",
    "channel_stats_reference",
    "conv_epilogue",
    "conv_epilogue_reference",
    "dispatch",
    "IMPLS",
    "unscale_and_check",
    "xla_all_finite_unscaled",
    "xla_unscale_and_check",
]
