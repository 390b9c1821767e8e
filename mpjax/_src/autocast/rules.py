"""Autocast rules for higher-order primitives (jit, custom_jvp/vjp, scan, while, cond, remat).

Each rule takes `(evaluate, ctx, eqn, vals, origins)`, where `evaluate(ctx, jaxpr, consts, args,
origins)` is the autocast interpreter, and returns `(outputs, output_origins)`. Loop carries keep
the dtypes they were traced with, so a loop's type is the same on every iteration; branch
outputs of `cond` are cast to the widest dtype any branch produces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "ARG",
    "FLEX",
    "FULL",
    "HIGHER_ORDER_RULES",
    "LOW",
    "NARROW",
    "PEAK",
    "STRONG",
    "cast",
    "dtype_of",
    "is_float",
    "widest",
]

# Origins of a value in the interpreter (see `interpreter._eval_jaxpr`). FULL: the result of a
# float32-list op (or computed from one at float32 or wider); PEAK: a FULL value computed
# from maxima/minima alone (the shift of a softmax, which starts no normalisation).
STRONG, FLEX, LOW, NARROW, ARG, FULL, PEAK = 0, 1, 2, 3, 4, 5, 6


def dtype_of(x: Any) -> Any:
    """The dtype of an array, tracer or scalar (extended dtypes such as keys as they are)."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def is_float(dtype: Any) -> bool:
    """Whether `dtype` is a real floating dtype (float0, keys, ints, bools are not)."""
    return jax.dtypes.issubdtype(dtype, np.floating)


def cast(x: Any, dtype: Any, *, saturate: bool = False) -> Any:
    """Casts a floating value to `dtype`; other values, and values already there, pass.

    With `saturate`, a finite value beyond the range of `dtype` becomes the largest finite
    value of `dtype` with its sign instead of an infinity (infinities and NaN stay as they
    are), so the value changes by no more than rounding to the nearest finite value. Autocast
    saturates constants (`jnp.finfo(jnp.float32).min` as an attention mask must not become
    -inf in bfloat16 or float16); values computed from the inputs overflow to inf as IEEE
    casts do, so an overflow stays visible to loss scaling.
    """
    dtype = np.dtype(dtype)
    current = dtype_of(x)
    if current == dtype or not is_float(current) or not is_float(dtype):
        return x
    saturate = saturate and jnp.finfo(dtype).max < jnp.finfo(current).max
    if isinstance(x, (np.ndarray, np.generic)):
        with np.errstate(over="ignore"):
            y = np.asarray(x, dtype)
        if not saturate:
            return y
        limit = np.asarray(jnp.finfo(dtype).max, dtype)
        over = np.isinf(y) & np.isfinite(x)
        return np.where(over, np.where(np.asarray(x) > 0, limit, -limit), y)
    y = lax.convert_element_type(x, dtype)
    if not saturate:
        return y
    limit = jnp.asarray(jnp.finfo(dtype).max, dtype)
    over = jnp.isinf(y) & jnp.isfinite(x)
    return jnp.where(over, jnp.where(x > 0, limit, -limit), y)


def widest(dtypes: Sequence[Any]) -> np.dtype:
    """The promotion of `dtypes` (all floating)."""
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    """The type a value is re-traced with: its shape, dtype, sharding and varying axes.

    The sharding (Explicit mesh axes) and the manual axes it varies over (inside
    `jax.shard_map(check_vma=True)`) are part of JAX's type: a sub-jaxpr re-traced without
    them would disagree with the values it is called on. Not weak-typed: the rewrite chose
    the dtype.
    """
    if hasattr(jax.ShapeDtypeStruct, "like"):  # jax >= 0.10.2
        like = jax.ShapeDtypeStruct.like(x)
        sharding, mat = like.sharding, like.manual_axis_type
    else:  # jax 0.10.0/0.10.1: the same fields, read from the value's type
        aval = jax.typeof(x)
        sharding = None if aval.sharding.mesh.empty else aval.sharding
        if getattr(x, "_committed", True):
            sharding = getattr(x, "sharding", sharding)
        else:
            sharding = None
        mat = None if aval.mat.empty else aval.mat
    return jax.ShapeDtypeStruct(jnp.shape(x), dtype_of(x), sharding=sharding, manual_axis_type=mat)


def _jit(evaluate, ctx, eqn, vals, origins):
    """Re-traces the jitted jaxpr under autocast and rebinds `jit` with it (same params)."""
    closed = eqn.params["jaxpr"]
    out_origins: list[list[int]] = []

    def inner(*args):
        outs, oorigins = evaluate(ctx, closed.jaxpr, closed.consts, args, origins)
        out_origins.append(oorigins)
        return outs

    new_closed = jax.make_jaxpr(inner)(*map(_struct, vals))
    outs = eqn.primitive.bind(*vals, **dict(eqn.params, jaxpr=new_closed))
    return list(outs), out_origins[0]


def _custom_jvp(evaluate, ctx, eqn, vals, origins):
    """Runs the primal and the user's JVP rule both under autocast, as a new `custom_jvp`.

    The rule's primal outputs are cast to the autocast primal's output dtypes and its
    tangents to the same dtypes, so primal and tangent types agree.
    """
    params = eqn.params
    call, num_consts, jvp_fun = params["call_jaxpr"], params["num_consts"], params["jvp_jaxpr_fun"]

    primal_origins: list[list[int]] = []

    def primal(*args):
        outs, oorigins = evaluate(ctx, call.jaxpr, call.consts, args, origins)
        primal_origins.append(oorigins)
        return outs

    out_structs = jax.eval_shape(primal, *map(_struct, vals))
    fun = jax.custom_jvp(primal)

    def rule(primals, tangents):
        primals, tangents = primals[num_consts:], tangents[num_consts:]
        zeros = tuple(dtype_of(t) == jax.dtypes.float0 for t in tangents)
        jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
        nonzero = [t for t, z in zip(tangents, zeros, strict=True) if not z]
        args = [*primals, *nonzero]
        arg_origins = [*origins[num_consts:], *([STRONG] * len(nonzero))]
        outs, _ = evaluate(ctx, jaxpr, consts, args, arg_origins)
        out_primals, out_nonzero = outs[: len(out_zeros)], iter(outs[len(out_zeros) :])
        out_primals = [cast(o, s.dtype) for o, s in zip(out_primals, out_structs, strict=True)]
        out_tangents = []
        for p, s, z in zip(out_primals, out_structs, out_zeros, strict=True):
            if z or not is_float(s.dtype):
                # A float zero tangent has its primal's type, sharding and varying axes.
                zero = (
                    jnp.zeros_like(p) if is_float(s.dtype) else np.zeros(s.shape, jax.dtypes.float0)
                )
                out_tangents.append(zero)
                if not z:
                    next(out_nonzero)
            else:
                out_tangents.append(cast(next(out_nonzero), s.dtype))
        return out_primals, out_tangents

    fun.defjvp(rule)
    outs = fun(*vals)
    # A NARROW result (e.g. `jax.nn.relu` of a normalised activation) stays NARROW.
    return list(outs), [NARROW if o == NARROW else STRONG for o in primal_origins[0]]


def _custom_vjp(evaluate, ctx, eqn, vals, origins):
    """Binds a `custom_vjp` call as it was traced: operands cast back to their traced dtypes.

    Its forward and backward rules (often a fused kernel with its own precision) run
    unchanged, so the user's gradient is kept exactly.
    """
    del evaluate, ctx, origins
    in_avals = eqn.params["call_jaxpr"].in_avals
    vals = [cast(v, a.dtype) for v, a in zip(vals, in_avals, strict=True)]
    outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs), [STRONG] * len(outs)


def scan_counts(params) -> tuple[int, int]:
    """The numbers of constant and carry operands of a `scan` equation.

    Args:
      params: the equation's params: `num_consts`/`num_carry` up to jax 0.10; from 0.11 a flat
        tree `ft_in` of the (consts, carry, xs) operands.

    Returns:
      `(num_consts, num_carry)`; the operands are `[*consts, *carry, *xs]` on every version.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _scan(evaluate, ctx, eqn, vals, origins):
    """`lax.scan` over the autocast body; the carry keeps its traced dtypes."""
    p = eqn.params
    body, (nc, ncarry) = p["jaxpr"], scan_counts(p)
    consts, init, xs = vals[:nc], vals[nc : nc + ncarry], vals[nc + ncarry :]
    carry_dtypes = [a.dtype for a in body.in_avals[nc : nc + ncarry]]
    init = [cast(v, d) for v, d in zip(init, carry_dtypes, strict=True)]
    body_origins = [*origins[:nc], *([STRONG] * ncarry), *origins[nc + ncarry :]]
    # block-quantised copies of stacked weights scanned over: scanned over beside them
    weights = getattr(ctx, "fp8_weights", None)
    extra, child = weights.scanned(xs) if weights is not None else ([], None)

    def step(carry, scanned):
        x, extra_x = scanned
        body_ctx = ctx if child is None else ctx._replace(fp8_weights=child(x, extra_x))
        outs, _ = evaluate(body_ctx, body.jaxpr, body.consts, [*consts, *carry, *x], body_origins)
        new_carry = [cast(o, d) for o, d in zip(outs[:ncarry], carry_dtypes, strict=True)]
        return new_carry, outs[ncarry:]

    carry, ys = lax.scan(
        step,
        init,
        (list(xs), extra),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    outs = [*carry, *ys]
    return outs, [STRONG] * len(outs)


def _while(evaluate, ctx, eqn, vals, origins):
    """`lax.while_loop` over the autocast cond and body; the carry keeps its traced dtypes."""
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cnc], vals[cnc : cnc + bnc], vals[cnc + bnc :]
    corigins, borigins = origins[:cnc], origins[cnc : cnc + bnc]
    carry_dtypes = [a.dtype for a in body.in_avals[bnc:]]
    init = [cast(v, d) for v, d in zip(init, carry_dtypes, strict=True)]
    carry_origins = [STRONG] * len(init)

    def cond_fun(carry):
        outs, _ = evaluate(
            ctx, cond.jaxpr, cond.consts, [*cconsts, *carry], corigins + carry_origins
        )
        return outs[0]

    def body_fun(carry):
        outs, _ = evaluate(
            ctx, body.jaxpr, body.consts, [*bconsts, *carry], borigins + carry_origins
        )
        return [cast(o, d) for o, d in zip(outs, carry_dtypes, strict=True)]

    outs = lax.while_loop(cond_fun, body_fun, init)
    return list(outs), [STRONG] * len(outs)


def _cond(evaluate, ctx, eqn, vals, origins):
    """`lax.switch` over the autocast branches; outputs cast to the widest branch dtype."""
    index, ops = vals[0], vals[1:]
    op_origins = origins[1:]

    def branch_fun(closed):
        def fun(*args):
            return evaluate(ctx, closed.jaxpr, closed.consts, args, op_origins)[0]

        return fun

    funs = [branch_fun(b) for b in eqn.params["branches"]]
    structs = [jax.eval_shape(f, *map(_struct, ops)) for f in funs]
    out_dtypes = [
        widest([s.dtype for s in per_out]) if is_float(per_out[0].dtype) else per_out[0].dtype
        for per_out in zip(*structs, strict=True)
    ]

    def casting(f):
        return lambda *args: [cast(o, d) for o, d in zip(f(*args), out_dtypes, strict=True)]

    branches = [casting(f) for f in funs]
    platforms = eqn.params.get("branches_platforms")
    if platforms is None:
        outs = lax.switch(index, branches, *ops)
    else:  # a `platform_dependent`: the branch is chosen at lowering, the others not lowered
        per_platform = {p: b for ps, b in zip(platforms, branches, strict=True) if ps for p in ps}
        default = next((b for ps, b in zip(platforms, branches, strict=True) if ps is None), None)
        outs = lax.platform_dependent(*ops, default=default, **per_platform)
    return list(outs), [STRONG] * len(outs)


def _remat(evaluate, ctx, eqn, vals, origins):
    """`jax.checkpoint` of the autocast body with the same `prevent_cse` and `policy`."""
    p = eqn.params
    jaxpr = p["jaxpr"]

    weights = getattr(ctx, "fp8_weights", None)

    def body(*args):
        # a weight passed into the body keeps its block-quantised copies (weight_copies)
        inner = ctx if weights is None else ctx._replace(fp8_weights=weights.passed(vals, args))
        names = getattr(ctx, "fp8_names", None)  # and its NNX module path
        inner = inner if names is None else inner._replace(fp8_names=names.passed(vals, args))
        return evaluate(inner, jaxpr, (), args, origins)[0]

    outs = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*vals)
    return list(outs), [STRONG] * len(outs)


HIGHER_ORDER_RULES = {
    "jit": _jit,
    "pjit": _jit,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "remat2": _remat,
}
