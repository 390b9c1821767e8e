"""Dimension numbers of the two backward GEMMs of a `dot_general` (its transpose rule)."""

from __future__ import annotations

import numpy as np

__all__ = ["free_axes", "grad_lhs_layout", "grad_rhs_layout"]


def free_axes(ndim: int, contract, batch) -> list[int]:
    """The axes of an operand that are neither contracted nor batch axes, in order."""
    return [i for i in range(ndim) if i not in contract and i not in batch]


def grad_lhs_layout(dims, x_ndim, y_ndim):
    """Dimension numbers of `g . y` giving d/dx of `dot_general(x, y)` and the transpose after.

    The transpose rule of `dot_general` (as in JAX): contract the cotangent's y-free axes
    with y's free axes, then permute the result into x's axis order.
    """
    (xc, yc), (xb, yb) = dims
    x_kept, y_kept = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    start = nb + len(x_kept)
    ans_y = tuple(range(start, start + len(y_kept)))
    gdims = ((ans_y, tuple(y_kept)), (tuple(range(nb)), tuple(yb)))
    x_contract_by_y = [xc[i] for i in np.argsort(yc)]
    out_axes = tuple(int(i) for i in np.argsort(list(xb) + x_kept + x_contract_by_y))
    return gdims, out_axes


def grad_rhs_layout(dims, x_ndim, y_ndim):
    """Dimension numbers of `x . g` giving d/dy of `dot_general(x, y)` and the transpose after.

    `x` comes first so that a weight gradient leaves the GEMM in the weight's own axis
    order (for `x @ w`: `x^T g` is `[K, N]`, no transpose), which keeps XLA from copying
    the optimizer's outputs into the parameters' layout.
    """
    (xc, yc), (xb, yb) = dims
    x_kept, y_kept = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    ans_x = tuple(range(nb, nb + len(x_kept)))
    gdims = ((tuple(x_kept), ans_x), (tuple(xb), tuple(range(nb))))
    y_contract_by_x = [yc[i] for i in np.argsort(xc)]
    out_axes = tuple(int(i) for i in np.argsort(list(yb) + y_contract_by_x + y_kept))
    return gdims, out_axes
