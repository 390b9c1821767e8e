"""`quantize_orientations`: a 2-D tensor block-quantised once for every GEMM that reads it.

A GEMM operand `x` of shape `[M, K]` is read by the forward GEMM along `K` (its *rows*
orientation: blocks along `K`) and by a backward GEMM along `M` (its *columns* orientation,
stored transposed as `[K, M]` with blocks along `M`, so that every GEMM reads a row-major
`[free, contracted]` operand). Transformer Engine calls this layout `ROWWISE_COLWISE`.

`quantize_orientations` makes both copies from one read of `x`: no bfloat16 or float32
transpose of `x` (the columns copy is quantised along axis 0 and transposed in its 8-bit or
4-bit form), and for 2-D weight blocks (NVFP4 16x16, blockwise 128x128) the columns copy is
the rows copy transposed, scales included, as DeepSeek-V3 relies on. Each copy is bit for bit
`quantize_blocks` of the oriented tensor:

- `rows == quantize_blocks(x, recipe, axis=1, role=role)`;
- `columns == quantize_blocks(c, recipe, axis=1, role=role)` with `c = x.T`, or
  `random_hadamard(x.T, 1)` when `column_hadamard` (NVFP4's weight-gradient operands), its
  NVFP4 elements rounded stochastically with the draws `hash_uniform(column_seed, i)` of each
  element's row-major index `i` in `c` when a seed is given.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from mpjax._src.fp8.block_quantize_kernel import quantize_orientations_kernel, unsupported
from mpjax._src.fp8.blocks import (
    BlockQuantized,
    _scaling_of,
    block_shape,
    hash_uniform,
    quantize_with_blocks,
)
from mpjax._src.fp8.hadamard import random_hadamard
from mpjax._src.fp8.oriented import OrientedBlocks
from mpjax._src.kernels.dispatch import check_impl, dispatch

__all__ = ["QUANTIZE_NAME", "OrientedBlocks", "quantize_orientations", "transpose_blocks"]

QUANTIZE_NAME = "block_quantize"  # the name of the quantise call in a jaxpr (one per tensor)


def transpose_blocks(q: BlockQuantized) -> BlockQuantized:
    """A 2-D `BlockQuantized` transposed: data, scales and block sizes (same numbers)."""
    return BlockQuantized(q.data.T, q.scales.T, q.tensor_scale, block=q.block[::-1])


def _column_draws(seed: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """NVFP4 draws for the columns copy, laid out `[M, K]`: element `(m, k)` gets the draw of
    its row-major index `k * M + m` in the `[K, M]` copy (no transpose needed)."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    return hash_uniform(seed, cols * jnp.uint32(shape[0] % 2**32) + rows)


def _reference(x, scaling, power_of_two, role, rows, columns, column_hadamard, column_seed):
    """The XLA implementation: one read of `x` per orientation, no wide transpose."""
    out_rows = None
    if rows or (columns and _two_d(scaling, role)):
        out_rows = quantize_with_blocks(x, scaling, block_shape(scaling, 2, 1, role), power_of_two)
    if not columns:
        return OrientedBlocks(out_rows, None)
    if _two_d(scaling, role) and not column_hadamard:
        return OrientedBlocks(out_rows if rows else None, transpose_blocks(out_rows))
    c = random_hadamard(x, 0) if column_hadamard else x  # [M (padded), K]
    draws = None if column_seed is None else _column_draws(column_seed, c.shape)
    col = quantize_with_blocks(c, scaling, block_shape(scaling, 2, 0, role), power_of_two, draws)
    return OrientedBlocks(out_rows if rows else None, transpose_blocks(col))


def _two_d(scaling: str, role: str) -> bool:
    return block_shape(scaling, 2, 1, role)[0] > 1


def quantize_orientations(
    x: jax.Array,
    recipe: Any,
    *,
    role: str = "activation",
    rows: bool = True,
    columns: bool = True,
    column_hadamard: bool = False,
    column_seed: jax.Array | None = None,
    impl: str = "xla",
) -> OrientedBlocks:
    """Block-quantises a 2-D `x` `[M, K]` along `K` (rows) and along `M` (columns), once.

    Args:
      x: a 2-D floating array.
      recipe: a block-scaled `Fp8Recipe` (or its scaling's name).
      role: `"activation"`, `"weight"` (2-D blocks for NVFP4 and blockwise) or `"gradient"`.
      rows: make the rows copy (`x` along `K`).
      columns: make the columns copy (`x^T` along `M`).
      column_hadamard: rotate the columns copy with `random_hadamard` along `M` first (its
        `M` is then padded to a multiple of 16).
      column_seed: a uint32 seed: round the columns copy's NVFP4 elements stochastically.
      impl: `"xla"` (the reference), `"pallas"` (the fused kernel,
        `mpjax._src.fp8.block_quantize_kernel`: one read of `x` writes both copies), `"interpret"`
        (that kernel in Pallas interpret mode) or `"auto"` (the kernel on CUDA GPUs, the
        reference elsewhere); inputs the kernel does not take (dtypes other than bfloat16
        and float32, odd NVFP4 extents) go to the reference under `"auto"`.

    Returns:
      An `OrientedBlocks`; each copy equals `quantize_blocks` of the oriented tensor.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.fp8 import quantize_orientations
      >>> q = quantize_orientations(jnp.ones((64, 32)), "mxfp8")
      >>> q.rows.data.shape, q.columns.data.shape, q.columns.scales.shape
      ((64, 32), (32, 64), (32, 2))
    """
    scaling, power_of_two = _scaling_of(recipe)
    x = jnp.asarray(x)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"quantize_orientations: x must be a 2-D floating array, got {x.dtype}{list(x.shape)}"
        )
    if not (rows or columns):
        raise ValueError("quantize_orientations: rows=False and columns=False: nothing to make")
    if column_seed is not None and scaling != "nvfp4":
        raise ValueError(
            f"quantize_orientations: column_seed (stochastic rounding) applies to 'nvfp4' only; "
            f"{scaling} rounds to nearest even"
        )
    block_shape(scaling, 2, 1, role)  # validates role
    check_impl(impl, "quantize_orientations")

    def reference(x, column_seed):
        return _reference(
            x, scaling, power_of_two, role, rows, columns, column_hadamard, column_seed
        )

    kernel = functools.partial(
        quantize_orientations_kernel,
        scaling=scaling,
        power_of_two=power_of_two,
        role=role,
        rows=rows,
        columns=columns,
        column_hadamard=column_hadamard,
    )
    reason = unsupported(x, scaling, role, rows, columns, column_hadamard)

    def block_quantize(x, column_seed):
        return dispatch(
            "quantize_orientations",
            impl,
            (x, column_seed),
            kernel=kernel,
            reference=reference,
            unsupported=reason,
        )

    block_quantize.__name__ = QUANTIZE_NAME
    return jax.jit(block_quantize)(x, column_seed)
