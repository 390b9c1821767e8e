"""A clear error when a policy hands a float32-only op (an FFT) low-precision inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["naming_float32_only_ops"]

# Messages of JAX ops that accept float32/float64 (complex64/128) inputs only.
_FLOAT32_ONLY = ("FFT input must be",)


@contextlib.contextmanager
def naming_float32_only_ops(module: Any, where: str, compute_dtype: Any) -> Iterator[None]:
    """Re-raises a float32-only op's dtype error naming the module and the rule that fixes it.

    Args:
      module: the module whose call is running (its class is named in the rule).
      where: the module's path, or its class name.
      compute_dtype: the compute dtype the policy gave its inputs.
    """
    try:
        yield
    except ValueError as e:
        message = str(e)
        if message.startswith("apply_policy:") or not any(m in message for m in _FLOAT32_ONLY):
            raise
        name = type(module).__name__
        raise ValueError(
            f"apply_policy: module {where!r} ({name}) calls an op that runs only in float32 "
            f"or float64 (an FFT: {message}) on its {compute_dtype} inputs; give the module "
            f'a float32 rule, e.g. apply_policy(model, {{"*": policy, {name}: "float32"}}), '
            "or run the model under mpjax.autocast, which keeps FFTs in float32"
        ) from e
