"""Which equations autocast leaves as traced: nested autocast regions and jnp's convert-backs.

* A nested `autocast` (an inner `autocast(g, "float32")`, torch's `autocast(enabled=False)`,
  or an inner bf16 region inside an outer float16 one) runs its own rewrite while the outer
  function is traced; its equations carry the name scope `REGION_SCOPE`, and the outer
  autocast binds them with the dtypes they were traced with, so the innermost region's
  policy wins for its ops, forward and backward.
* `jnp.sum`, `jnp.mean`, `jax.nn.softmax`, `logsumexp`, ... of a float16/bfloat16 argument
  accumulate in float32 and convert the result back to the argument's dtype. Autocast
  drops that convert-back (a float32-list op returns float32 whatever its input dtype, as
  in torch), but keeps every cast the user writes (`astype`, `asarray`, Flax's `dtype`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

__all__ = ["REGION_SCOPE", "in_nested_region", "is_library_convert", "narrows", "tracing"]

REGION_SCOPE = "mpjax_autocast_region"

# True while an autocast traces its function: an autocast called then is a nested region.
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mpjax_autocast_tracing", default=False
)

# jax source folders of library functions whose internal casts are convert-backs.
_LIBRARY_FOLDERS = frozenset({"numpy", "nn", "ops", "scipy"})
# jax functions that are a cast the user asked for (`x.astype`, `jnp.asarray(x, dtype)`).
_CAST_FUNCTIONS = frozenset({"astype", "_astype", "asarray", "array"})


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Marks the trace of an autocast function (autocasts called inside it are nested)."""
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


def is_nested() -> bool:
    """Whether an autocast function is being called while another one traces."""
    return _TRACING.get()


def in_nested_region(eqn) -> bool:
    """Whether `eqn` was emitted by a nested autocast (its dtypes are that region's)."""
    return REGION_SCOPE in str(eqn.source_info.name_stack).split("/")


def narrows(src: np.dtype, dst: np.dtype) -> bool:
    """Whether casting floating `src` to floating `dst` loses range or precision."""
    return jnp.finfo(dst).bits < jnp.finfo(src).bits


def is_library_convert(eqn) -> bool:
    """Whether a `convert_element_type` equation is a jax library's internal convert-back.

    True when the call chain that emitted it reaches a `jax.numpy` / `jax.nn` / `jax.ops` /
    `jax.scipy` function (other than a cast function) before any code outside jax; False
    for a cast the user wrote, for casts in other libraries (Flax's `dtype`) and when the
    jaxpr carries no traceback.
    """
    traceback = eqn.source_info.traceback
    if traceback is None:
        return False
    for frame in traceback.frames:  # innermost first
        path = frame.file_name.replace("\\", "/")
        if "/jax/_src/" not in path:
            return False
        folder, _, rest = path.split("/jax/_src/", 1)[1].partition("/")
        if rest == "array_methods.py":
            continue  # `x.sum()` and `x.astype()` both pass through here
        if folder in _LIBRARY_FOLDERS and rest:
            return frame.function_name not in _CAST_FUNCTIONS
    return False
