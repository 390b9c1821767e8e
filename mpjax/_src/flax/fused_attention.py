"""cuDNN's fused (flash) attention on CUDA for Flax attention functions, with a fallback.

`fused_or(fallback, ...)` takes Flax's `attention_fn` arguments: on CUDA, for fp16/bf16
operands (or float32 ones traced under a 16-bit `mpjax.autocast`), no active dropout and no
attention weights to sow, it is
`jax.nn.dot_product_attention(..., implementation="cudnn")`: one fused kernel forward and one
backward, no `[batch, heads, T, S]` buffer, the softmax statistics kept in float32 inside the
kernel. Elsewhere (other platforms, dropout, sown weights, custom einsums, shapes cuDNN does not
take) it is mpjax's float32-softmax attention (both GEMMs on the input dtype, the softmax in
float32). The platform is chosen where the program is lowered (`jax.lax.platform_dependent`),
so a program compiled for a GPU gets the kernel whatever machine traced it. `apply_policy`
runs Flax's default attention of its `float32_softmax_modules` this way, and
`mpjax.nn.dot_product_attention` (`mpjax._src.flax.attention_fn`) is it as an `attention_fn`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.autocast.attention import attention_dtype
from mpjax._src.flax.nnx_attention import repeat_kv_heads

__all__ = ["fused_or"]

_NARROW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_CUSTOM_GEMMS = ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")
MAX_HEAD_DIM = 128  # cuDNN flash attention's head dimension (a multiple of 8)


def _cudnn_found() -> bool:
    from jax._src.cudnn import fused_attention_stablehlo as fa

    try:
        fa.check_cudnn_version()
    except RuntimeError:  # no CUDA plugin or no cuDNN library
        return False
    return True


def _run_dtype(query, key, value, dtype) -> Any:
    """The dtype cuDNN would run in (fp16/bf16), or None."""
    wanted = np.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
    return wanted if wanted in _NARROW else attention_dtype(wanted)


def _fits(query, key, value, bias, mask) -> bool:
    """Whether the shapes are ones cuDNN's flash attention takes (`[B, T, N, H]`)."""
    if not query.ndim == key.ndim == value.ndim == 4:
        return False
    b, _, n, h = query.shape
    if h % 8 or h > MAX_HEAD_DIM or key.shape[-1] != h or value.shape[-1] != h:
        return False
    for extra in (bias, mask):
        if extra is None:
            continue
        shape = jnp.shape(extra)
        if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, n):
            return False
    return True


def fused_or(
    fallback,
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
    is_causal: bool = False,
    **kwargs,
):
    """cuDNN fused attention on CUDA where it applies, else `fallback` (same arguments).

    Returns:
      `[batch, q_length, heads, v_depth]` in the run dtype.
    """
    call = dict(
        broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        precision=precision,
        module=module,
        **kwargs,
    )
    if is_causal:
        call["is_causal"] = is_causal
    run = _run_dtype(query, key, value, dtype)
    dropout = dropout_rate > 0.0 and not deterministic
    custom = any(kwargs.get(name) is not None for name in _CUSTOM_GEMMS)
    eligible = run is not None and not dropout and module is None and not custom

    def grouped(query, key, value, dtype):
        # Flax's linen attention takes equal heads only: grouped-query key/value heads are
        # repeated up to the query's (cuDNN takes them as they are).
        key, value = repeat_kv_heads(query, key, value)
        return fallback(query, key, value, bias, mask, dtype=dtype, **call)

    if not (eligible and _fits(query, key, value, bias, mask) and _cudnn_found()):
        return grouped(query, key, value, dtype)
    query, key, value = (jnp.asarray(x).astype(run) for x in (query, key, value))
    bias = None if bias is None else jnp.asarray(bias).astype(run)
    keep = None if mask is None else jnp.asarray(mask).astype(jnp.bool_)

    def cudnn():
        return jax.nn.dot_product_attention(
            query, key, value, bias, keep, is_causal=is_causal, implementation="cudnn"
        )

    def xla():
        return grouped(query, key, value, run).astype(run)

    return jax.lax.platform_dependent(cuda=cudnn, default=xla)
