"""fp8 saved activations: a GEMM or convolution whose backward keeps its input in float8.

The backward of `y = x @ w` needs `x` (for the weight gradient `x^T g`) and `w` (for the
input gradient `g w^T`). `w` is a parameter, alive anyway; `x` is an activation that
lives from the forward to the backward pass. `saved_in_fp8` computes the op as usual (in
the dtype of its operands: bf16 GEMMs stay bf16) but keeps, as the residual of the
activation operand, its fp8 copy `q = saturate(x * s)` with a float32 scale `s` per row
(`fp8_max / amax` over the op's contracting axes, current scaling); the backward pass
dequantises `q / s` to `x`'s dtype and runs the op's own VJP on it. The compute-dtype
`x` is not a residual, so it dies after the forward GEMM: 1 byte per element is kept
instead of 2. This is what Transformer Engine (JAX) does for its GEMM inputs and
DeepSeek-V3 for its cached activations.

The fp8 residuals are named `SAVED_FP8_NAME` (`jax.ad_checkpoint.checkpoint_name`), so a
`jax.checkpoint`/`nn.remat` policy can save them and recompute the rest
(`saved_activations_policy`).

Error: e4m3 keeps 3 mantissa bits, so a normal value is stored with relative error at most
2**-4 (round to nearest); values below the row's amax * 2**-6 / 448 fall into the
subnormals (absolute error at most amax * 2**-10 / 448).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mpjax._src.core.text import excerpt
from mpjax._src.fp8.quant import amax, compute_scale, dequantize, quantize

__all__ = [
    "SAVED_FP8_NAME",
    "fp8_saved_conv",
    "fp8_saved_dot_general",
    "saved_activations_policy",
    "saved_in_fp8",
]

# The checkpoint name of every fp8 residual (data and scale) made by `saved_in_fp8`.
SAVED_FP8_NAME = "mpjax_fp8_saved_activation"


def _quantised(x, axes: tuple[int, ...], dtype):
    """`(q, scale)`: `x` in `dtype` with one float32 scale per row (amax over `axes`)."""
    scale = compute_scale(amax(x, axes), dtype)
    return checkpoint_name(quantize(x, scale, dtype), SAVED_FP8_NAME), checkpoint_name(
        scale, SAVED_FP8_NAME
    )


def saved_in_fp8(
    fn: Callable, args: Sequence[Any], which: Sequence[bool], axes: Sequence[Any], dtype: Any
) -> Any:
    """`fn(*args)`, whose backward pass keeps the marked arguments as fp8 data + scale.

    Args:
      fn: a function of `args` (a GEMM or convolution, or any function whose VJP needs
        its arguments); its forward is run as is.
      args: its floating array arguments.
      which: which arguments to keep in fp8 (the activations); the others are kept as
        they are.
      axes: for each marked argument, the axes its amax is taken over (one scale per
        index of the other axes: per row of a GEMM input over its contracting axes).
      dtype: the fp8 format (`float8_e4m3fn` or `float8_e5m2`).

    Returns:
      `fn(*args)`. Its gradient is `fn`'s VJP evaluated at the dequantised arguments.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.fp8 import saved_in_fp8
      >>> x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
      >>> f = lambda x: saved_in_fp8(jnp.matmul, (x, w), (True, False), ((1,), None),
      ...                            jnp.float8_e4m3fn).astype(jnp.float32).sum()
      >>> jax.grad(f)(x).dtype
      dtype(bfloat16)
    """
    which = tuple(bool(w) for w in which)
    axes = tuple(None if a is None else tuple(int(i) for i in a) for a in axes)
    dtype = np.dtype(dtype)
    dtypes = [np.dtype(x.dtype) for x in args]

    def forward(*xs):
        saved = []
        for x, keep, ax in zip(xs, which, axes, strict=True):
            # The barrier makes XLA write the fp8 copy in the forward pass: left alone, it
            # fuses quantise and dequantise into the backward's reader of `x`, keeping the
            # compute-dtype `x` alive instead.
            saved.append(lax.optimization_barrier(_quantised(x, ax, dtype)) if keep else x)
        return fn(*xs), tuple(saved)

    def backward(saved, g):
        xs = [
            dequantize(s[0], s[1], d) if keep else s
            for s, keep, d in zip(saved, which, dtypes, strict=True)
        ]
        _, vjp = jax.vjp(fn, *xs)
        return vjp(g)

    op = jax.custom_vjp(lambda *xs: fn(*xs))
    op.defvjp(forward, backward)
    return op(*args)


def fp8_saved_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    saved_dtype: Any,
    operands: tuple[bool, bool] = (True, False),
    inner: Callable = lax.dot_general,
    **kwargs: Any,
) -> jax.Array:
    """`inner(lhs, rhs, ...)` (`lax.dot_general`) keeping `operands` in fp8 for the backward.

    A drop-in `dot_general` for Flax's `Dense(dot_general=...)`: the GEMM runs as `inner`
    runs it (in the operands' dtype); the marked operands (the left one by default: a
    `Dense`'s input) are kept for the backward pass as `saved_dtype` data with a float32
    scale per row (amax over the contracting axes), dequantised there (see
    `saved_in_fp8`).

    Args:
      lhs, rhs: the operands.
      dimension_numbers, precision, preferred_element_type: as for `lax.dot_general`.
      saved_dtype: the fp8 format of the kept operands.
      operands: which operands (lhs, rhs) to keep in fp8.
      inner: the `dot_general` that computes the product (and its VJP).
      **kwargs: other keywords Flax passes (`out_sharding`), given to `inner` unless None.

    Returns:
      The product, as `inner` returns it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.fp8 import fp8_saved_dot_general
      >>> x, w = jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16)
      >>> fp8_saved_dot_general(x, w, (((1,), (0,)), ((), ())),
      ...                       saved_dtype=jnp.float8_e4m3fn).shape
      (2, 4)
    """
    extra = {k: v for k, v in kwargs.items() if v is not None}
    (lc, rc), _ = dimension_numbers
    axes = (tuple(lc), tuple(rc))

    def gemm(a, b):
        return inner(a, b, dimension_numbers, precision, preferred_element_type, **extra)

    return saved_in_fp8(gemm, (lhs, rhs), operands, axes, saved_dtype)


def fp8_saved_conv(
    lhs: Any,
    rhs: Any,
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    saved_dtype: Any,
) -> jax.Array:
    """`lax.conv_general_dilated` keeping its input (`lhs`) in fp8 for the backward pass.

    A drop-in `conv_general_dilated` for Flax's `Conv`: the convolution runs as usual; the
    input is kept as `saved_dtype` data with a float32 scale per pixel (amax over the input
    features) for the weight gradient (see `saved_in_fp8`).

    Returns:
      The convolution, as `lax.conv_general_dilated` returns it.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.fp8 import fp8_saved_conv
      >>> x, w = jnp.ones((1, 8, 8, 2)), jnp.ones((3, 3, 2, 4))
      >>> fp8_saved_conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      ...                saved_dtype=jnp.float8_e4m3fn).shape
      (1, 8, 8, 4)
    """
    specs = lax.conv_dimension_numbers(np.shape(lhs), np.shape(rhs), dimension_numbers)
    feature = (specs.lhs_spec[1],)

    def conv(a, b):
        return lax.conv_general_dilated(
            a,
            b,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            specs,
            feature_group_count,
            batch_group_count,
            precision,
            preferred_element_type,
        )

    return saved_in_fp8(conv, (lhs, rhs), (True, False), (feature, None), saved_dtype)


def saved_activations_policy(base: Callable | None = None) -> Callable:
    """A `jax.checkpoint` policy that saves the fp8 activations (and what `base` saves).

    Under `jax.checkpoint`/`nn.remat` the default policy saves nothing inside the block
    (the fp8 residuals are recomputed with the rest); this one keeps them, so the weight
    gradients need no recomputation of the GEMM inputs. With `base` (e.g.
    `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`), what either saves.

    Args:
      base: another checkpoint policy (a function `(prim, *avals, **params) -> bool`), or
        None.

    Returns:
      A policy for `jax.checkpoint(..., policy=)` / `nn.remat(..., policy=)`.

    Raises:
      TypeError: `base` is neither None nor a policy function (a string, or one of
        `jax.checkpoint_policies`' factories such as `save_only_these_names` not called).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.fp8 import saved_activations_policy
      >>> f = jax.checkpoint(jnp.sin, policy=saved_activations_policy())
      >>> float(jax.grad(f)(0.0))
      1.0
    """
    _check_base(base)
    names = jax.checkpoint_policies.save_only_these_names(SAVED_FP8_NAME)
    if base is None:
        return names
    return jax.checkpoint_policies.save_from_both_policies(base, names)


# `jax.checkpoint_policies` functions that make a policy: passed uncalled, each would be
# called as the policy itself and return a (truthy) function, saving everything.
_POLICY_FACTORIES = (
    "offload_dot_with_no_batch_dims",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
)


def _check_base(base: Any) -> None:
    """Refuses a `base` that `jax.checkpoint` would only fail on (or misread) later."""
    policies = jax.checkpoint_policies
    accepts = (
        "base takes None or a checkpoint policy function (prim, *avals, **params) -> bool, "
        "e.g. jax.checkpoint_policies.dots_with_no_batch_dims_saveable"
    )
    factory = next((n for n in _POLICY_FACTORIES if base is getattr(policies, n, None)), None)
    if factory is not None:
        raise TypeError(
            f"saved_activations_policy: base=jax.checkpoint_policies.{factory} is a factory "
            f"that makes a policy, not a policy; call it (e.g. {factory}(...)); {accepts}"
        )
    if base is None or callable(base):
        return
    hint = ""
    if isinstance(base, str) and not base.startswith("_") and hasattr(policies, base):
        hint = f"; did you mean base=jax.checkpoint_policies.{base}?"
    raise TypeError(
        f"saved_activations_policy: base={excerpt(base)} ({type(base).__name__}) is not a "
        f"checkpoint policy; {accepts}{hint}"
    )
