"""NNX attention with the softmax in float32 and both GEMMs in the input dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

__all__ = ["float32_softmax_attention", "repeat_kv_heads"]


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
    promote_dtype=nnx_dtypes.promote_dtype,
    is_causal: bool = False,
):
    """`flax.nnx.dot_product_attention` with the softmax in float32 and low-precision GEMMs.

    Same signature and result as Flax's (within the compute dtype's rounding). The logits
    are a GEMM on the input-dtype operands, cast to float32 (or wider) for the scaling,
    bias, masks and softmax, and the weights are cast back to the input dtype before the
    second GEMM, so both GEMMs and their gradients run on input-dtype (e.g. bfloat16)
    operands. (`jax.nn.dot_product_attention`, which Flax calls without dropout, forms
    float32 logits from the GEMM itself, so its backward GEMMs take a float32 cotangent.)
    Masked logits are set to the float32 minimum: a fully masked row attends uniformly.
    Key/value heads may divide the query heads (grouped-query attention).

    `module` (the attention module, when called with `sow_weights=True`) sows the float32
    weights as Flax's function does: into `nnx.capture(nnx.Intermediate)` without a warning;
    outside a capture, flax >= 0.12.8 deprecates `Module.sow` (its DeprecationWarning).

    Returns:
      Output of shape `[batch..., q_length, num_heads, v_depth_per_head]`.
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    dtype = query.dtype
    key, value = repeat_kv_heads(query, key, value)
    softmax_dtype = jnp.promote_types(dtype, jnp.float32)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    # The cast (not the GEMM's result type) widens: the gradient GEMMs stay in `dtype`.
    logits = logits.astype(softmax_dtype) / jnp.sqrt(query.shape[-1]).astype(softmax_dtype)
    if bias is not None:
        logits = (logits + bias).astype(softmax_dtype)
    masks = [] if mask is None else [mask]
    if is_causal:
        t, s = logits.shape[-2:]
        masks.append(jnp.tril(jnp.ones((t, s), dtype=jnp.bool_)))
    if masks:
        keep = functools.reduce(jnp.logical_and, [jnp.asarray(m, jnp.bool_) for m in masks])
        logits = jnp.where(keep, logits, jnp.finfo(softmax_dtype).min)
    weights = jax.nn.softmax(logits)
    if module is not None:
        module.sow(nnx.Intermediate, "attention_weights", weights)
    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        shape = (
            (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        )
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(weights.dtype) / keep_prob)
    weights = weights.astype(dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def repeat_kv_heads(query, key, value):
    """Key and value with their heads repeated up to the query's (grouped-query attention).

    Query head `n` attends with key/value head `n // (heads // kv_heads)`, as in
    `jax.nn.dot_product_attention`.

    Args:
      query: `[batch..., q_length, heads, depth]`.
      key: `[batch..., kv_length, kv_heads, depth]`, `kv_heads` dividing `heads`.
      value: as `key` (its depth may differ).

    Returns:
      `(key, value)` with `heads` heads (unchanged when the heads already match).

    Raises:
      ValueError: naming the shapes, for ranks, lengths, depths or heads that do not fit.
    """
    _check_qkv(query, key, value)
    if query.shape[-2] == key.shape[-2]:
        return key, value
    reps = query.shape[-2] // key.shape[-2]
    return jnp.repeat(key, reps, axis=-2), jnp.repeat(value, reps, axis=-2)


def _check_qkv(query, key, value) -> None:
    """Raises a ValueError naming the mismatch of attention `query`, `key`, `value` shapes."""
    if not query.ndim == key.ndim == value.ndim or query.ndim < 3:
        raise ValueError(
            "query, key and value must have the same rank >= 3 ([batch..., length, heads, "
            f"depth]); got shapes {query.shape}, {key.shape}, {value.shape}"
        )
    if key.shape[-3] != value.shape[-3] or key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length and heads; got {key.shape}, {value.shape}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key depths differ: query {query.shape}, key {key.shape}")
    if query.shape[-2] % key.shape[-2]:
        raise ValueError(
            f"query heads ({query.shape[-2]}) must be a multiple of key/value heads "
            f"({key.shape[-2]})"
        )
