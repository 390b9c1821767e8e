"""Default module lists for per-module policies: what stays in float32 under low precision.

In the spirit of MXNet AMP's `fp32_ops` and `torch.autocast`'s float32 list, but per
module: with a policy whose compute dtype is narrower than float32, normalisation
layers compute in float32, attention softmax runs in float32, and the model's final
outputs (logits) leave in float32. The lists are immutable data: pass a changed
`Defaults` to `apply_policy(..., defaults=...)` instead of mutating anything global.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

import flax.linen as nn
from flax import nnx

__all__ = ["DEFAULTS", "NO_DEFAULTS", "Defaults"]

_LINEN_NORMS = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm)
_NNX_NORMS = (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm)


def _class_tuple(value: Any, field: str) -> tuple[type, ...]:
    if isinstance(value, type):
        value = (value,)
    try:
        classes = tuple(value)
    except TypeError as e:
        raise TypeError(
            f"Defaults.{field} must be a tuple of module classes, got {type(value).__name__}"
        ) from e
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, (nn.Module, nnx.Module))):
            raise TypeError(
                f"Defaults.{field}: {cls!r} is not a flax.linen.Module or flax.nnx.Module class"
            )
    return classes


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The default lists `apply_policy` applies on top of the user's rules.

    They only act on modules whose policy computes below float32 (e.g. bfloat16), and
    only where the user has not said otherwise: a path rule naming the module, or a
    class rule naming the listed class or one of its subclasses, takes precedence. A
    rule on a broader class (e.g. `nn.Module`) or an inherited / `"*"` policy does not.

    Attributes:
      float32_modules: module classes (subclasses match) that compute in float32:
        their inputs and parameters are cast to float32, so their statistics are
        float32; their outputs still leave in the policy's `output_dtype`.
      float32_softmax_modules: attention module classes whose softmax runs in float32
        while their matmuls stay in the compute dtype (done by swapping Flax's default
        `attention_fn` for a float32-softmax variant; a user-supplied `attention_fn`
        is left alone).
      final_output_dtype: the root module's floating outputs (the logits) are widened
        to at least this dtype; `None` keeps the root policy's `output_dtype`.

    Example:
      >>> import dataclasses
      >>> import flax.linen as nn
      >>> from mpjax import DEFAULTS
      >>> d = dataclasses.replace(DEFAULTS, final_output_dtype=None)
      >>> d = dataclasses.replace(
      ...     DEFAULTS, float32_modules=DEFAULTS.float32_modules + (nn.Dense,))
    """

    float32_modules: tuple[type, ...] = _LINEN_NORMS + _NNX_NORMS
    float32_softmax_modules: tuple[type, ...] = (
        nn.MultiHeadDotProductAttention,
        nnx.MultiHeadAttention,
    )
    final_output_dtype: Any = jnp.float32

    def __post_init__(self):
        for field in ("float32_modules", "float32_softmax_modules"):
            object.__setattr__(self, field, _class_tuple(getattr(self, field), field))
        if self.final_output_dtype is not None:
            dtype = np.dtype(jnp.dtype(self.final_output_dtype))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"Defaults.final_output_dtype: {dtype.name} is not a floating dtype"
                )
            object.__setattr__(self, "final_output_dtype", dtype)


#: The default lists: normalisation layers and attention softmax in float32, logits float32.
DEFAULTS = Defaults()

#: No default lists: every module follows its rule exactly.
NO_DEFAULTS = Defaults(float32_modules=(), float32_softmax_modules=(), final_output_dtype=None)
