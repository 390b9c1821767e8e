"""The XLA finite check of a gradient pytree: a few variadic max-|g| reductions, not one per leaf.

`any g / scale is not finite` is `max|g| * (1 / scale)` not finite: the product rounds
monotonically in |g|, so the largest |g| overflows iff any does; NaN is counted as inf
before the max (a max reduction need not propagate NaN). Each leaf is read once in its own dtype, so
XLA fuses a producer (the `convert` of a float16 gradient to float32) into the reduction,
which a Pallas custom call cannot absorb.

Leaves of the same size and dtype go into one variadic `lax.reduce` whose reducer keeps the
joint maximum in every accumulator (XLA emits one kernel per such reduce, where a reduction
per leaf would cost a kernel each). Leaves above `ROW_LIMIT` elements are first reduced over
their last axis to a vector of their leading size, also one variadic reduce per shape (row
reductions: a column reduction of many operands overflows shared memory): XLA would otherwise
split each large reduction into two kernels, and the vectors join the group of the leaves of
the same size (a Dense kernel's joins its layer's bias when the layer is square).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import jax
import jax.numpy as jnp

from mpjax._src.core.dtypes import wide_dtype

__all__ = ["grouped_all_finite"]

# A leaf (of rank >= 2) with more elements is first reduced over its last axis.
ROW_LIMIT = 8192
# Operands per variadic reduce.
MAX_OPERANDS = 128


def _joint_max(accs: tuple, xs: tuple) -> tuple:
    m = functools.reduce(jnp.maximum, [*accs, *xs])
    return tuple(m for _ in accs)


def _magnitude(x: jax.Array) -> jax.Array:
    x = x.astype(wide_dtype(x.dtype))  # widened in registers (XLA:GPU fuses half selects badly)
    return jnp.where(jnp.isnan(x), jnp.array(jnp.inf, x.dtype), jnp.abs(x))


def _reduce(xs: list, axis: int) -> list:
    """Joint max |x| over `axis` of same-shaped, same-dtype `xs`, MAX_OPERANDS at a time."""
    out = []
    for c in range(0, len(xs), MAX_OPERANDS):
        # |x| (NaN as inf) outside the reducer: XLA may rewrite a reduce over one element as
        # the element, and a max reduction need not propagate NaN (XLA:CPU's does not).
        chunk = [_magnitude(x) for x in xs[c : c + MAX_OPERANDS]]
        zero = jnp.zeros((), chunk[0].dtype)
        out.append(jax.lax.reduce(chunk, [zero] * len(chunk), _joint_max, (axis,))[0])
    return out


def grouped_all_finite(grads: list, scale: jax.Array) -> jax.Array:
    """Whether every `g * (1 / scale)` of the floating arrays `grads` is finite.

    Args:
      grads: a list of floating arrays (any shapes, float16/bfloat16/float32/float64).
      scale: the float32 scalar loss scale.

    Returns:
      A scalar bool array; the product is formed in float32 (float64 for float64 leaves).
    """
    rows: dict = defaultdict(list)
    flat: dict = defaultdict(list)
    for g in grads:
        if g.size == 0:
            continue
        if g.size > ROW_LIMIT and g.ndim >= 2:
            rows[(g.size // g.shape[-1], g.shape[-1], g.dtype)].append(g.reshape(-1, g.shape[-1]))
        else:
            flat[(g.size, g.dtype)].append(g.reshape(-1))
    for (n, _, dtype), xs in rows.items():
        flat[(n, dtype)].extend(_reduce(xs, 1))
    maxima: dict = defaultdict(list)
    for (_, dtype), xs in sorted(flat.items(), key=str):
        wide = wide_dtype(dtype)
        maxima[wide].extend(m.astype(wide) for m in _reduce(xs, 0))
    ok = jnp.array(True)
    for wide, ms in maxima.items():
        inverse = 1 / scale.astype(wide)
        ok = ok & jnp.isfinite(functools.reduce(jnp.maximum, ms) * inverse)
    return ok
