"""The per-op decisions of the autocast interpreter, and how it lowers GEMMs.

Which dtype an op runs in and what its result counts as (`narrow_power`,
`is_epilogue`, `continues_narrow`), which GEMM operands get their cotangent in the
policy's `reduce_dtype` (`reduced_operands`), and the one place matmul-like ops are
bound on compute-dtype operands (`lower_precision_op`). `mpjax._src.autocast.autocast`
evaluates jaxprs with them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.autocast.op_lists import OpLists
from mpjax._src.autocast.rules import ARG, LOW, NARROW, PEAK, cast, dtype_of, is_float, widest
from mpjax._src.core.reduce_dot import reduce_dot_general
from mpjax._src.fp8.recipe import Fp8Recipe

__all__ = [
    "FULL_DTYPE",
    "OPAQUE",
    "PEAK_REDUCTIONS",
    "SCATTER_REDUCTIONS",
    "AutocastContext",
    "bind_scatter",
    "continues_narrow",
    "is_epilogue",
    "lower_precision_op",
    "narrow_power",
    "recomputed_power",
    "reduced_operands",
    "size_of",
]

FULL_DTYPE = np.dtype(np.float32)

# Bilinear ops whose low-precision form gets a custom JVP (see `lower_precision_op`).
_BILINEAR = frozenset({"dot_general", "conv_general_dilated"})

# The accumulation dtype that low-precision (bf16/fp16) GEMMs and convolutions get without
# asking: cuBLAS/Triton GEMMs and cuDNN convolutions on XLA:GPU, the TPU MXU and XLA:CPU
# (which upcasts) all accumulate in float32 and round the result once. Autocast binds them
# with a compute-dtype result, as Flax's `Dense(dtype=bfloat16)` and torch.autocast do.
# Asking explicitly (`preferred_element_type=float32`, then a convert) costs on XLA:GPU: a
# convolution becomes a float32 cuDNN convolution on converted operands, and a GEMM writes
# a float32 result that a separate pass converts (GPT-2 train step on the H100 cost model:
# 1.021x the roofline of the Flax bf16 model, 0.4 ms of it in the q/k/v bias adds).
_IMPLICIT_ACCUMULATION = np.dtype(np.float32)

# Elementwise ops that continue a normalisation (see `continues_narrow`).
_NARROW_CHAIN = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "integer_pow"}
)

# Powers of one value (x ** n, jnp.reciprocal, jnp.square, x * x): see `_first_order`.
_POWERS = frozenset({"integer_pow", "square", "mul"})

# Reductions whose result is a maximum or minimum (see `PEAK`).
PEAK_REDUCTIONS = frozenset({"reduce_max", "reduce_min"})

# Scatter reductions, rebound through their `lax` function so that the update computation
# (a sub-jaxpr typed by the traced dtype) is rebuilt for the dtype they run in.
SCATTER_REDUCTIONS = {
    "scatter-add": lax.scatter_add,
    "scatter-mul": lax.scatter_mul,
}


def bind_scatter(name: str, vals: list, params: dict):
    """Binds the scatter reduction `name` on `vals` (operand, indices, updates)."""
    return SCATTER_REDUCTIONS[name](
        *vals,
        dimension_numbers=params["dimension_numbers"],
        indices_are_sorted=params["indices_are_sorted"],
        unique_indices=params["unique_indices"],
        mode=params["mode"],
    )


# First-order primitives bound with the operand dtypes they were traced with.
OPAQUE = frozenset(
    {"bitcast_convert_type", "pure_callback", "io_callback", "debug_callback", "ffi_call"}
)


class AutocastContext(NamedTuple):
    """What one autocast call rewrites with: dtypes, op lists, fp8 recipe, reduce dtype, and
    the fp8 format of saved GEMM inputs (`Policy.saved_activations`), the ids of the GEMM
    equations `Fp8Recipe.high_precision_last` keeps in the compute dtype, and the weights'
    block-quantised copies (`mpjax._src.fp8.weight_copies.WeightLookup`) or None."""

    compute: np.dtype
    accum: np.dtype | None
    lists: OpLists
    fp8: Fp8Recipe | None = None
    reduce: np.dtype | None = None
    saved: np.dtype | None = None
    fp8_kept: frozenset = frozenset()
    fp8_weights: Any = None
    fp8_names: Any = None  # a GemmNames (NNX module paths of the weights), or None


def size_of(x: Any) -> int:
    """Number of elements of an array-like value (1 for a scalar)."""
    return math.prod(np.shape(x))


def recomputed_power(prim, params: dict, vals: list, floats: list, target):
    """A power of a compute-dtype value, at `target` precision, rematerialised.

    The backward recomputes the float32 derivative (`n * x ** (n - 1)`) from the
    compute-dtype input instead of saving it: no float32 residual where the hand-written
    compute-dtype program saves a compute-dtype one (gelu's `x ** 3`).
    """

    def power(*xs):
        return prim.bind(
            *[x.astype(target) if i in floats else x for i, x in enumerate(xs)], **params
        )

    return jax.checkpoint(power, prevent_cse=False)(*vals)


def narrow_power(ctx: AutocastContext, name: str, vals: list, origins: list, strong: list) -> bool:
    """Whether this float32 op is a power of a compute-dtype value (its result is NARROW).

    `x ** n`, `jnp.reciprocal`, `jnp.square` and `x * x` run in float32 (torch's `pow`,
    `reciprocal`); of a compute-dtype (or NARROW) value the result counts as the compute
    dtype: reductions read it at float32 (RMSNorm, sum of squares, MSE do not overflow
    float16) and it is rounded once where it meets another compute-dtype value (gelu's
    `x ** 3` stays in the compute dtype, as torch's fused gelu does).
    """
    if name not in _POWERS or not ctx.lists.epilogue or not strong:
        return False
    i = strong[0]
    return origins[i] == NARROW or dtype_of(vals[i]) == ctx.compute


def is_epilogue(ctx: AutocastContext, name: str, vals: list, origins: list, strong: list) -> bool:
    """Whether this op is the bias add of a lower-precision op (kept in the compute dtype).

    True for an op in `OpLists.epilogue` that combines the full-size output of a
    lower-precision op with smaller, broadcast operands (a `Dense`/`Conv` bias): torch's
    `linear`/`conv` include that add, so it runs in the compute dtype there too.
    """
    if name not in ctx.lists.epilogue:
        return False
    low = [i for i in strong if origins[i] == LOW]
    if not low:
        return False
    full = max(size_of(v) for v in vals)
    return all(size_of(vals[i]) == full for i in low) and all(
        size_of(vals[i]) < full for i in strong if origins[i] != LOW
    )


def continues_narrow(
    ctx: AutocastContext, name: str, vals: list, origins: list, strong: list
) -> bool:
    """Whether this op is a step of a normalisation (its result is tagged NARROW).

    True for an elementwise op whose one full-size operand is in the compute dtype (or
    NARROW already) and whose other operands are smaller, broadcast, and wider (float32
    statistics, scale and bias: `(x - mean) * rsqrt(var + eps) * scale + bias`), or a
    unary op / a max with a literal (`relu`) of a NARROW value. The op runs in the wider
    dtype, but its result counts as the compute dtype: it is cast once, where it meets
    another full-size compute-dtype value or an op that is not such a step (a residual
    add, a max-pool), so the normalised activations and what follows them stay narrow,
    as `BatchNorm(dtype=bfloat16)` and torch.autocast's `batch_norm` return the input
    dtype. Reductions (float32 ops) read the value at full precision. Off with
    `OpLists(epilogue=frozenset())` (the plain widest rule everywhere).
    """
    if name not in _NARROW_CHAIN or not ctx.lists.epilogue:
        return False
    full = max(size_of(vals[i]) for i in strong)
    main = [i for i in strong if size_of(vals[i]) == full]
    if len(main) != 1:
        return False
    (m,) = main
    if origins[m] != NARROW and dtype_of(vals[m]) != ctx.compute:
        return False
    if any(origins[i] == PEAK for i in strong):
        return False  # `x - max(x)`: the shift of a (log-)softmax, a float32 op
    others = [dtype_of(vals[i]) for i in strong if i != m]
    return origins[m] == NARROW or any(widest([d, ctx.compute]) != ctx.compute for d in others)


def reduced_operands(ctx: AutocastContext, name: str, vals: list, origins: list) -> tuple | None:
    """Which operands of a `dot_general` get their cotangent in `ctx.reduce` (None: none).

    The floating operands that are arguments of the function (the parameters): their
    gradients are what XLA sums across devices under data parallelism / FSDP.
    """
    if ctx.reduce is None or name != "dot_general" or len(vals) != 2:
        return None
    which = tuple(o == ARG and is_float(dtype_of(v)) for v, o in zip(vals, origins, strict=True))
    return which if any(which) else None


def lower_precision_op(
    ctx: AutocastContext, prim, params, vals: list, reduce: tuple | None = None
) -> list:
    """Binds a lower-precision op (dot_general, conv, ...) on compute-dtype operands.

    The one place autocast lowers matmul-like ops. Returns compute-dtype outputs. A float32
    accumulation (the default) is what the backends' low-precision ops do anyway, so the op
    is bound with a compute-dtype result (see `_IMPLICIT_ACCUMULATION`). Another
    accumulation dtype is asked for explicitly: the op is bound with
    `preferred_element_type=accum` and converted, with a custom JVP whose derivative ops are
    compute-dtype too. With `reduce` (which operands, from the policy's `reduce_dtype`), a
    `dot_general` is `reduce_dot_general`: those operands' cotangent GEMMs output
    `ctx.reduce`, the dtype XLA then sums them across devices in.
    """
    compute = ctx.compute
    accumulate = (
        ctx.accum is not None
        and ctx.accum != compute
        and ctx.accum != _IMPLICIT_ACCUMULATION
        and "preferred_element_type" in params
    )
    if not accumulate and reduce is not None:
        dims, precision = params["dimension_numbers"], params.get("precision")
        out = reduce_dot_general(*vals, dims, precision, reduce_dtype=ctx.reduce, operands=reduce)
        return [cast(out, compute)]
    if not accumulate:
        if "preferred_element_type" in params:
            params = dict(params, preferred_element_type=None)
        out = prim.bind(*vals, **params)
        outs = list(out) if prim.multiple_results else [out]
        return [cast(o, compute) for o in outs]

    acc_params = dict(params, preferred_element_type=ctx.accum)
    low_params = dict(params, preferred_element_type=None)

    def accumulated(*xs):
        return cast(prim.bind(*xs, **acc_params), compute)

    if prim.name not in _BILINEAR or len(vals) != 2:
        return [accumulated(*vals)]

    # The output of `accumulated` is a convert of a float32 dot; JAX transposes that convert
    # into a float32 cotangent, which would make the backward matmuls float32 x bf16. A custom
    # JVP keeps the derivative in the compute dtype: for a bilinear op,
    # d(a.b) = da.b + a.db, each term a compute-dtype op of compute-dtype operands.
    op = jax.custom_jvp(accumulated)

    def jvp(primals, tangents):
        a, b = primals
        ta, tb = tangents
        out = accumulated(a, b)
        terms = []
        if not isinstance(ta, jax.custom_derivatives.SymbolicZero):
            terms.append(prim.bind(cast(ta, compute), b, **low_params))
        if not isinstance(tb, jax.custom_derivatives.SymbolicZero):
            terms.append(prim.bind(a, cast(tb, compute), **low_params))
        if not terms:
            return out, jnp.zeros_like(out)
        return out, cast(functools.reduce(lax.add, terms), compute)

    op.defjvp(jvp, symbolic_zeros=True)
    return [op(*vals)]
