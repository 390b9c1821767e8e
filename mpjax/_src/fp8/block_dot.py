"""`block_scaled_dot_general`: a `dot_general` whose three GEMMs see block-scaled operands.

The reference (emulated) lowering of the `"mxfp8"`, `"nvfp4"` and `"blockwise"` recipes:
each operand of each GEMM (the forward one and both backward ones) is quantised with
`quantize_blocks` along that GEMM's contraction axis, dequantised to the compute dtype and
multiplied with float32 accumulation. The numbers are those of a native block-scaled GEMM
(block scales are exact factors of the products); the speed is that of the compute dtype
plus the quantisation, so `fp8_ops` labels these GEMMs "emulated".

Per GEMM, as the recipes prescribe:
- forward `x . w`: `x` as an activation (1-D blocks along K), `w` as a weight (2-D blocks
  for NVFP4 and blockwise when `w` is a 2-D kernel; 1-D along K otherwise);
- input gradient `g . w^T`: `g` as a gradient along N; `w` as a weight along N (a 2-D block
  grid is the same in both orientations, as DeepSeek-V3 relies on);
- weight gradient `x^T . g`: both re-quantised along the token axes (1-D blocks along the
  innermost contracted axis); for NVFP4 both first pass through a 16x16 random Hadamard
  transform along that axis, and `g`'s elements are rounded stochastically, with a key drawn
  from the gradient's own bits (deterministic for a given gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.fp8.blocks import BLOCK_SCALINGS, dequantize_blocks, quantize_blocks
from mpjax._src.fp8.layouts import grad_lhs_layout, grad_rhs_layout
from mpjax._src.fp8.recipe import Fp8Recipe

__all__ = ["block_scaled_dot_general", "random_hadamard"]

_F32 = jnp.float32
_RHT = 16


def random_hadamard(x: jax.Array, axis: int, seed: int = 0) -> jax.Array:
    """`x` times an orthogonal 16x16 random Hadamard matrix along `axis` (zero-padded to 16).

    `T = H16 @ diag(signs) / 4` with Sylvester's `H16` and fixed random signs, applied to
    each run of 16 consecutive elements along `axis`. `T` is orthogonal, so
    `(T x)^T (T g) = x^T g`: a GEMM contracting `axis` is unchanged, while outliers are
    spread across their run before quantisation (NVIDIA's NVFP4 weight-gradient recipe).

    Args:
      x: a floating array.
      axis: the axis transformed (the contraction axis of the GEMM that follows).
      seed: the random signs' seed (both GEMM operands must use the same).

    Returns:
      The transformed array in float32, `axis` padded to a multiple of 16.
    """
    h = np.array([[1.0]])
    while h.shape[0] < _RHT:
        h = np.block([[h, h], [h, -h]])
    signs = np.where(np.random.default_rng(seed).random(_RHT) < 0.5, -1.0, 1.0)
    t = jnp.asarray(h * signs / np.sqrt(_RHT), _F32)
    x = jnp.moveaxis(x.astype(_F32), axis, -1)
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % _RHT)])
    runs = x.reshape(*x.shape[:-1], -1, _RHT)
    out = jnp.einsum("...r,sr->...s", runs, t).reshape(x.shape)
    return jnp.moveaxis(out, -1, axis)


def _gradient_key(g: jax.Array) -> jax.Array:
    """A PRNG key from the bits of `g` (stochastic rounding without threading a key)."""
    bits = lax.bitcast_convert_type(jnp.sum(g.astype(_F32)), jnp.uint32)
    return jax.random.fold_in(jax.random.key(0x5EED), bits)


def block_scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Fp8Recipe,
    compute_dtype: Any,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs)` with block-scaled operands in all three GEMMs (emulated).

    Args:
      lhs: left operand (activations).
      rhs: right operand (weights).
      dimension_numbers: `dot_general` dimension numbers.
      recipe: an `Fp8Recipe` with scaling `"mxfp8"`, `"nvfp4"` or `"blockwise"`.
      compute_dtype: the dtype the dequantised operands are multiplied in, and the output's.

    Returns:
      The product in `compute_dtype`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax.fp8 import block_scaled_dot_general
      >>> x, w = jnp.ones((64, 128)), jnp.ones((128, 64))
      >>> dims = (((1,), (0,)), ((), ()))
      >>> out = block_scaled_dot_general(x, w, dims, Fp8Recipe("mxfp8"), jnp.bfloat16)
      >>> out.dtype, float(out[0, 0])
      (dtype(bfloat16), 128.0)
    """
    if recipe.scaling not in BLOCK_SCALINGS:
        raise ValueError(
            f"block_scaled_dot_general: scaling={recipe.scaling!r}; expected one of "
            f"{BLOCK_SCALINGS}"
        )
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    if not lc:
        raise ValueError("block_scaled_dot_general: needs at least one contracting axis")
    compute = np.dtype(compute_dtype)
    w_role = "weight" if np.ndim(rhs) == 2 and not rb else "activation"
    nvfp4 = recipe.scaling == "nvfp4"

    def deq(x, axes, role, key=None):
        bq = quantize_blocks(x, recipe, axis=max(axes), role=role, key=key)
        return dequantize_blocks(bq, compute)

    def gemm(a, b, gdims):
        return lax.dot_general(a, b, gdims, preferred_element_type=_F32).astype(compute)

    def forward(a, b):
        out = gemm(deq(a, dims[0][0], "activation"), deq(b, dims[0][1], w_role), dims)
        return out, (a, b)

    def backward(saved, g):
        a, b = saved
        gdims, perm = grad_lhs_layout(dims, a.ndim, b.ndim)
        qg = deq(g, gdims[0][0], "gradient")
        da = jnp.transpose(gemm(qg, deq(b, gdims[0][1], w_role), gdims), perm)
        gdims, perm = grad_rhs_layout(dims, a.ndim, b.ndim)
        a_axis, g_axis = max(gdims[0][0]), max(gdims[0][1])
        key = None
        if nvfp4:  # Hadamard-rotate both along the contracted token axis; SR the gradient
            key = _gradient_key(g)
            a, g = random_hadamard(a, a_axis), random_hadamard(g, g_axis)
        qa = deq(a, gdims[0][0], "activation")
        db = jnp.transpose(gemm(qa, deq(g, gdims[0][1], "gradient", key), gdims), perm)
        return da.astype(saved[0].dtype), db.astype(saved[1].dtype)

    op = jax.custom_vjp(lambda a, b: forward(a, b)[0])
    op.defvjp(forward, backward)
    return op(lhs, rhs)
