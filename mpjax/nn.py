"""Layers and functions: `ConvBN` (conv + BatchNorm + activation fused for inference),
`dot_product_attention` (cuDNN flash attention on CUDA as a Flax `attention_fn`) and
`linear_cross_entropy` (a float32 loss without float32 logits)."""

from mpjax._src.core._linear_cross_entropy import linear_cross_entropy
from mpjax._src.flax.attention_fn import dot_product_attention
from mpjax._src.flax.conv_bn import ConvBN, nchw_to_nhwc

__all__ = ["ConvBN", "dot_product_attention", "linear_cross_entropy", "nchw_to_nhwc"]
