"""`mpjax.nn.dot_product_attention`: a Flax `attention_fn` that is cuDNN flash attention on CUDA."""

from __future__ import annotations

from flax import nnx
from mpjax._src.flax.fused_attention import fused_or
from mpjax._src.flax.linen_attention import float32_softmax_attention as linen_float32_softmax
from mpjax._src.flax.nnx_attention import float32_softmax_attention as nnx_float32_softmax

__all__ = ["dot_product_attention"]

_NNX_ONLY = ("promote_dtype", "is_causal")


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    **kwargs,
):
    """A Flax `attention_fn` that is cuDNN flash attention on CUDA (float32 softmax inside).

    Same arguments and result as `flax.linen.dot_product_attention` /
    `flax.nnx.dot_product_attention`. On CUDA, for fp16/bf16 operands (or float32 ones under
    a 16-bit `mpjax.autocast`), without active dropout or a `module` to sow the weights into,
    with `[batch, length, heads, depth]` operands of depth <= 128 (a multiple of 8), it runs
    `jax.nn.dot_product_attention(..., implementation="cudnn")` (a boolean or 0/1 mask, and a
    bias, become cuDNN's bias); otherwise mpjax's float32-softmax attention (GEMMs on the
    input dtype, softmax in float32). The result is in the operands' (promoted) dtype.

    Args:
      query: `[batch..., q_length, heads, depth]`.
      key: `[batch..., kv_length, kv_heads, depth]` (kv_heads divides heads).
      value: as `key`.
      bias: added to the logits, broadcastable to `[batch, heads, q_length, kv_length]`.
      mask: nonzero/True where attention is allowed, broadcastable as `bias`.
      broadcast_dropout: as Flax's.
      dropout_rng: as Flax's.
      dropout_rate: as Flax's (above 0 and not `deterministic`: the XLA form).
      deterministic: as Flax's.
      dtype: the computation dtype (None: promoted from the operands).
      precision: as Flax's (the XLA form's GEMM precision).
      module: a module to sow the weights into (given: the XLA form).
      **kwargs: Flax's other attention arguments (`is_causal`, `promote_dtype`, ...).

    Returns:
      `[batch..., q_length, heads, v_depth]`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import mpjax
      >>> layer = nn.MultiHeadDotProductAttention(2, attention_fn=mpjax.nn.dot_product_attention)
      >>> x = jnp.ones((1, 4, 8), jnp.bfloat16)
      >>> y, _ = layer.init_with_output(jax.random.key(0), x)
      >>> y.shape
      (1, 4, 8)
    """
    nnx_call = isinstance(module, nnx.Module) or any(name in kwargs for name in _NNX_ONLY)
    fallback = nnx_float32_softmax if nnx_call else linen_float32_softmax
    return fused_or(
        fallback,
        query,
        key,
        value,
        bias,
        mask,
        broadcast_dropout,
        dropout_rng,
        dropout_rate,
        deterministic,
        dtype,
        precision,
        module,
        **kwargs,
    )
