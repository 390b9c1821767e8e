"""Sharding types of hand-written gradients: what a backward GEMM's `out_sharding` must be.

Under a mesh with Explicit axes (`jax.make_mesh`'s default) a sharding is part of a value's
type, and a GEMM whose contracting axes are sharded on both operands needs its output
sharding spelled out. JAX's own transpose of `dot_general` gives the cotangent of an operand
that operand's sharding; the hand-written backward passes (fp8, `reduce_dtype`) do the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["transposed_sharding"]


def transposed_sharding(x: Any, out_axes: Sequence[int]) -> Any:
    """The `out_sharding` of a GEMM whose result, transposed by `out_axes`, is typed like `x`.

    `x`'s sharding with its spec permuted into the GEMM's axis order (the GEMM's axis
    `out_axes[i]` becomes `x`'s axis `i`), as JAX's transpose of `dot_general` does; None
    off a mesh (the default sharding).

    Args:
      x: the operand whose cotangent the GEMM computes (an array or tracer).
      out_axes: the permutation `jnp.transpose(gemm_result, out_axes)` applies.

    Returns:
      A `NamedSharding` or None.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.core.sharding import transposed_sharding
      >>> transposed_sharding(jnp.ones((2, 3)), (1, 0)) is None
      True
    """
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (np.ndim(x) - len(sharding.spec))
    order = np.argsort(out_axes)  # the x axis that each GEMM result axis becomes
    permuted = tuple(spec[int(i)] for i in order)
    return sharding.update(spec=sharding.spec.update(partitions=permuted))
