"""`jax.nn.dot_product_attention` under autocast: the hand-written compute-dtype call, fused.

Autocast traces its function in the dtypes it is given (float32), and the attention's
implementation is chosen while tracing: `implementation="cudnn"` checks its operands' dtype
then (cuDNN's fused kernel takes fp16/bf16/fp8 only) and raises on float32, and the XLA form
(`implementation=None`) is traced as float32 GEMMs and a softmax that the rewrite would then
take apart op by op. Like `torch.autocast` with `scaled_dot_product_attention`, autocast
instead runs the call as the user would have written it in the compute dtype: while an
autocast traces (`attention_in(compute_dtype)`), a call whose query is wider than a 16-bit
compute dtype casts query, key, value and bias to it and runs the original function on them
inside a nested autocast region (`REGION_SCOPE`), whose equations the rewrite keeps as traced.
The program is then the hand-written bf16 one: one cuDNN flash-attention custom call forward
and one backward with `implementation="cudnn"` (the kernel keeps its softmax statistics in
float32), JAX's XLA form with float32 logits and softmax otherwise. The result is in the
compute dtype, as torch's.

JAX has no hook for this, so `install()` replaces the two module attributes through which the
call is made (`jax.nn.dot_product_attention`, and the cuDNN entry point that
`jax.nn.dot_product_attention` looks up, which catches callers holding their own reference to
it) by wrappers that, outside an autocast trace, call the originals unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as _cudnn
from jax._src.nn import functions as _functions

from mpjax._src.autocast.regions import REGION_SCOPE
from mpjax._src.autocast.rules import cast, dtype_of, is_float

__all__ = ["attention_dtype", "attention_in", "install"]

# The compute dtype of the autocast tracing now (None outside autocast's trace).
_COMPUTE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "mpjax_autocast_attention_dtype", default=None
)
_NARROW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_ORIGINAL_NN = jax.nn.dot_product_attention
_ORIGINAL_CUDNN = _cudnn.dot_product_attention


def attention_dtype(query_dtype: Any) -> Any:
    """The dtype an attention of `query_dtype` runs in here: the autocast compute dtype or None.

    Not None only while an autocast with a bfloat16/float16 compute dtype traces and
    `query_dtype` is a wider floating dtype.
    """
    dtype = _COMPUTE.get()
    if dtype is None or not is_float(query_dtype):
        return None
    if np.dtype(query_dtype) in _NARROW or jnp.finfo(query_dtype).bits > 32:
        return None
    return dtype


@contextlib.contextmanager
def attention_in(compute_dtype: Any) -> Iterator[None]:
    """Runs attention calls traced inside in `compute_dtype` (when bfloat16 or float16)."""
    install()
    dtype = np.dtype(compute_dtype)
    token = _COMPUTE.set(dtype if dtype in _NARROW else None)
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def _in_compute_dtype(original):
    """`original(query, key, value, bias, ...)` run by the hand-written compute-dtype rule."""

    @functools.wraps(original)
    def wrapper(query, key, value, bias=None, *args, **kwargs):
        dtype = attention_dtype(dtype_of(query))
        if dtype is None:
            return original(query, key, value, bias, *args, **kwargs)
        query, key, value, bias = (
            None if x is None else cast(jnp.asarray(x), dtype) for x in (query, key, value, bias)
        )
        token = _COMPUTE.set(None)  # the original's own calls are not re-intercepted
        try:
            with jax.named_scope(REGION_SCOPE):
                return original(query, key, value, bias, *args, **kwargs)
        finally:
            _COMPUTE.reset(token)

    wrapper.mpjax_original = original
    return wrapper


_NN_WRAPPER = _in_compute_dtype(_ORIGINAL_NN)
_CUDNN_WRAPPER = _in_compute_dtype(_ORIGINAL_CUDNN)


def install() -> None:
    """Routes `jax.nn.dot_product_attention` (and its cuDNN entry) through the wrappers.

    Idempotent; outside an autocast trace the wrappers call the originals unchanged.
    """
    if jax.nn.dot_product_attention is _ORIGINAL_NN:
        jax.nn.dot_product_attention = _NN_WRAPPER
    if _functions.cudnn_dot_product_attention is _ORIGINAL_CUDNN:
        _functions.cudnn_dot_product_attention = _CUDNN_WRAPPER
