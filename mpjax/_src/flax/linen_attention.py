"""`float32_softmax_attention`: Flax's dot-product attention with the softmax in float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import flax.linen as nn
from flax.linen.dtypes import promote_dtype


def float32_softmax_attention(
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
    force_fp32_for_softmax: bool = True,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
):
    """`flax.linen.dot_product_attention` with the softmax in float32.

    Same signature and result as Flax's; the attention weights are computed with
    `force_fp32_for_softmax=True` and cast back to the value dtype before the second
    matmul (Flax's own flag leaves them in float32, which promotes that matmul to
    float32).

    Returns:
      Output of shape `[batch..., q_length, num_heads, v_depth_per_head]`.
    """
    del force_fp32_for_softmax
    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    weights = nn.dot_product_attention_weights(
        query,
        key,
        bias,
        mask,
        broadcast_dropout,
        dropout_rng,
        dropout_rate,
        deterministic,
        query.dtype,
        precision,
        module,
        force_fp32_for_softmax=True,
        einsum_dot_general=einsum_dot_general,
        einsum=qk_attn_weights_einsum,
    )
    weights = weights.astype(value.dtype)
    if attn_weights_value_einsum is None:
        attn_weights_value_einsum = functools.partial(
            jnp.einsum,
            precision=precision,
            _dot_general=einsum_dot_general or jax.lax.dot_general,
        )
    return attn_weights_value_einsum("...hqk,...khd->...qhd", weights, value)
