"""Leaf-level helpers of the loss scales: which leaves are scaled, and how flags are checked."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype


def _map_floating(fn: Any, tree: Any, what: str) -> Any:
    """Applies `fn` to the floating leaves of `tree`; Python numbers become float32 arrays.

    Int, bool and float0 arrays pass through (int params, counters); Python bools too.
    Complex leaves and leaves that are neither arrays nor numbers (strings, objects) raise
    a TypeError naming the leaf's path.
    """

    def one(path, x):
        if isinstance(x, (bool, np.bool_)):
            return x
        if isinstance(x, (int, float)):
            x = jnp.asarray(x, jnp.float32)
        dtype = getattr(x, "dtype", None)
        if dtype is None or (
            not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            and jnp.issubdtype(dtype, jnp.complexfloating)
        ):
            kind = f"a {type(x).__name__}" if dtype is None else f"a {jnp.dtype(dtype)} array"
            raise TypeError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '<root>'} is {kind}; only "
                "real floating arrays and Python numbers are scaled (int and bool leaves "
                "pass through)"
            )
        return fn(x) if _is_floating(x) else x

    return jax.tree_util.tree_map_with_path(one, tree)


def _widen_tree(tree: Any, what: str) -> Any:
    return _map_floating(lambda x: x.astype(_wide_dtype(x.dtype)), tree, what)


def _check_flag(grads_finite: Any) -> jax.Array:
    """The scalar bool of `adjust`; a vector or a float flag raises, naming it."""
    flag = jnp.asarray(grads_finite)
    if flag.shape != ():
        raise ValueError(
            f"adjust: grads_finite must be a scalar bool, got shape {flag.shape} "
            "(reduce per-leaf flags first, e.g. with mpjax.all_finite(grads))"
        )
    if not (flag.dtype == jnp.bool_ or jnp.issubdtype(flag.dtype, jnp.integer)):
        raise TypeError(f"adjust: grads_finite must be a scalar bool, got dtype {flag.dtype}")
    return flag.astype(jnp.bool_)
