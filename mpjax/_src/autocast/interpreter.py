"""The autocast interpreter: re-evaluates a jaxpr equation by equation, each cast by its rule."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend.core import DropVar, Jaxpr, Literal, jaxprs_in_params

from mpjax._src.autocast.fp8_hook import evaluate_chain, fp8_chains, fp8_lower, requantised_lhs
from mpjax._src.autocast.fp8_last import KEPT_SCOPE
from mpjax._src.autocast.op_decisions import (
    FULL_DTYPE,
    OPAQUE,
    PEAK_REDUCTIONS,
    SCATTER_REDUCTIONS,
    AutocastContext,
    bind_scatter,
    continues_narrow,
    is_epilogue,
    lower_precision_op,
    narrow_power,
    recomputed_power,
    reduced_operands,
)
from mpjax._src.autocast.op_lists import OpLists
from mpjax._src.autocast.regions import in_nested_region, is_library_convert, narrows
from mpjax._src.autocast.rules import (
    ARG,
    FLEX,
    FULL,
    HIGHER_ORDER_RULES,
    LOW,
    NARROW,
    PEAK,
    STRONG,
    cast,
    dtype_of,
    is_float,
    widest,
)
from mpjax._src.autocast.saved_hook import lower_saved, saved_operands
from mpjax._src.autocast.sharded import SHARDED_RULES


def _eval_jaxpr(
    ctx: AutocastContext,
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    origins: Sequence[int],
) -> tuple[list[Any], list[int]]:
    """Evaluates `jaxpr` under autocast rules; returns the outputs and their origins.

    An origin tags each value: `STRONG` (an ordinary value), `FLEX` (computed from literals
    only, so it adopts the dtype of the values it meets, like a JAX weak type) or `LOW` (the
    direct output of a lower-precision op, whose bias add may stay in the compute dtype).
    """
    env: dict[Any, tuple[Any, int]] = {}
    casts: dict[tuple[Any, np.dtype], Any] = {}  # a variable is cast to a dtype once
    constant = set(jaxpr.constvars)  # variables computed from constants alone
    # fp8: the equation producing each variable (an fp8 GEMM input's pointwise chain), and
    # the chains only an fp8 GEMM reads, evaluated at that GEMM (see mpjax/fp8/recompute).
    watch = ctx.fp8 is not None or ctx.saved is not None
    producers = {v: e for e in jaxpr.eqns for v in e.outvars} if watch else {}
    chains = fp8_chains(ctx, jaxpr)
    deferred = {id(e) for chain in chains.values() for e in chain}

    def read(atom):
        if isinstance(atom, Literal):
            return np.asarray(atom.val, atom.aval.dtype), FLEX
        return env[atom]

    def write(var, val, origin):
        if not isinstance(var, DropVar):
            env[var] = (val, origin)

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        write(var, val, FLEX if np.ndim(val) == 0 else STRONG)
    for var, val, origin in zip(jaxpr.invars, args, origins, strict=True):
        write(var, val, origin)
    for eqn in jaxpr.eqns:
        if id(eqn) in deferred:
            continue
        if id(eqn) in chains:
            evaluate_chain(_eval_jaxpr, ctx, chains[id(eqn)], eqn.invars[0], env)
        vals, flags = zip(*map(read, eqn.invars), strict=True) if eqn.invars else ((), ())

        def cast_in(i, dtype, eqn=eqn, vals=vals, flags=flags):
            atom, val = eqn.invars[i], vals[i]
            # A constant saturates: it must not change value by more than rounding.
            fixed = flags[i] == FLEX or isinstance(atom, Literal) or atom in constant
            if isinstance(atom, Literal) or dtype_of(val) == dtype:
                return cast(val, dtype, saturate=fixed)
            if (atom, dtype) not in casts:
                casts[atom, dtype] = cast(val, dtype, saturate=fixed)
            return casts[atom, dtype]

        # Re-bind under the equation's own name stack and traceback, so the emitted ops
        # carry the traced function's names (module paths) into the HLO metadata.
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            rule = HIGHER_ORDER_RULES.get(eqn.primitive.name) or SHARDED_RULES.get(
                eqn.primitive.name
            )
            if in_nested_region(eqn):
                outs, out_origins = _as_traced(eqn, cast_in)
            elif rule is not None:
                outs, out_origins = rule(_eval_jaxpr, ctx, eqn, list(vals), list(flags))
            else:
                requant = (
                    functools.partial(requantised_lhs, eqn, producers, env)
                    if ctx.fp8 is not None
                    else None
                )
                saved = (
                    functools.partial(saved_operands, eqn, producers, env, constant)
                    if ctx.saved is not None
                    else None
                )
                outs, out_origins = _first_order(
                    ctx, eqn, list(vals), list(flags), cast_in, requant, saved
                )
        for var, val, origin in zip(eqn.outvars, outs, out_origins, strict=True):
            write(var, val, origin)
        if all(isinstance(a, Literal) or a in constant for a in eqn.invars):
            constant.update(eqn.outvars)
    results = [read(v) for v in jaxpr.outvars]
    return [r[0] for r in results], [r[1] for r in results]


def _lower(lists: OpLists, eqn) -> bool:
    """Whether the op lists run `eqn` in the compute dtype (an fp8 GEMM's precondition)."""
    return lists.category(eqn.primitive.name, eqn.params) == "lower"


def _wide(dtype: Any) -> bool:
    """Whether `dtype` is a floating dtype wider than float32 (float64: never autocast)."""
    return is_float(dtype) and widest([dtype, FULL_DTYPE]) != FULL_DTYPE


def _as_traced(eqn, cast_in) -> tuple[list, list]:
    """Binds `eqn` with its operands cast to the dtypes it was traced with.

    Any primitive, higher-order or call-like ones included (`get_bind_params` turns their
    jaxpr parameters into the functions `bind` expects), so it cannot fail on a primitive
    autocast does not know; its sub-jaxprs keep their traced dtypes.
    """
    prim = eqn.primitive
    vals = [cast_in(i, var.aval.dtype) for i, var in enumerate(eqn.invars)]
    out = prim.bind(*vals, **prim.get_bind_params(eqn.params))
    outs = list(out) if prim.multiple_results else [out]
    return outs, [STRONG] * len(outs)


def _first_order(
    ctx: AutocastContext, eqn, vals: list, origins: list, cast_in, requant=None, saved=None
) -> tuple[list, list]:
    """Binds a first-order primitive with operands cast by its category.

    `cast_in(i, dtype)` returns operand `i` cast to `dtype` (cached per variable);
    `requant()` the float32 recomputation of an fp8 GEMM's left operand (or None);
    `saved()` which operands of a GEMM to keep in fp8 for the backward (or None).
    """
    prim, params = eqn.primitive, eqn.params
    name = prim.name
    floats = [i for i, v in enumerate(vals) if is_float(dtype_of(v))]
    strong = [i for i in floats if origins[i] != FLEX]
    out_origin = FLEX if vals and all(o == FLEX for o in origins) else STRONG
    category = ctx.lists.category(name, params) if floats else None
    if name == "mul" and floats and eqn.invars[0] is eqn.invars[1]:
        category = "fp32"  # x * x of one value: a square (torch's pow)
    rebound = name in SCATTER_REDUCTIONS
    if name in OPAQUE or (not rebound and any(True for _ in jaxprs_in_params(params))):
        return _as_traced(eqn, cast_in)
    if any(_wide(dtype_of(vals[i])) for i in floats) and not prim.multiple_results:
        # float64 is left alone, as torch.autocast does (only float32 is autocast).
        target = widest([dtype_of(vals[i]) for i in floats])
        vals = [cast_in(i, target) if i in floats else v for i, v in enumerate(vals)]
        out = bind_scatter(name, vals, params) if rebound else prim.bind(*vals, **params)
        return [out], [out_origin]

    if category == "lower":
        kept = id(eqn) in ctx.fp8_kept  # Fp8Recipe.high_precision_last: named for the report
        fp8_outs = (
            None
            if ctx.fp8 is None or kept
            else fp8_lower(ctx.fp8, ctx.compute, eqn, vals, requant, ctx.fp8_weights, ctx.fp8_names)
        )
        if fp8_outs is not None:  # an fp8 GEMM (mpjax/fp8); ineligible ops fall through
            return fp8_outs, [LOW] * len(fp8_outs)
        reduce = reduced_operands(ctx, name, vals, origins)
        vals = [cast_in(i, ctx.compute) if i in floats else v for i, v in enumerate(vals)]
        which = None if saved is None else saved()
        with jax.named_scope(KEPT_SCOPE) if kept else contextlib.nullcontext():
            if which is not None:  # fp8 saved activations (Policy.saved_activations)
                lower = functools.partial(lower_precision_op, ctx, prim, params, reduce=reduce)
                outs = lower_saved(lower, eqn, vals, which, ctx.saved)
            else:
                outs = lower_precision_op(ctx, prim, params, vals, reduce)
        return outs, [LOW] * len(outs)
    if category == "fp32":
        dtypes = [dtype_of(vals[i]) for i in (strong or floats)]
        narrow = narrow_power(ctx, name, vals, origins, strong)
        target = widest([FULL_DTYPE, *dtypes])
        if narrow and out_origin != FLEX:
            return [recomputed_power(prim, params, vals, floats, target)], [NARROW]
        vals = [cast_in(i, target) if i in floats else v for i, v in enumerate(vals)]
        if out_origin != FLEX:
            out_origin = PEAK if name in PEAK_REDUCTIONS else FULL
    elif name == "gather" and origins[0] == ARG and 0 in floats:
        # Rows of a floating argument (an embedding table) are gathered in the compute
        # dtype, as Flax's `Embed(dtype=...)` does: the activations start narrow, and the
        # gradient scatter runs in the compute dtype.
        vals = [cast_in(0, ctx.compute), *vals[1:]]
    elif name == "convert_element_type":
        # jnp's convert-back of a float32-list result (jnp.sum, softmax of a float16
        # argument) is dropped: the result stays float32, as torch's float32 ops return.
        # A cast the user writes is kept, of the value it is given, at full precision.
        if (
            origins[0] in (FULL, PEAK)
            and is_float(dtype_of(vals[0]))  # not a boolean (softmax's backward compares)
            and is_float(params["new_dtype"])
            and narrows(dtype_of(vals[0]), np.dtype(params["new_dtype"]))
            and is_library_convert(eqn)
        ):
            return [vals[0]], [origins[0]]
    elif not prim.multiple_results and strong:
        if is_epilogue(ctx, name, vals, origins, strong):
            target = ctx.compute
        elif continues_narrow(ctx, name, vals, origins, strong):
            target, out_origin = widest([dtype_of(vals[i]) for i in strong]), NARROW
        else:
            # A NARROW value counts as the compute dtype here (cast once, where it ends).
            target = widest(
                [ctx.compute if origins[i] == NARROW else dtype_of(vals[i]) for i in strong]
            )
            full = [origins[i] for i in strong if origins[i] in (FULL, PEAK)]
            if full and widest([target, ctx.compute]) != ctx.compute:
                # Computed from a float32-list result at float32: float32 too.
                peak = len(full) == len(strong) and all(o == PEAK for o in full)
                out_origin = PEAK if peak else FULL
        vals = [cast_in(i, target) if i in floats else v for i, v in enumerate(vals)]
    # Multiple-result primitives (optimization_barrier, sort, collectives over tuples, ...)
    # take independent operands: they pass through in the dtypes they arrive in.
    out = bind_scatter(name, vals, params) if rebound else prim.bind(*vals, **params)
    outs = list(out) if prim.multiple_results else [out]
    return outs, [out_origin] * len(outs)
