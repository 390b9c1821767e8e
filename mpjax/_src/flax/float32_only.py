"""Modules whose own code calls a float32-only op (an FFT) run in float32 under a policy.

A policy casts at module boundaries and does not rewrite ops, so a module that calls
`jnp.fft.rfft2` on the bfloat16 inputs a policy gives it fails inside JAX ("RFFT input
must be float32 or float64"). `apply_policy` then runs that module in float32, the way
`DEFAULTS.float32_modules` run normalisation layers: its inputs and own parameters are
cast to float32, its children keep their own policy, and its outputs leave in its
policy's `output_dtype`. The failed attempt leaves no trace: the linen and NNX
integrations restore the variables and RNG counters it touched (`LinenScopeSnapshot`
here, the NNX one in `nnx.py`) before the float32 call. Only if the float32 call fails
too is the error raised, naming the module and the rule to try.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

__all__ = [
    "Float32OnlyOpError",
    "LinenScopeSnapshot",
    "final_float32_only_error",
    "is_narrow",
    "may_call_float32_only_ops",
    "naming_float32_only_ops",
]

# Messages of JAX ops that accept float32/float64 (complex64/128) inputs only.
_FLOAT32_ONLY = ("FFT input must be",)


class Float32OnlyOpError(ValueError):
    """A float32-only op got low-precision inputs inside a policy module.

    Attributes:
      module: the module whose call raised it.
      retryable: whether the module may still be run again in float32.
    """

    def __init__(self, message: str, module: Any, retryable: bool = True):
        super().__init__(message)
        self.module = module
        self.retryable = retryable


def is_narrow(dtype: Any) -> bool:
    """Whether a compute dtype is narrower than float32 (where a float32-only op fails)."""
    return np.dtype(dtype).itemsize < 4


def may_call_float32_only_ops(module: Any) -> bool:
    """Whether a module's own code may call an FFT: Flax's own layers do not.

    Their low-precision calls are not snapshotted or retried (an FFT reached through
    one, e.g. a user's `attention_fn`, is retried by the user module calling it).
    """
    return not type(module).__module__.startswith("flax.")


def _rule_hint(module: Any, where: str, compute_dtype: Any, cause: str) -> str:
    name = type(module).__name__
    return (
        f"apply_policy: module {where!r} ({name}) calls an op that runs only in float32 "
        f"or float64 (an FFT: {cause}) on its {compute_dtype} inputs; give the module "
        f'a float32 rule, e.g. apply_policy(model, {{"*": policy, {name}: "float32"}}), '
        "or run the model under mpjax.autocast, which keeps FFTs in float32"
    )


@contextlib.contextmanager
def naming_float32_only_ops(module: Any, where: str, compute_dtype: Any) -> Iterator[None]:
    """Re-raises a float32-only op's dtype error as a `Float32OnlyOpError` naming `module`.

    Args:
      module: the module whose call is running (its class is named in the rule).
      where: the module's path, or its class name.
      compute_dtype: the compute dtype the policy gave its inputs.
    """
    try:
        yield
    except ValueError as e:
        message = str(e)
        if isinstance(e, Float32OnlyOpError) or not any(m in message for m in _FLOAT32_ONLY):
            raise
        raise Float32OnlyOpError(_rule_hint(module, where, compute_dtype, message), module) from e


def final_float32_only_error(error: Float32OnlyOpError) -> Float32OnlyOpError:
    """The error to raise when the module failed in float32 too: not retried further up."""
    return Float32OnlyOpError(str(error), error.module, retryable=False)


def _copy_tree(node: Mapping) -> dict:
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in node.items()}


def _restore_tree(node: MutableMapping, saved: Mapping) -> None:
    """Puts `saved`'s values back into `node` in place (scopes hold references to its dicts).

    Leaves added since the snapshot are removed; dicts added are emptied, not removed.
    """
    for k in list(node):
        if k in saved:
            continue
        if isinstance(node[k], MutableMapping):
            _restore_tree(node[k], {})
        else:
            del node[k]
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(node.get(k), MutableMapping):
            _restore_tree(node[k], v)
        else:
            node[k] = v


def _restore_counters(node: MutableMapping, saved: Mapping) -> None:
    """Puts RNG counters back in place; counters made since the snapshot restart at 0."""
    for k, v in node.items():
        if isinstance(v, MutableMapping):
            _restore_counters(v, saved.get(k, {}))
        else:
            node[k] = saved.get(k, 0)


def _collection_node(scope: Any, col: str) -> Any:
    """The dict of collection `col` at `scope` without creating or caching anything."""
    variables = scope._variables
    if col in variables:
        return variables[col]
    if scope.parent is None:
        return None
    parent = _collection_node(scope.parent, col)
    if not isinstance(parent, Mapping):
        return None
    return parent.get(scope.name)


def _collections(scope: Any) -> set[str]:
    root = scope
    while root.parent is not None:
        root = root.parent
    return set(root._variables) | set(scope._variables)


class LinenScopeSnapshot:
    """The variables and RNG counters of a linen module's scope subtree, to undo a call.

    Only the mutable collections' subtree of the module's own scope is copied (a module
    writes nowhere else), dicts only: the arrays are shared, never copied.
    """

    def __init__(self, scope: Any):
        self.scope = scope
        self.variables = {}
        for col in _collections(scope):
            if not scope.is_mutable_collection(col):
                continue
            node = _collection_node(scope, col)
            if isinstance(node, MutableMapping):
                self.variables[col] = (node, _copy_tree(node))
        self.rng_counters = _copy_tree(scope.rng_counters)

    def restore(self) -> None:
        """Undoes every write to the subtree's mutable collections and RNG counters."""
        for col in _collections(self.scope):
            if not self.scope.is_mutable_collection(col):
                continue
            node = _collection_node(self.scope, col)
            if not isinstance(node, MutableMapping):
                continue
            saved = self.variables.get(col)
            if saved is not None and saved[0] is not node:
                raise RuntimeError(f"apply_policy: the {col!r} collection was replaced mid-call")
            _restore_tree(node, saved[1] if saved is not None else {})
        _restore_counters(self.scope.rng_counters, self.rng_counters)
