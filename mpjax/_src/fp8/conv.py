"""fp8 convolutions: a 1x1 convolution runs as an fp8 GEMM; the others keep the compute dtype.

What XLA:GPU (jax 0.10.2, H100, default flags, NHWC/HWIO) makes of a float8
`lax.conv_general_dilated`, found on deviceless compiles:

- forward, `conv(q_x, q_w, preferred_element_type=bf16)` with two operands of one fp8
  type (`lax` refuses mixed dtypes): a cuDNN fp8 graph convolution
  (`__cudnn$convForwardGraph`); the dequantise form `conv(q_x -> f32 * s_x, q_w -> f32 *
  s_w)` becomes the same graph with the scales fused, e5m2 x e4m3 too.
- input gradient, stride 1: the same fp8 graph on the flipped kernel, in the direct form or
  in the dequantise form with the flip applied to the fp8 kernel (`deq(rev(q_w))`; e5m2 x
  e4m3 too); flipping the dequantised kernel, as jax's transpose rule does, gives a
  TF32/bf16 `__cudnn$convForward`. Stride 2: an fp8 graph on a zero-dilated gradient (4x
  the multiply-adds of the bf16 `__cudnn$convBackwardInput`).
- weight gradient: always `__cudnn$convBackwardFilter` in bf16 (direct form: the fp8
  operands converted to bf16 first) or f32 (dequantise form), never fp8: XLA's cuDNN fp8
  path is graph-mode forward convolutions only.

A 1x1 convolution is a GEMM over the channels (`[N*H*W, C_in] @ [C_in, C_out]`, after
subsampling the input by the stride), so with `Fp8Recipe(convs="1x1")` it runs through
`fp8_dot_general`: fp8 GEMMs for the forward pass and both gradients, the form XLA compiles
to fp8 tensor-core GEMMs. Every other convolution keeps the compute dtype, as do all of
them under the default `convs="none"`; `mpjax.fp8.fp8_ops` reports which and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax import lax

from mpjax._src.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["CONV_FALLBACK", "conv_gemm_site", "fp8_conv_1x1", "gemm_reason"]

GEMM_DIMS = (((1,), (0,)), ((), ()))
# Why a convolution that is not 1x1 keeps the compute dtype (see the module docstring).
CONV_FALLBACK = (
    "not a 1x1 convolution: XLA:GPU runs no fp8 weight-gradient convolution (its cuDNN "
    "backward-filter conv upcasts fp8), so it stays in the compute dtype"
)


def _not_gemm(rhs_shape, params) -> str | None:
    """Why a convolution is not a plain 1x1 GEMM over its channels, or None if it is."""
    rhs_spec = params["dimension_numbers"].rhs_spec
    if any(rhs_shape[d] != 1 for d in rhs_spec[2:]):
        return CONV_FALLBACK
    if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        return "grouped 1x1 convolution: stays in the compute dtype"
    if any(d != 1 for d in params["lhs_dilation"]):
        return "input-dilated (transposed) 1x1 convolution: stays in the compute dtype"
    if any(tuple(p) != (0, 0) for p in params["padding"]):
        return "padded 1x1 convolution: stays in the compute dtype"
    return None


def _gemm_shapes(lhs_shape, rhs_shape, params) -> tuple[tuple[int, int], tuple[int, int]]:
    """The `[M, C_in]`, `[C_in, C_out]` GEMM a 1x1 convolution is (M counts output pixels)."""
    lhs_spec, rhs_spec, _ = params["dimension_numbers"]
    rows = lhs_shape[lhs_spec[0]]
    for d, s in zip(lhs_spec[2:], params["window_strides"], strict=True):
        rows *= -(-lhs_shape[d] // s)
    c_in = lhs_shape[lhs_spec[1]]
    return (rows, c_in), (c_in, rhs_shape[rhs_spec[0]])


def conv_gemm_site(recipe: Fp8Recipe, name: str, lhs_shape, rhs_shape, params):
    """The `Fp8Site` of the GEMM a convolution runs as in fp8, or the reason it does not.

    Args:
      recipe: the `Fp8Recipe`.
      name: the op's name stack.
      lhs_shape: the input's shape.
      rhs_shape: the kernel's shape.
      params: the `conv_general_dilated` equation's parameters.

    Returns:
      `(site, None)` for a convolution that runs as an fp8 GEMM, else `(None, reason)`.
    """
    if recipe.convs == "none":
        return None, "Fp8Recipe(convs='none'): convolutions stay in the compute dtype"
    reason = _not_gemm(rhs_shape, params)
    if reason is not None:
        return None, reason
    lhs, rhs = _gemm_shapes(lhs_shape, rhs_shape, params)
    site = Fp8Site(name, lhs, rhs, GEMM_DIMS, kind="conv")
    reason = gemm_reason(recipe, site)
    return (None, reason) if reason else (site, None)


def gemm_reason(recipe: Fp8Recipe, site: Fp8Site) -> str | None:
    """Why `fp8_eligible(recipe, site)` is False, or None if it is True.

    Sizes first, then the user's exclusions (called once per size-eligible site).
    """
    if not fp8_eligible(dataclasses.replace(recipe, exclude=(), exclude_if=None), site):
        if site.dimension_numbers[1][0]:
            return "batched dot_general (e.g. attention): stays in the compute dtype"
        shapes = f"GEMM {site.lhs_shape} x {site.rhs_shape}"
        return f"{shapes}: sizes below min_dim or not multiples of 16"
    if recipe.excludes(site):
        return "excluded by the recipe's exclude / exclude_if"
    return None


def fp8_conv_1x1(lhs, rhs, params: dict, recipe: Fp8Recipe, compute_dtype: Any):
    """A 1x1 `conv_general_dilated` as an fp8 GEMM over the channels, forward and backward.

    The input is subsampled by the stride and reshaped to `[N*H*W, C_in]` (free for NHWC),
    the kernel to `[C_in, C_out]` (free for HWIO), and the product runs through
    `fp8_dot_general` (its scaling, formats and custom VJP).

    Args:
      lhs: the input.
      rhs: the 1x1 kernel.
      params: `conv_general_dilated` parameters (`window_strides`, `padding` all zero,
        `lhs_dilation` all one, `dimension_numbers` a `ConvDimensionNumbers`, one group).
      recipe: a current-scaling `Fp8Recipe`.
      compute_dtype: the output dtype.

    Returns:
      The convolution's output in `compute_dtype`, laid out as `params` say.

    Example:
      >>> from jax import lax
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax.fp8 import fp8_conv_1x1
      >>> dn = lax.conv_dimension_numbers((8, 4, 4, 64), (1, 1, 64, 32), ("NHWC", "HWIO", "NHWC"))
      >>> params = dict(window_strides=(1, 1), padding=((0, 0), (0, 0)), lhs_dilation=(1, 1),
      ...               dimension_numbers=dn, feature_group_count=1, batch_group_count=1)
      >>> fp8_conv_1x1(jnp.ones((8, 4, 4, 64)), jnp.ones((1, 1, 64, 32)), params,
      ...              Fp8Recipe(min_dim=16, convs="1x1"), jnp.bfloat16).shape
      (8, 4, 4, 32)
    """
    reason = _not_gemm(np.shape(rhs), params)
    if reason is not None:
        raise ValueError(f"fp8_conv_1x1: {reason}")
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    x = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))  # N, spatial..., C_in
    strides = tuple(params["window_strides"])
    if any(s != 1 for s in strides):
        x = lax.slice(x, (0,) * x.ndim, x.shape, (1, *strides, 1))
    w = lax.transpose(rhs, (rhs_spec[1], rhs_spec[0], *rhs_spec[2:]))
    w = w.reshape(w.shape[:2])  # C_in, C_out
    y = fp8_dot_general(x.reshape(-1, x.shape[-1]), w, GEMM_DIMS, recipe, compute_dtype)
    y = y.reshape((*x.shape[:-1], w.shape[1]))  # N, spatial..., C_out
    source = [0] * y.ndim  # output axis -> axis of y
    source[out_spec[0]], source[out_spec[1]] = 0, y.ndim - 1
    for i, d in enumerate(out_spec[2:]):
        source[d] = i + 1
    return lax.transpose(y, tuple(source))
