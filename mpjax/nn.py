"""Flax layers: `ConvBN`, a convolution with BatchNorm and activation fused for inference."""

from mpjax._src.flax.conv_bn import ConvBN, nchw_to_nhwc

__all__ = ["ConvBN", "nchw_to_nhwc"]
