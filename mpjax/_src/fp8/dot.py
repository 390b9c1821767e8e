"""`fp8_dot_general`: a `dot_general` whose forward and both backward GEMMs run in float8.

The GEMMs are `lax.dot_general(q_a, q_b, preferred_element_type=compute)` on fp8 operands,
the form XLA:GPU compiles to an fp8 tensor-core GEMM with default flags (the dequantise
form `(q_a -> bf16 * s_a) @ (q_b -> bf16 * s_b)` becomes a bf16 GEMM under Triton). The
scales are divided out of the GEMM's output afterwards (a scalar, or an outer product of
per-row scales for rowwise).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.core.sharding import match_varying, transposed_sharding
from mpjax._src.fp8.block_dot import block_scaled_dot_general
from mpjax._src.fp8.blocks import BLOCK_SCALINGS
from mpjax._src.fp8.choose import COMPUTE, choose_gemm_format, recipe_for_format
from mpjax._src.fp8.layouts import free_axes, grad_lhs_layout, grad_rhs_layout
from mpjax._src.fp8.quant import amax, compute_scale, quantize
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["fp8_dot_general", "fp8_eligible"]

_F32 = jnp.float32


_free = free_axes


def fp8_eligible(recipe: Fp8Recipe, site: Fp8Site) -> bool:
    """Whether a `dot_general` runs in fp8 under `recipe` (else it stays in the compute dtype).

    Eligible: no batch dimensions (attention's score and value products stay in the compute
    dtype, as in Transformer Engine and torchao, which put only linear layers in fp8); the
    contracting size and each operand's free size at least `recipe.min_dim` and multiples
    of 16 (fp8 tensor-core GEMMs need 16-aligned sizes); not excluded by the recipe.
    """
    (lc, rc), (lb, _) = site.dimension_numbers
    if lb:
        return False
    lhs, rhs = site.lhs_shape, site.rhs_shape
    k = math.prod(lhs[i] for i in lc)
    m = math.prod(lhs[i] for i in _free(len(lhs), lc, ()))
    n = math.prod(rhs[i] for i in _free(len(rhs), rc, ()))
    if any(s < recipe.min_dim or s % 16 for s in (k, m, n)):
        return False
    return not recipe.excludes(site)


def _quantize(x, contract, dtype, recipe: Fp8Recipe, source=None):
    """Quantises `x` for a GEMM contracting `contract`: returns (q, float32 scale).

    `source` (default `x`) is what is quantised with the scale of `x`'s amax: a float32
    recomputation of `x` (see `mpjax._src.autocast.fp8_recompute`).
    """
    axis = tuple(contract) if recipe.scaling == "rowwise" else None
    scale = compute_scale(amax(x, axis), dtype, recipe.margin, recipe.power_of_two)
    return quantize(x if source is None else source, scale, dtype), scale


def _to_out(scale, ndim, contract, batch, positions, out_shape):
    """Places an operand's (keepdims) scale onto the GEMM output's axes."""
    if scale.ndim == 0:
        return scale
    perm = list(batch) + _free(ndim, contract, batch) + list(contract)
    kept = jnp.transpose(scale, perm).reshape(
        [scale.shape[p] for p in perm][: ndim - len(contract)]
    )
    return lax.broadcast_in_dim(kept, out_shape, tuple(positions))


def scaled_gemm(qa, sa, qb, sb, dims, out_dtype, out_sharding=None):
    """`dot_general(qa, qb) / (sa * sb)` with fp8 operands, returned in `out_dtype`.

    `out_sharding` is the GEMM's (a backward GEMM's: see `transposed_sharding`).
    """
    (lc, rc), (lb, rb) = dims
    # The unscaled product reaches 448 * 448 * K: float16 would overflow before the rescale
    # (bf16 has float32's range), so a float16 result accumulates in float32.
    wide = jnp.float32 if np.dtype(out_dtype) == np.float16 else out_dtype
    out = lax.dot_general(qa, qb, dims, preferred_element_type=wide, out_sharding=out_sharding)
    nb, nl = len(lb), len(_free(qa.ndim, lc, lb))
    nr = out.ndim - nb - nl
    inv_a = _to_out(1 / sa, qa.ndim, lc, lb, [*range(nb), *range(nb, nb + nl)], out.shape)
    inv_b = _to_out(1 / sb, qb.ndim, rc, rb, [*range(nb), *range(nb + nl, nb + nl + nr)], out.shape)
    return (out.astype(_F32) * (inv_a * inv_b)).astype(out_dtype)


def fp8_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    recipe: Fp8Recipe,
    compute_dtype: Any,
    lhs_quant=None,
    rhs_copies=None,
):
    """`lax.dot_general(lhs, rhs)` with fp8 GEMMs forward and backward (current scaling).

    The forward GEMM takes both operands in `recipe.forward_dtype`; the input-gradient and
    weight-gradient GEMMs take the output gradient in `recipe.backward_dtype` and the other
    operand in `recipe.forward_dtype` (the weight gradient in `compute_dtype` when
    `recipe.high_precision_grad_weight`; it is `lhs . g`, e4m3 x e5m2). Tensorwise
    scaling quantises each operand once and reuses the fp8 copy in the backward GEMMs;
    rowwise re-quantises along each GEMM's contracting axes. Operands keep their dtype
    (float32 masters get float32 gradients).

    Args:
      lhs: left operand (activations).
      rhs: right operand (weights).
      dimension_numbers: `dot_general` dimension numbers.
      recipe: an `Fp8Recipe` with `"tensorwise"` or `"rowwise"` scaling, or a block-scaled
        one (`"mxfp8"`, `"nvfp4"`, `"blockwise"`: see `block_scaled_dot_general`); with
        `choose="roofline"`, the format `choose_gemm_format` picks for these shapes (the
        compute dtype: a plain `dot_general` in `compute_dtype`).
      compute_dtype: the output dtype of every GEMM.
      lhs_quant: optionally, `lhs` recomputed (in float32) for the forward quantisation;
        the scale still comes from `lhs`'s amax and no gradient flows into it.
      rhs_copies: optionally, `copies(contract, recipe)` giving `rhs`'s block-quantised
        copies made beforehand (`mpjax.fp8.weight_copies`), or None to quantise it here;
        asked only when this GEMM runs in a block-scaled format.

    Returns:
      The product in `compute_dtype`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax.fp8 import fp8_dot_general
      >>> x, w = jnp.ones((64, 128)), jnp.ones((128, 64))
      >>> fp8_dot_general(x, w, (((1,), (0,)), ((), ())), Fp8Recipe(), jnp.bfloat16).dtype
      dtype(bfloat16)
    """
    if recipe.choose == "roofline":  # this GEMM's format from the target's roofline
        site = Fp8Site("", np.shape(lhs), np.shape(rhs), dimension_numbers)
        fmt = choose_gemm_format(recipe, site, compute_dtype).format
        if fmt == COMPUTE:
            compute = np.dtype(compute_dtype)
            return lax.dot_general(
                lhs.astype(compute),
                rhs.astype(compute),
                dimension_numbers,
                preferred_element_type=compute,
            )
        recipe = recipe_for_format(recipe, fmt)
    if recipe.scaling in BLOCK_SCALINGS:
        rc = tuple(dimension_numbers[0][1])
        copies = None if rhs_copies is None else rhs_copies(rc, recipe)
        return block_scaled_dot_general(
            lhs, rhs, dimension_numbers, recipe, compute_dtype, rhs_copies=copies
        )
    if recipe.scaling not in ("tensorwise", "rowwise"):
        raise ValueError(
            f"fp8_dot_general: scaling={recipe.scaling!r} needs per-tensor state; use "
            "'tensorwise' or 'rowwise' here and apply_policy for 'delayed'"
        )
    (lc0, rc0), (lb0, rb0) = dimension_numbers
    dims = ((tuple(lc0), tuple(rc0)), (tuple(lb0), tuple(rb0)))
    compute = np.dtype(compute_dtype)
    (lc, rc), (lb, rb) = dims
    fwd_t, bwd_t = recipe.forward_dtype, recipe.backward_dtype
    tensorwise = recipe.scaling == "tensorwise"

    def forward(a, b, a_quant):
        qa, sa = _quantize(a, lc, fwd_t, recipe, a_quant)
        qb, sb = _quantize(b, rc, fwd_t, recipe)
        out = scaled_gemm(qa, sa, qb, sb, dims, compute)
        saved = (qa, sa, qb, sb) if tensorwise else (a, b)
        if recipe.high_precision_grad_weight and tensorwise:
            saved = (*saved, a)
        return out, saved

    def backward(saved, g):
        if tensorwise:
            qa, sa, qb, sb = saved[:4]
            a_dtype, b_dtype = qa_dtype, qb_dtype
        else:
            a, b = saved
            a_dtype, b_dtype = a.dtype, b.dtype
        # d lhs = g . rhs (contract g's rhs-free axes with rhs's free axes)
        # the saved operands (fp8 or not) are sharded like lhs and rhs
        a_like, b_like = (saved[0], saved[2]) if tensorwise else saved
        gdims, perm = grad_lhs_layout(dims, len(a_shape), len(b_shape))
        a_sharding = transposed_sharding(a_like, perm)
        qg, sg = _quantize(g, gdims[0][0], bwd_t, recipe)
        if not tensorwise:
            qb, sb = _quantize(b, gdims[0][1], fwd_t, recipe)
        da = jnp.transpose(scaled_gemm(qg, sg, qb, sb, gdims, compute, a_sharding), perm)
        # d rhs = lhs . g (contract lhs's free axes with g's lhs-free axes)
        gdims, perm = grad_rhs_layout(dims, len(a_shape), len(b_shape))
        b_sharding = transposed_sharding(b_like, perm)
        if recipe.high_precision_grad_weight:
            a_hi = saved[-1] if tensorwise else a
            db = lax.dot_general(
                a_hi.astype(compute), g.astype(compute), gdims, out_sharding=b_sharding
            )
        else:
            if not tensorwise:
                qa, sa = _quantize(a, gdims[0][0], fwd_t, recipe)
                qg, sg = _quantize(g, gdims[0][1], bwd_t, recipe)
            db = scaled_gemm(qa, sa, qg, sg, gdims, compute, b_sharding)
        db = jnp.transpose(db, perm)
        return da.astype(a_dtype), db.astype(b_dtype), None

    a_shape, b_shape = np.shape(lhs), np.shape(rhs)
    qa_dtype, qb_dtype = lhs.dtype, rhs.dtype
    op = jax.custom_vjp(lambda a, b, a_quant: forward(a, b, a_quant)[0])
    op.defvjp(forward, backward)
    lhs, rhs = match_varying(lhs, rhs)  # under shard_map(check_vma=True)
    return op(lhs, rhs, None if lhs_quant is None else lax.stop_gradient(lhs_quant))
