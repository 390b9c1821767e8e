"""Step 3 of `convert_for_inference`: fold each planned BatchNorm into its Conv/Dense."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mpjax._src.flax.conv_bn import ConvBN
from mpjax._src.inference.steps import ConversionPlan
from mpjax._src.inference.trace import Path, Trace, lookup, path_str

__all__ = ["fold_batchnorm_params", "fold_variables"]


def fold_batchnorm_params(
    kernel: jax.Array,
    bias: jax.Array | None,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    epsilon: float,
) -> tuple[jax.Array, jax.Array]:
    """Folds an inference-mode BatchNorm into the kernel and bias before it, in float32.

    `BN(x @ kernel + bias) == x @ kernel' + bias'` with `s = scale / sqrt(var + eps)`,
    `kernel' = kernel * s` (over the kernel's last, output-channel axis) and
    `bias' = (bias - mean) * s + offset`.

    Args:
      kernel: `[..., C]` Conv/Dense kernel.
      bias: `[C]` bias, or None for `use_bias=False`.
      mean, var: `[C]` running statistics.
      scale, offset: `[C]` BatchNorm scale and bias, or None when not used.
      epsilon: the BatchNorm's epsilon.

    Returns:
      `(kernel', bias')`, in float32 (or wider if the inputs are wider).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.inference import fold_batchnorm_params
      >>> mean, var = jnp.full(4, 2.0), jnp.full(4, 3.0)
      >>> k, b = fold_batchnorm_params(jnp.ones((8, 4)), None, mean, var, None, None, 1.0)
      >>> k[0], b
      (Array([0.5, 0.5, 0.5, 0.5], dtype=float32), Array([-1., -1., -1., -1.], dtype=float32))
    """
    dtype = jnp.promote_types(jnp.float32, kernel.dtype)
    f = lambda a: jnp.asarray(a, dtype)
    s = jax.lax.rsqrt(f(var) + jnp.asarray(epsilon, dtype))
    if scale is not None:
        s = s * f(scale)
    b = -f(mean) if bias is None else f(bias) - f(mean)
    b = b * s
    if offset is not None:
        b = b + f(offset)
    return f(kernel) * s, b


def _set(tree: dict, path: Path, key: str, value: Any) -> None:
    for k in path:
        tree = tree[k]
    tree[key] = value


def _delete(tree: dict, path: Path) -> None:
    """Deletes `tree[path]` and every mapping left empty above it."""
    if not path or lookup(tree, path) is None:
        return
    parent = lookup(tree, path[:-1]) if len(path) > 1 else tree
    del parent[path[-1]]
    if len(path) > 1 and not parent:
        _delete(tree, path[:-1])


def _copy(tree: dict) -> dict:
    """A copy of the nested dicts of `tree` (the arrays are shared)."""
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _bn_attrs(trace: Trace, path: Path) -> dict[str, Any]:
    """The recorded attributes of the BatchNorm (or ConvBN) call at `path`, and its kind."""
    for call in trace.calls:
        if call.path == path and call.kind in (nn.BatchNorm, ConvBN):
            return {**call.attrs, "kind": call.kind}
    raise KeyError(path_str(path))


def fold_variables(plan: ConversionPlan, params: dict, stats: dict) -> tuple[dict, dict]:
    """Step 3: folds every planned BatchNorm into its Conv/Dense, from the float32 originals.

    The folded kernel (and bias) is stored in the linear layer's storage dtype and the
    BatchNorm's params and statistics are removed; for an `mpjax.nn.ConvBN` the folded
    shift stays, in `norm_dtype`, as the BatchNorm's `bias` (the fused epilogue adds it).

    Args:
      plan: from `trace_conversion`.
      params, stats: from `cast_variables`.

    Returns:
      The folded `(params, batch_stats)`, new nested dicts.
    """
    params, stats = _copy(params), _copy(stats)
    src = plan.variables
    for bn, lin in plan.trace.pairs.items():
        bn_params = lookup(src, ("params", *bn)) or {}
        use = _bn_attrs(plan.trace, bn)
        kernel, bias = fold_batchnorm_params(
            lookup(src, ("params", *lin, "kernel")),
            lookup(src, ("params", *lin, "bias")),
            lookup(src, ("batch_stats", *bn, "mean")),
            lookup(src, ("batch_stats", *bn, "var")),
            bn_params.get("scale") if use["use_scale"] else None,
            bn_params.get("bias") if use["use_bias"] else None,
            use["epsilon"],
        )
        dtype = plan.param_dtype(lin) or kernel.dtype
        _set(params, lin, "kernel", kernel.astype(dtype))
        if use["kind"] is ConvBN:  # the BatchNorm becomes the epilogue's float32 shift
            _delete(params, (*bn, "scale"))
            _set(params, bn, "bias", bias.astype(plan.norm_dtype))
        else:
            _set(params, lin, "bias", bias.astype(dtype))
            _delete(params, bn)
        _delete(stats, bn)
    return params, stats
