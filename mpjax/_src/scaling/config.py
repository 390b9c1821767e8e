"""Defaults picked from a config: the loss scale of a precision, the dead-run threshold."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax._src.core.policy import Policy, get_policy
from mpjax._src.scaling.loss_scale import DynamicLossScale, LossScale, NoOpLossScale

__all__ = ["default_max_consecutive_skips", "loss_scale_for"]

# Short names (and the Keras policy names) -> the dtype the model computes in.
_COMPUTE_DTYPES = {
    "fp32": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "mixed_bfloat16": jnp.bfloat16,
    "fp16": jnp.float16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "mixed_float16": jnp.float16,
}


def loss_scale_for(precision: Any, **dynamic_kwargs: Any) -> LossScale:
    """Returns the loss scale a precision needs: dynamic for float16, none otherwise.

    With it one train step serves every precision:
    `loss_scaled(inner, loss_scale_for(precision))` runs `inner` exactly (no unscale, no
    finite check, no extra bytes for float32 params) for "fp32" and "bf16", whose range
    is float32's, and scales dynamically for "fp16"; `scale_loss` and `scaling_metrics`
    work in all three.

    Args:
      precision: "fp32"/"float32", "bf16"/"bfloat16"/"mixed_bfloat16",
        "fp16"/"float16"/"mixed_float16", a policy string (e.g.
        "params=float32,compute=float16,output=float32") or an `mpjax.Policy`. float16
        compute or params need dynamic scaling.
      **dynamic_kwargs: `DynamicLossScale` arguments (e.g. `growth_interval`), used for
        float16 only.

    Returns:
      `DynamicLossScale(**dynamic_kwargs)` for float16, else `NoOpLossScale()`.

    Example:
      >>> import optax
      >>> from mpjax import loss_scale_for, loss_scaled
      >>> loss_scale_for("fp16", growth_interval=200)
      DynamicLossScale(...)
      >>> tx = loss_scaled(optax.adam(1e-3), loss_scale_for("bf16"))
    """
    dtypes = _dtypes_of(precision)
    if any(jnp.dtype(d) == jnp.float16 for d in dtypes):
        return DynamicLossScale(**dynamic_kwargs)
    return NoOpLossScale()


def _dtypes_of(precision: Any) -> list:
    if isinstance(precision, str) and precision.strip().lower() in _COMPUTE_DTYPES:
        return [_COMPUTE_DTYPES[precision.strip().lower()]]
    if isinstance(precision, str):
        try:
            precision = get_policy(precision)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"loss_scale_for: unknown precision {precision!r}; use one of "
                f"{sorted(_COMPUTE_DTYPES)}, a policy string or an mpjax.Policy ({e})"
            ) from None
    if not isinstance(precision, Policy):
        raise TypeError(
            "loss_scale_for: precision must be a string or an mpjax.Policy, "
            f"got {type(precision).__name__}"
        )
    return [precision.compute_dtype, precision.param_dtype]


def default_max_consecutive_skips(loss_scale: LossScale) -> int:
    """The non-finite steps in a row after which a run counts as dead ("auto" limit).

    The limit of `raise_if_diverged(opt_state)` and of
    `loss_scaled(..., max_consecutive_skips="auto")`.

    A dynamic scale needs `k = ceil(log(top / min_scale) / log(1 / backoff_factor))`
    skips in a row to back off from the highest scale it can reach (`max_scale`, or
    float32's largest number when uncapped) to `min_scale`; any skip after that happens
    at `min_scale`, where scaling cannot help any more. The threshold allows those `k`
    and 25 more in a row (a burst of bad batches): 24 + 25 = 49 for the default
    `DynamicLossScale` (2**24 down to 1 by halving). A static scale never backs off:
    25.

    Args:
      loss_scale: the `LossScale` of the run.

    Returns:
      The threshold, an int >= 25.

    Example:
      >>> from mpjax import default_max_consecutive_skips, DynamicLossScale
      >>> default_max_consecutive_skips(DynamicLossScale())
      49
    """
    margin = 25
    if not isinstance(loss_scale, DynamicLossScale):
        return margin
    top = loss_scale.max_scale
    if top is None:
        top = float(np.finfo(np.float32).max)
    k = math.ceil(math.log(top / loss_scale.min_scale) / math.log(1 / loss_scale.backoff_factor))
    return max(k, 0) + margin
