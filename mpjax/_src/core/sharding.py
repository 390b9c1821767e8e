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

__all__ = ["match_varying", "transposed_sharding"]


def match_varying(*xs: Any) -> tuple:
    """`xs`, each made varying over every manual mesh axis any of them varies over.

    Inside `jax.shard_map(check_vma=True)` a hand-written `custom_vjp` GEMM of a varying
    activation and an invariant weight would return a varying weight gradient for an
    invariant input, which JAX rejects. JAX's own `dot_general` marks the weight varying
    first (`pcast(..., to="varying")`), whose transpose sums the gradient over the axes;
    this does the same. Outside `shard_map` (no manual axes) it returns `xs` unchanged.
    """
    vmas = [frozenset(jax.typeof(x).mat.varying) for x in xs]
    union = frozenset().union(*vmas)
    if not union:
        return tuple(xs)
    return tuple(
        x if vma == union else jax.lax.pcast(x, tuple(sorted(union - vma)), to="varying")
        for x, vma in zip(xs, vmas, strict=True)
    )


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
