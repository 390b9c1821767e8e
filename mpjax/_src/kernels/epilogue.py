"""Fused conv epilogue `act(y * scale + shift + residual)` for channels-last (NHWC) tensors.

The BatchNorm-apply (or bias) + residual add + activation tail of a ResNet block, in one read of
`y` (and `residual`) and one write. Trainable: a `jax.custom_vjp` whose backward is a second
Pallas kernel that recomputes the pre-activation from `y` and `residual`, writes `dy` and
`dresidual`, and reduces `dscale` and `dshift` per channel as per-row-group partial sums (summed
outside the kernel, so no accumulator is shared between grid steps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mpjax._src.kernels.common import (
    MAX_ELEMENTS,
    channel_tiles,
    check_channels_last,
    compiler_params,
    offsets,
    row_groups,
)
from mpjax._src.kernels.dispatch import dispatch
from mpjax._src.kernels.sharded import per_row_shard

__all__ = ["ACTIVATIONS", "conv_epilogue", "conv_epilogue_reference"]

ACTIVATIONS = ("relu", "none", "silu")


def conv_epilogue(
    y: jax.Array,
    scale: jax.Array,
    shift: jax.Array,
    residual: jax.Array | None = None,
    *,
    activation: str = "relu",
    out_dtype=None,
    impl: str = "auto",
) -> jax.Array:
    """Computes `act(y * scale + shift + residual)` in float32 and writes `out_dtype`.

    Args:
      y: a channels-last array `(..., C)`, e.g. an NHWC conv output, in bf16/fp16/fp32.
      scale: per-channel multiplier, shape `(C,)`.
      shift: per-channel offset, shape `(C,)`.
      residual: None, or an array of `y`'s shape added before the activation.
      activation: "relu", "none" or "silu".
      out_dtype: the output dtype; None means `y.dtype`.
      impl: "auto", "pallas", "interpret" or "xla"; see `mpjax._src.kernels.dispatch`.

    Returns:
      An array of `y`'s shape and `out_dtype`, differentiable in `y`, `scale`, `shift` and
      `residual`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax.pallas import conv_epilogue
      >>> y = jnp.ones((2, 4, 4, 8), jnp.bfloat16)
      >>> out = conv_epilogue(y, jnp.ones(8), jnp.zeros(8), y, activation="relu")
    """
    where = "conv_epilogue"
    y = check_channels_last(where, "y", y)
    channels = y.shape[-1]
    scale = check_channels_last(where, "scale", scale, channels)
    shift = check_channels_last(where, "shift", shift, channels)
    if scale.ndim != 1 or shift.ndim != 1:
        raise ValueError(
            f"{where}: scale and shift must have shape ({channels},), "
            f"got {scale.shape} and {shift.shape}"
        )
    if residual is not None:
        residual = check_channels_last(where, "residual", residual)
        if residual.shape != y.shape:
            raise ValueError(f"{where}: residual has shape {residual.shape}, y has shape {y.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    out_dtype = np.dtype(y.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"{where}: out_dtype must be floating, got {out_dtype}")

    unsupported = None
    if y.size == 0 or y.size > MAX_ELEMENTS:
        unsupported = f"y has {y.size} elements (the kernel takes 1 to 2**31 - 1)"
    flat = (y.reshape(-1, channels), scale, shift)
    res = None if residual is None else residual.reshape(-1, channels)
    out = dispatch(
        where,
        impl,
        (*flat, res),
        kernel=functools.partial(_epilogue_pallas, activation, out_dtype),
        reference=functools.partial(
            conv_epilogue_reference, activation=activation, out_dtype=out_dtype
        ),
        unsupported=unsupported,
    )
    return out.reshape(y.shape)


def _compute_dtype(*arrays) -> np.dtype:
    dtypes = [a.dtype for a in arrays if a is not None]
    return np.dtype(jnp.result_type(jnp.float32, *dtypes))


# Activations that commute with rounding to a narrower float (monotone, exact at 0).
_COMMUTES_WITH_ROUNDING = frozenset({"relu", "none"})


def _activate(z: jax.Array, activation: str) -> jax.Array:
    if activation == "relu":
        return jax.nn.relu(z)
    if activation == "silu":
        return z * jax.nn.sigmoid(z)
    return z


@jax.custom_jvp
def _pinned_relu(z: jax.Array) -> jax.Array:
    """`max(z, 0)`, materialised, with a derivative that reads that output (`out > 0`).

    The output is the next layer's input, kept for the backward pass anyway. Pinning it
    (an optimization barrier) and deriving the mask from it makes it the one saved buffer:
    with `jax.nn.relu` (mask `z > 0`), XLA:GPU writes the pre-activation `z` beside the
    output and recomputes the output from `z` in its consumers, one more activation-sized
    buffer per residual block held until the backward pass.
    """
    return _max0_pinned(z)


def _max0_pinned(z: jax.Array) -> jax.Array:
    return jax.lax.optimization_barrier(jnp.maximum(z, jnp.zeros((), z.dtype)))


@_pinned_relu.defjvp
def _pinned_relu_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    out = _max0_pinned(z)
    return out, jnp.where(out > 0, t, jnp.zeros_like(t))


def _activate_grad(z: jax.Array, g: jax.Array, activation: str) -> jax.Array:
    """The cotangent of `z` given the cotangent `g` of `act(z)`, as JAX's autodiff forms it."""
    if activation == "relu":
        return jnp.where(z > 0, g, jnp.zeros_like(g))
    if activation == "silu":
        s = jax.nn.sigmoid(z)
        return g * s + (g * z) * (s * (1 - s))
    return g


def conv_epilogue_reference(y, scale, shift, residual=None, *, activation="relu", out_dtype=None):
    """The plain `jax.numpy` epilogue (the "xla" implementation), differentiated by JAX."""
    cd = _compute_dtype(y, scale, shift, residual)
    out_dtype = y.dtype if out_dtype is None else out_dtype
    z = y.astype(cd) * scale.astype(cd) + shift.astype(cd)
    if residual is not None:
        z = z + residual.astype(cd)
    if activation in _COMMUTES_WITH_ROUNDING:
        # relu(round(z)) == round(relu(z)) exactly; activating after the cast keeps the
        # backward pass in `out_dtype`, not float32. The relu's mask is read from its
        # output (see `_pinned_relu`).
        z = z.astype(out_dtype)
        return _pinned_relu(z) if activation == "relu" else z
    return _activate(z, activation).astype(out_dtype)


def _epilogue_pallas(activation, out_dtype, y, scale, shift, residual, *, interpret):
    return _epilogue_vjp(y, scale, shift, residual, activation, out_dtype, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _epilogue_vjp(y, scale, shift, residual, activation, out_dtype, interpret):
    return _forward_sharded(y, scale, shift, residual, activation, out_dtype, interpret)


def _epilogue_fwd(y, scale, shift, residual, activation, out_dtype, interpret):
    out = _forward_sharded(y, scale, shift, residual, activation, out_dtype, interpret)
    return out, (y, scale, shift, residual)


def _epilogue_bwd(activation, out_dtype, interpret, saved, g):
    y, scale, shift, residual = saved
    return _backward_sharded(y, scale, shift, residual, g, activation, interpret)


def _forward_sharded(y, scale, shift, residual, activation, out_dtype, interpret):
    """The forward kernel on each device's rows (data parallelism keeps the batch split)."""
    rows = [y] if residual is None else [y, residual]

    def kernel(rows, vectors):
        res = rows[1] if len(rows) > 1 else None
        out = _forward_call(rows[0], *vectors, res, activation, out_dtype, interpret)
        return [out], []

    return per_row_shard(kernel, rows, [scale, shift], n_row_outputs=1, n_sums=0)[0][0]


def _backward_sharded(y, scale, shift, residual, g, activation, interpret):
    """The backward kernel on each device's rows; `dscale` and `dshift` summed over devices."""
    rows = [y, g] if residual is None else [y, g, residual]

    def kernel(rows, vectors):
        res = rows[2] if len(rows) > 2 else None
        dy, dsc, dsh, dres = _backward_call(rows[0], *vectors, res, rows[1], activation, interpret)
        return [dy] + ([] if res is None else [dres]), [dsc, dsh]

    n_out = len(rows) - 1
    outs, (dscale, dshift) = per_row_shard(
        kernel, rows, [scale, shift], n_row_outputs=n_out, n_sums=2
    )
    dres = outs[1] if residual is not None else None
    return outs[0], dscale.astype(scale.dtype), dshift.astype(shift.dtype), dres


_epilogue_vjp.defvjp(_epilogue_fwd, _epilogue_bwd)


def _channel_vector(ref, block_c: int, c_block, channels: int, cd):
    mask = offsets(block_c, 0, (block_c,), c_block) < channels
    return pltriton.load(ref, mask=mask, other=0).astype(cd)[None, :]


def _forward_call(y, scale, shift, residual, activation, out_dtype, interpret):
    rows, channels = y.shape
    block_r, block_c = channel_tiles(rows, channels)
    cd = _compute_dtype(y, scale, shift, residual)
    has_res = residual is not None
    shape = (block_r, block_c)

    def kernel(*refs):
        y_ref, scale_ref, shift_ref = refs[:3]
        res_ref = refs[3] if has_res else None
        o_ref = refs[-1]
        i, j = pl.program_id(0), pl.program_id(1)
        mask = (offsets(block_r, 0, shape, i) < rows) & (offsets(block_c, 1, shape, j) < channels)
        sc = _channel_vector(scale_ref, block_c, j, channels, cd)
        sh = _channel_vector(shift_ref, block_c, j, channels, cd)
        z = pltriton.load(y_ref, mask=mask, other=0).astype(cd) * sc + sh
        if has_res:
            z = z + pltriton.load(res_ref, mask=mask, other=0).astype(cd)
        pltriton.store(o_ref, _activate(z, activation).astype(out_dtype), mask=mask)

    tile = pl.BlockSpec(shape, lambda i, j: (i, j))
    vec = pl.BlockSpec((block_c,), lambda i, j: (j,))
    operands = (y, scale, shift) + ((residual,) if has_res else ())
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block_r), pl.cdiv(channels, block_c)),
        in_specs=[tile, vec, vec] + ([tile] if has_res else []),
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(y.shape, out_dtype),
        interpret=interpret,
        compiler_params=None if interpret else compiler_params(num_warps=4),
        name="mpjax_conv_epilogue_fwd",
    )(*operands)


def _backward_call(y, scale, shift, residual, g, activation, interpret):
    rows, channels = y.shape
    block_r, block_c = channel_tiles(rows, channels)
    groups, steps = row_groups(rows, block_r)
    cd = _compute_dtype(y, scale, shift, residual)
    has_res = residual is not None
    shape = (block_r, block_c)

    def kernel(*refs):
        y_ref, scale_ref, shift_ref = refs[:3]
        res_ref = refs[3] if has_res else None
        g_ref = refs[3 + has_res]
        dy_ref = refs[4 + has_res]
        dres_ref = refs[5 + has_res] if has_res else None
        dscale_ref, dshift_ref = refs[-2:]
        gi, j = pl.program_id(0), pl.program_id(1)
        col_ok = offsets(block_c, 1, shape, j) < channels
        sc = _channel_vector(scale_ref, block_c, j, channels, cd)
        sh = _channel_vector(shift_ref, block_c, j, channels, cd)

        def step(t, acc):
            acc_scale, acc_shift = acc
            mask = (offsets(block_r, 0, shape, gi * steps + t) < rows) & col_ok
            part = (pl.ds(t * block_r, block_r), slice(None))
            yv = pltriton.load(y_ref.at[part], mask=mask, other=0).astype(cd)
            z = yv * sc + sh
            if has_res:
                z = z + pltriton.load(res_ref.at[part], mask=mask, other=0).astype(cd)
            gv = pltriton.load(g_ref.at[part], mask=mask, other=0).astype(cd)
            dz = jnp.where(mask, _activate_grad(z, gv, activation), 0)
            pltriton.store(dy_ref.at[part], (dz * sc).astype(y.dtype), mask=mask)
            if has_res:
                pltriton.store(dres_ref.at[part], dz.astype(residual.dtype), mask=mask)
            return acc_scale + jnp.sum(dz * yv, axis=0), acc_shift + jnp.sum(dz, axis=0)

        zero = jnp.zeros((block_c,), cd)
        acc_scale, acc_shift = jax.lax.fori_loop(0, steps, step, (zero, zero))
        out_mask = offsets(block_c, 1, (1, block_c), j) < channels
        pltriton.store(dscale_ref, acc_scale[None, :], mask=out_mask)
        pltriton.store(dshift_ref, acc_shift[None, :], mask=out_mask)

    grid = (groups, pl.cdiv(channels, block_c))
    tile = pl.BlockSpec((steps * block_r, block_c), lambda i, j: (i, j))
    vec = pl.BlockSpec((block_c,), lambda i, j: (j,))
    part = pl.BlockSpec((1, block_c), lambda i, j: (i, j))
    operands = (y, scale, shift) + ((residual,) if has_res else ()) + (g,)
    out_shape = [jax.ShapeDtypeStruct(y.shape, y.dtype)]
    if has_res:
        out_shape.append(jax.ShapeDtypeStruct(residual.shape, residual.dtype))
    out_shape += [jax.ShapeDtypeStruct((groups, channels), cd)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[tile, vec, vec] + ([tile] if has_res else []) + [tile],
        out_specs=[tile] + ([tile] if has_res else []) + [part, part],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else compiler_params(num_warps=4),
        name="mpjax_conv_epilogue_bwd",
    )(*operands)
    dy, dres = outs[0], (outs[1] if has_res else None)
    # In the compute dtype: the sums of the shards are added up across devices first.
    return dy, jnp.sum(outs[-2], axis=0), jnp.sum(outs[-1], axis=0), dres
