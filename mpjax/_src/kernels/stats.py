"""Per-channel statistics of a channels-last tensor: sum and sum of squares in float32.

With these, a training-mode BatchNorm reads the conv output once for its statistics and once
for the fused epilogue (`conv_epilogue`). The kernel reduces each row group to partial sums
`(groups, C)` that are added up outside the kernel, so no accumulator is shared between grid
steps. Differentiable: the cotangent of `y` is `dsum + 2 * y * dsumsq`, one XLA elementwise op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mpjax._src.kernels.common import (
    MAX_ELEMENTS,
    channel_tiles,
    check_channels_last,
    compiler_params,
    compute_dtype,
    offsets,
    row_groups,
)
from mpjax._src.kernels.dispatch import dispatch
from mpjax._src.kernels.sharded import per_row_shard

__all__ = ["channel_stats", "channel_stats_reference"]


def channel_stats(y: jax.Array, *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Per-channel `(sum, sum of squares)` over every axis but the last, in float32.

    Args:
      y: a channels-last array `(..., C)`, e.g. NHWC, in bf16/fp16/fp32 (float64 stays
        float64).
      impl: "auto", "pallas", "interpret" or "xla"; see `mpjax._src.kernels.dispatch`.

    Returns:
      `(sum, sumsq)`, each of shape `(C,)`; differentiable in `y`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.pallas import channel_stats
      >>> s, ss = channel_stats(jnp.ones((2, 4, 4, 8), jnp.bfloat16))
      >>> mean, var = s / 32, ss / 32 - (s / 32) ** 2
    """
    y = check_channels_last("channel_stats", "y", y)
    channels = y.shape[-1]
    unsupported = None
    if y.size == 0 or y.size > MAX_ELEMENTS:
        unsupported = f"y has {y.size} elements (the kernel takes 1 to 2**31 - 1)"
    return dispatch(
        "channel_stats",
        impl,
        (y.reshape(-1, channels),),
        kernel=_stats_pallas,
        reference=channel_stats_reference,
        unsupported=unsupported,
    )


def channel_stats_reference(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The plain `jax.numpy` statistics (the "xla" implementation) of an (R, C) array."""
    yc = y.astype(compute_dtype(y.dtype))
    return jnp.sum(yc, axis=0), jnp.sum(jnp.square(yc), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _stats_pallas(y, interpret):
    return _stats_sharded(y, interpret)


def _stats_fwd(y, interpret):
    return _stats_sharded(y, interpret), y


def _stats_bwd(interpret, y, cotangents):
    del interpret
    dsum, dsumsq = cotangents
    yc = y.astype(compute_dtype(y.dtype))
    return ((dsum[None, :] + dsumsq[None, :] * (2 * yc)).astype(y.dtype),)


_stats_pallas.defvjp(_stats_fwd, _stats_bwd)


def _stats_sharded(y, interpret):
    """The kernel on each device's rows of `y`, the per-channel sums added over devices."""
    kernel = lambda rows, vectors: ([], list(_stats_call(rows[0], interpret)))
    return tuple(per_row_shard(kernel, [y], [], n_row_outputs=0, n_sums=2)[1])


def _stats_call(y, interpret):
    rows, channels = y.shape
    block_r, block_c = channel_tiles(rows, channels)
    groups, steps = row_groups(rows, block_r)
    cd = compute_dtype(y.dtype)
    shape = (block_r, block_c)

    def kernel(y_ref, sum_ref, sumsq_ref):
        gi, j = pl.program_id(0), pl.program_id(1)
        col_ok = offsets(block_c, 1, shape, j) < channels

        def step(t, acc):
            acc_sum, acc_sumsq = acc
            mask = (offsets(block_r, 0, shape, gi * steps + t) < rows) & col_ok
            part = (pl.ds(t * block_r, block_r), slice(None))
            yv = pltriton.load(y_ref.at[part], mask=mask, other=0).astype(cd)
            yv = jnp.where(mask, yv, 0)
            return acc_sum + jnp.sum(yv, axis=0), acc_sumsq + jnp.sum(yv * yv, axis=0)

        zero = jnp.zeros((block_c,), cd)
        acc_sum, acc_sumsq = jax.lax.fori_loop(0, steps, step, (zero, zero))
        out_mask = offsets(block_c, 1, (1, block_c), j) < channels
        pltriton.store(sum_ref, acc_sum[None, :], mask=out_mask)
        pltriton.store(sumsq_ref, acc_sumsq[None, :], mask=out_mask)

    part = pl.BlockSpec((1, block_c), lambda i, j: (i, j))
    partial_sum, partial_sumsq = pl.pallas_call(
        kernel,
        grid=(groups, pl.cdiv(channels, block_c)),
        in_specs=[pl.BlockSpec((steps * block_r, block_c), lambda i, j: (i, j))],
        out_specs=[part, part],
        out_shape=[jax.ShapeDtypeStruct((groups, channels), cd)] * 2,
        interpret=interpret,
        compiler_params=None if interpret else compiler_params(num_warps=4),
        name="mpjax_channel_stats",
    )(y)
    return jnp.sum(partial_sum, axis=0), jnp.sum(partial_sumsq, axis=0)
