"""Layers and losses: `ConvBN` (a convolution with BatchNorm and activation fused for
inference) and `linear_cross_entropy` (a float32 loss without float32 logits)."""

from mpjax._src.core._linear_cross_entropy import linear_cross_entropy
from mpjax._src.flax.conv_bn import ConvBN, nchw_to_nhwc

__all__ = ["ConvBN", "linear_cross_entropy", "nchw_to_nhwc"]
