"""Flax layers and functions: `ConvBN` (conv + BatchNorm + activation fused for inference) and
`dot_product_attention` (cuDNN flash attention on CUDA as a Flax `attention_fn`)."""

from mpjax._src.flax.attention_fn import dot_product_attention
from mpjax._src.flax.conv_bn import ConvBN, nchw_to_nhwc

__all__ = ["ConvBN", "dot_product_attention", "nchw_to_nhwc"]
