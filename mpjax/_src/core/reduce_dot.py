"""A `dot_general` whose operand cotangents leave the GEMM in a chosen dtype (`reduce_dtype`).

Under `jax.jit` with sharded operands, the sum of a weight gradient across devices is inserted
by XLA at the output of the weight-gradient GEMM, so the dtype of that GEMM's result is the
dtype the gradient is reduce-scattered / all-reduced in. `reduce_dot_general` is
`lax.dot_general` forward (same operands, same result dtype, same program) whose backward GEMMs
for the chosen operands are bound with `preferred_element_type=reduce_dtype`: the partial
gradients are summed across devices in `reduce_dtype`, then converted once to the operand's
dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax import lax

from mpjax._src.core.sharding import transposed_sharding

__all__ = ["reduce_dot_general"]


def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def _remaining(n: int, *taken) -> list:
    drop = {d for t in taken for d in t}
    return [d for d in range(n) if d not in drop]


def _transpose_lhs(g, x, y, dims, precision, out_dtype, swap=False):
    """The cotangent of `x` in `dot_general(x, y, dims)` (JAX's transpose rule), as `out_dtype`."""
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = _remaining(x.ndim, x_contract, x_batch)
    y_kept = _remaining(y.ndim, y_contract, y_batch)
    if swap:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    g_dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    contract_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    order = list(x_batch) + x_kept + contract_by_y
    out_axes = tuple(int(i) for i in np.argsort(order))
    out = lax.dot_general(
        g,
        y,
        g_dims,
        precision=precision,
        preferred_element_type=out_dtype,
        out_sharding=transposed_sharding(x, out_axes),
    )
    return lax.transpose(out, out_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dot(lhs, rhs, dims, precision, reduce_dtype, which):
    return lax.dot_general(lhs, rhs, dims, precision=precision)


def _dot_fwd(lhs, rhs, dims, precision, reduce_dtype, which):
    return _dot(lhs, rhs, dims, precision, reduce_dtype, which), (lhs, rhs)


def _dot_bwd(dims, precision, reduce_dtype, which, res, g):
    lhs, rhs = res
    (lc, rc), (lb, rb) = dims
    lhs_dtype = reduce_dtype if which[0] else None
    rhs_dtype = reduce_dtype if which[1] else None
    d_lhs = _transpose_lhs(g, lhs, rhs, dims, precision, lhs_dtype)
    d_rhs = _transpose_lhs(g, rhs, lhs, ((rc, lc), (rb, lb)), precision, rhs_dtype, swap=True)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_dot.defvjp(_dot_fwd, _dot_bwd)


def reduce_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    reduce_dtype: Any,
    operands: tuple[bool, bool] = (False, True),
    **unused: Any,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs)` whose backward GEMMs for `operands` output `reduce_dtype`.

    The forward pass is `lax.dot_general` itself. In the backward pass, the cotangent of each
    operand marked in `operands` is computed by a GEMM with `preferred_element_type=reduce_dtype`
    (the partial sums over a sharded batch are reduced across devices in that dtype) and
    converted to the operand's dtype afterwards; the other cotangents are computed as JAX does.

    Args:
      lhs, rhs: the operands (same dtype).
      dimension_numbers, precision: as for `lax.dot_general`.
      preferred_element_type: must be None or the operands' dtype (the forward result dtype).
      reduce_dtype: the dtype of the marked operands' cotangent GEMMs.
      operands: which cotangents (lhs, rhs) to compute in `reduce_dtype`; the default marks
        the right operand (the kernel of `flax.linen.Dense`).
      unused: other `dot_general` keywords Flax may pass (ignored).

    Returns:
      The product, in the operands' dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.core.reduce_dot import reduce_dot_general
      >>> x, w = jnp.ones((4, 3), jnp.float16), jnp.ones((3, 2), jnp.float16)
      >>> f = lambda w: reduce_dot_general(x, w, (((1,), (0,)), ((), ())), reduce_dtype=jnp.float32)
      >>> jax.grad(lambda w: f(w).astype(jnp.float32).sum())(w).dtype
      dtype('float16')
    """
    del unused
    if preferred_element_type is not None and np.dtype(preferred_element_type) != lhs.dtype:
        raise ValueError(
            "reduce_dot_general: preferred_element_type must be None or the operand dtype "
            f"{lhs.dtype}, got {np.dtype(preferred_element_type)}"
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(
            f"reduce_dot_general: operands must share a dtype, got {lhs.dtype} and {rhs.dtype}"
        )
    dims = tuple(tuple(tuple(int(d) for d in a) for a in pair) for pair in dimension_numbers)
    return _dot(lhs, rhs, dims, precision, np.dtype(reduce_dtype), tuple(bool(o) for o in operands))
