"""`jax.nn.dot_product_attention` under autocast: the hand-written compute-dtype call, fused.

Autocast traces its function in the dtypes it is given (float32), and the attention's
implementation is chosen while tracing: `implementation="cudnn"` checks its operands' dtype
then (cuDNN's fused kernel takes fp16/bf16/fp8 only) and raises on float32, and the XLA form
(`implementation=None`) is traced as float32 GEMMs and a softmax that the rewrite would then
take apart op by op. Like `torch.autocast` with `scaled_dot_product_attention`, autocast
instead runs the call as the user would have written it in the compute dtype: query, key and
value cast to it, the bias too but saturating (a `finfo(float32).min` mask stays finite, as
autocast's constants do), run inside a nested autocast region (`REGION_SCOPE`) whose
equations the rewrite keeps as traced. The program is then the hand-written one: one cuDNN
flash-attention custom call forward and one backward with `implementation="cudnn"`, JAX's XLA
form with float32 logits and softmax otherwise (float16 on XLA:CPU and TPU, which reject the
float16 GEMM accumulating in float32 that JAX's XLA form asks for, runs on the float16 values
widened to float32: the same logits, see `_portable`). The result is in the compute dtype.

How, without changing JAX's function: a rewrite of the traced jaxpr cannot do this
(`implementation="cudnn"` raises on float32 before any jaxpr exists, and the XLA form is
inlined as separate ops, with no trace of being one call), and `jax.nn.dot_product_attention`
is never replaced (its identity, pickling, signature, docs and results are JAX's, inside
autocast and out). After checking its arguments it calls one of two private entry points that
it looks up in its module at each call, the XLA form and cuDNN's; while an autocast with a
16-bit compute dtype traces its function (`attention_in`), and only then, those two module
attributes are wrappers that run the compute-dtype call in that trace and call the original
unchanged anywhere else (another thread, or the same thread outside the trace: the compute
dtype in force is a thread-local `jax.make_user_context`). The swap is counted under a lock,
so overlapping traces in several threads keep it until the last one ends, and is undone in a
`finally`. The compute dtype is part of `jax.jit`'s cache key: a jitted function traced
inside an autocast is traced again outside it, never reused with its compute-dtype casts.
Limits (docs/guides/autocast.md): a JAX without these entry points runs the attention as
traced (autocast rewrites the XLA form op by op: correct, not fused; `"cudnn"` on float32
raises JAX's error); a function whose backward is traced after autocast returns (a
`custom_vjp` rule) calls JAX's attention as written.
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
from jax._src.nn import functions as _functions

from mpjax._src.autocast.regions import REGION_SCOPE
from mpjax._src.autocast.rules import cast, dtype_of, is_float

__all__ = ["attention_dtype", "attention_in"]

# The name of the compute dtype of the autocast tracing now (None outside autocast's trace):
# a jit-cache key, so that a function traced under autocast is not reused outside it.
_COMPUTE = jax.make_user_context(None)
_NARROW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# The entry points `jax.nn.dot_product_attention` calls (module attributes of `_functions`).
_XLA_ENTRY = "_dot_product_attention_xla"
_CUDNN_ENTRY = "cudnn_dot_product_attention"
# Platforms whose XLA rejects `DotAlgorithmPreset.F16_F16_F32` (JAX's float16 XLA form).
_NO_F16_F32_GEMM = ("cpu", "tpu")


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


def _portable(original, dtype: np.dtype):
    """`original` (JAX's XLA form) in `dtype`, runnable on every platform.

    JAX's float16 XLA form asks for a float16 GEMM accumulating in float32
    (`DotAlgorithmPreset.F16_F16_F32`), which XLA:CPU and TPU reject. There it runs on the
    float16 values widened to float32 (a product of two float16 values is exact in float32,
    so the logits are those of the float16 GEMM accumulating in float32) and returns its
    results in the dtypes of the float16 call; the platform is chosen where the program is
    lowered (`jax.lax.platform_dependent`).
    """
    if dtype != np.float16:
        return original

    def call(*args, **kwargs):
        native = functools.partial(original, *args, **kwargs)
        shapes = jax.eval_shape(native)

        def wide():
            widened = [None if a is None else cast(a, np.float32) for a in args]
            out = original(*widened, **kwargs)
            return jax.tree.map(lambda o, s: o.astype(s.dtype), out, shapes)

        per_platform = dict.fromkeys(_NO_F16_F32_GEMM, wide)
        return jax.lax.platform_dependent(default=native, **per_platform)

    return call


def _in_compute_dtype(original, portable: bool):
    """`original(query, key, value, bias, ...)` run as the hand-written compute-dtype call."""

    @functools.wraps(original)
    def wrapper(query, key, value, bias=None, *args, **kwargs):
        dtype = attention_dtype(dtype_of(query))
        if dtype is None:
            return original(query, key, value, bias, *args, **kwargs)
        query, key, value = (cast(jnp.asarray(x), dtype) for x in (query, key, value))
        # The bias saturates: a finfo(float32).min mask must not become -inf (a fully masked
        # row would be NaN where float32 gives a finite row).
        bias = None if bias is None else cast(jnp.asarray(bias), dtype, saturate=True)
        run = _portable(original, dtype) if portable else original
        with _COMPUTE(None), jax.named_scope(REGION_SCOPE):
            return run(query, key, value, bias, *args, **kwargs)

    return wrapper


class _Interception:
    """JAX's attention entry points routed through the wrappers while any autocast traces.

    Process-wide, because the entry points are: `enter` wraps the attributes found when no
    trace holds them, `exit` puts them back when the last one ends (unless something else
    replaced the wrapper meanwhile). Both under one lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._swapped: list[tuple[str, Any, Any]] = []

    def enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                for name, portable in ((_XLA_ENTRY, True), (_CUDNN_ENTRY, False)):
                    original = getattr(_functions, name, None)
                    if callable(original):
                        wrapper = _in_compute_dtype(original, portable)
                        setattr(_functions, name, wrapper)
                        self._swapped.append((name, original, wrapper))
            self._holders += 1

    def exit(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                for name, original, wrapper in self._swapped:
                    if getattr(_functions, name, None) is wrapper:
                        setattr(_functions, name, original)
                self._swapped.clear()


# The one mutable module-level object: the entry points it swaps are process-wide, so the
# count of the traces holding them must be too (per-thread state would restore them under
# another thread's trace).
_INTERCEPTION = _Interception()


@contextlib.contextmanager
def attention_in(compute_dtype: Any) -> Iterator[None]:
    """Runs `jax.nn.dot_product_attention` calls traced inside in `compute_dtype` (16-bit)."""
    dtype = np.dtype(compute_dtype)
    if dtype not in _NARROW:
        with _COMPUTE(None):
            yield
        return
    _INTERCEPTION.enter()
    try:
        with _COMPUTE(dtype.name):
            yield
    finally:
        _INTERCEPTION.exit()
