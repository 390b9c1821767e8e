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

JAX has no hook for this, so importing mpjax replaces the two module attributes through
which the call is made (`jax.nn.dot_product_attention`, and the cuDNN entry point that
`jax.nn.dot_product_attention` looks up at each call, which also catches callers holding
their own reference to it with `implementation="cudnn"`) by wrappers that, outside an
autocast trace, call the originals unchanged. A rewrite of the traced jaxpr cannot do this:
`implementation="cudnn"` raises on float32 before any jaxpr exists, and the XLA form leaves
no trace of being one attention call. Limits (docs/guides/autocast.md): a reference to the
original `jax.nn.dot_product_attention` taken before mpjax was imported, called with
`implementation=None`/`"xla"`, is not intercepted (autocast then rewrites its XLA form op by
op: correct, not fused); a JAX without the internal cuDNN entry point gets only the public
wrapper. The compute dtype in force is a `jax.make_user_context`, part of `jax.jit`'s cache
key: a jitted function traced inside an autocast is traced again outside it, never reused
with its compute-dtype casts.
"""

from __future__ import annotations

import contextlib
import functools
import threading
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

# The name of the compute dtype of the autocast tracing now (None outside autocast's trace):
# a jit-cache key, so that a function traced under autocast is not reused outside it.
_COMPUTE = jax.make_user_context(None)
_NARROW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# JAX's own functions (a reloaded module finds its wrapper installed: the original is inside).
_ORIGINAL_NN = getattr(jax.nn.dot_product_attention, "mpjax_original", jax.nn.dot_product_attention)
_ORIGINAL_CUDNN = _cudnn.dot_product_attention
_CUDNN_ENTRY = "cudnn_dot_product_attention"  # the name jax.nn's implementation calls
_INSTALL = threading.Lock()


def attention_dtype(query_dtype: Any) -> Any:
    """The dtype an attention of `query_dtype` runs in here: the autocast compute dtype or None.

    Not None only while an autocast with a bfloat16/float16 compute dtype traces and
    `query_dtype` is a wider floating dtype.
    """
    dtype = _COMPUTE.value
    if dtype is None or not is_float(query_dtype):
        return None
    if np.dtype(query_dtype) in _NARROW or jnp.finfo(query_dtype).bits > 32:
        return None
    return np.dtype(dtype)


@contextlib.contextmanager
def attention_in(compute_dtype: Any) -> Iterator[None]:
    """Runs attention calls traced inside in `compute_dtype` (when bfloat16 or float16)."""
    dtype = np.dtype(compute_dtype)
    with _COMPUTE(dtype.name if dtype in _NARROW else None):
        yield


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
        # The original's own call of the cuDNN entry point is not intercepted again.
        with _COMPUTE(None), jax.named_scope(REGION_SCOPE):
            return original(query, key, value, bias, *args, **kwargs)

    wrapper.mpjax_original = original
    return wrapper


_NN_WRAPPER = _in_compute_dtype(_ORIGINAL_NN)
_CUDNN_WRAPPER = _in_compute_dtype(_ORIGINAL_CUDNN)


def install() -> None:
    """Routes `jax.nn.dot_product_attention` (and its cuDNN entry) through the wrappers.

    Called when mpjax is imported. Idempotent and thread-safe; an attribute that is neither
    JAX's original nor our wrapper (someone else's patch) is left alone, as is a JAX
    without the internal cuDNN entry point. Outside an autocast trace the wrappers call the
    originals unchanged.
    """
    with _INSTALL:
        if jax.nn.dot_product_attention is _ORIGINAL_NN:
            jax.nn.dot_product_attention = _NN_WRAPPER
        if getattr(_functions, _CUDNN_ENTRY, None) is _ORIGINAL_CUDNN:
            setattr(_functions, _CUDNN_ENTRY, _CUDNN_WRAPPER)


install()
