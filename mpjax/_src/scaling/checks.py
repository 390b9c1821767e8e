"""Input checks of `loss_scaled`: each error names the culprit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax._src.kernels.dispatch import IMPLS
from mpjax._src.scaling.loss_scale import DynamicLossScale, LossScale
from mpjax._src.scaling.master import MASTER_MODES


def _path_set(tree: Any) -> set[str]:
    return {
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    }


def _check_same_structure(grads: Any, params: Any) -> None:
    g_struct, p_struct = jax.tree.structure(grads), jax.tree.structure(params)
    if g_struct == p_struct:
        pairs = zip(
            jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(params), strict=True
        )
        for (path, g), p in pairs:
            if jnp.shape(g) != jnp.shape(p):
                raise ValueError(
                    f"loss_scaled: gradient {jax.tree_util.keystr(path)} has shape "
                    f"{jnp.shape(g)}, its param has shape {jnp.shape(p)}"
                )
        return
    g_paths, p_paths = _path_set(grads), _path_set(params)
    only_g = sorted(g_paths - p_paths)[:5]
    only_p = sorted(p_paths - g_paths)[:5]
    detail = []
    if only_g:
        detail.append(f"in grads only: {only_g}")
    if only_p:
        detail.append(f"in params only: {only_p}")
    if not detail:
        detail.append(f"grads {g_struct} vs params {p_struct}")
    raise ValueError(
        "loss_scaled: the gradient tree does not match the parameter tree; " + "; ".join(detail)
    )


_SUPPORTED_FLOATS = tuple(jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))


def _check_param_dtypes(params: Any) -> None:
    """Refuses complex and exotic floating params, naming the leaf, rather than freezing them."""
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(p, "dtype", None)
        if dtype is None:
            # A Python number or an object would be frozen silently (or crash later).
            raise TypeError(
                f"loss_scaled: param {jax.tree_util.keystr(path)} is a {type(p).__name__}, "
                "not an array; give arrays (jnp.asarray), or None for leaves without "
                "parameters (as eqx.filter(model, eqx.is_array) does)"
            )
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            continue
        if jnp.issubdtype(dtype, jnp.complexfloating) or (
            jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype) not in _SUPPORTED_FLOATS
        ):
            raise TypeError(
                f"loss_scaled: param {jax.tree_util.keystr(path)} has dtype {jnp.dtype(dtype)}; "
                "supported floating dtypes are float16, bfloat16, float32 and float64 "
                "(int and bool params pass through untouched)"
            )


def _check_loss_scale(loss_scale: Any) -> LossScale:
    if loss_scale is None:
        return DynamicLossScale()
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "loss_scaled: loss_scale must be an mpjax LossScale (NoOpLossScale, "
            f"StaticLossScale, DynamicLossScale) or None, got {type(loss_scale).__name__}"
        )
    return loss_scale


def _check_axis_name(axis_name: Any) -> None:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is None or (names and all(isinstance(n, str) for n in names)):
        return
    raise TypeError(
        f"loss_scaled: axis_name must be None, a mapped axis name (str) or a tuple of them, "
        f"got {axis_name!r}; pass the name given to shard_map/pmap's mesh axis, e.g. "
        "axis_name='data'"
    )


def _check_arguments(inner: Any, loss_scale: Any, **kw: Any) -> tuple:
    """Validates `loss_scaled`'s arguments at construction: (inner with extra args, scale)."""
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "loss_scaled: inner must be an optax GradientTransformation, "
            f"got {type(inner).__name__}"
        )
    check_new_values, skip_impl = kw["check_new_values"], kw["skip_impl"]
    if check_new_values not in ("auto", True, False):
        raise ValueError(
            f"loss_scaled: check_new_values must be 'auto', True or False, got {check_new_values!r}"
        )
    if skip_impl not in ("auto", "cond", "select"):
        raise ValueError(
            f"loss_scaled: skip_impl must be 'auto', 'cond' or 'select', got {skip_impl!r}"
        )
    if kw["master_weights"] not in MASTER_MODES:
        raise ValueError(
            "loss_scaled: master_weights must be 'auto', True, False or 'remainder', "
            f"got {kw['master_weights']!r}"
        )
    loss_scale = _check_loss_scale(loss_scale)
    limit = kw["max_consecutive_skips"]
    if limit not in ("auto", None) and (
        isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
    ):
        raise ValueError(
            f"loss_scaled: max_consecutive_skips must be an int >= 1, 'auto' or None, got {limit!r}"
        )
    _check_axis_name(kw["axis_name"])
    unscale_and_check = kw["unscale_and_check"]
    if unscale_and_check is not None and not callable(unscale_and_check):
        raise TypeError(
            "loss_scaled: unscale_and_check must be None or a function "
            "(grads, loss_scale) -> (unscaled grads, all finite), got "
            f"{type(unscale_and_check).__name__}; e.g. mpjax.pallas.xla_unscale_and_check"
        )
    if unscale_and_check is None and kw["impl"] not in IMPLS:
        raise ValueError(f"loss_scaled: impl must be one of {IMPLS}, got {kw['impl']!r}")
    return optax.with_extra_args_support(inner), loss_scale


def _check_grads_match(grads: Any, params: Any) -> Any:
    """Checks grads against params, naming the leaf; Python numbers become float32 arrays.

    A Python-number gradient would otherwise escape the finite check (it has no dtype); a
    complex gradient of a real param would lose its imaginary part (and an inf there would
    write NaN into the param while the step counts as finite).
    """

    def leaf(path, g):
        if isinstance(g, (bool, np.bool_)):
            return g
        if isinstance(g, (int, float)):
            return jnp.asarray(g, jnp.float32)
        dtype = getattr(g, "dtype", None)
        if dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            if jnp.issubdtype(dtype, jnp.complexfloating):
                raise TypeError(
                    f"loss_scaled: gradient {jax.tree_util.keystr(path)} is "
                    f"{jnp.dtype(dtype).name} for a real param: its imaginary part would be "
                    "dropped. Differentiate a real loss of the real params (jax.grad of a "
                    "complex function needs holomorphic=True and complex params), or take "
                    "jnp.real of the gradient yourself if that is what you mean"
                )
        return g

    grads = jax.tree_util.tree_map_with_path(leaf, grads)
    _check_same_structure(grads, params)
    return grads
