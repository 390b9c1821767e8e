"""Pallas GPU kernels (Triton backend) with interpret-mode and XLA fallbacks."""

from mpjax.pallas.dispatch import IMPLS, dispatch
from mpjax.pallas.epilogue import ACTIVATIONS, conv_epilogue, conv_epilogue_reference
from mpjax.pallas.stats import channel_stats, channel_stats_reference
from mpjax.pallas.unscale import (
    all_finite_unscaled,
    unscale_and_check,
    xla_all_finite_unscaled,
    xla_unscale_and_check,
)

__all__ = [
    "ACTIVATIONS",
    "IMPLS",
    "all_finite_unscaled",
    "channel_stats",
    "channel_stats_reference",
    "conv_epilogue",
    "conv_epilogue_reference",
    "dispatch",
    "unscale_and_check",
    "xla_all_finite_unscaled",
    "xla_unscale_and_check",
]
