"""Input checks of `loss_scaled`: each error names the culprit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpjax._src.scaling.loss_scale import DynamicLossScale, LossScale


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
