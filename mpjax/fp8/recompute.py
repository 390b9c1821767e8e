"""The quantisation pass of an fp8 GEMM input recomputes its pointwise producer in float32.

Current scaling reads a GEMM's input twice: once for its amax, once to quantise it. When
that input is the output of a pointwise chain with a transcendental op (`gelu(x @ w + b)`),
XLA computes the chain in the amax pass, writes the chain's intermediates that the backward
needs (`tanh(...)` for gelu), and the quantise pass reads them back, besides the chain's
input. Quantising a float32 re-evaluation of the chain instead (a computation XLA cannot
merge with the compute-dtype one) makes the quantise pass read only the chain's input:
one full-size read less per GEMM (GELU MLP of the wide LM on the H100 cost model: the
quantise fusion goes from 200 to 120 us per layer). The amax still comes from the
compute-dtype value; float32 values above it by a compute-dtype rounding saturate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

__all__ = ["pointwise_chain", "reevaluate_f32"]

_F32 = np.dtype(np.float32)
# Pointwise primitives (and shape ops that only move a bias or scale into place).
_POINTWISE = frozenset(
    {
        "abs",
        "add",
        "broadcast_in_dim",
        "cbrt",
        "clamp",
        "convert_element_type",
        "cos",
        "div",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "integer_pow",
        "log",
        "log1p",
        "logistic",
        "max",
        "min",
        "mul",
        "neg",
        "pow",
        "reshape",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sqrt",
        "square",
        "squeeze",
        "sub",
        "tan",
        "tanh",
    }
)
_TRANSCENDENTAL = frozenset(
    {"cbrt", "cos", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "log", "log1p"}
    | {"logistic", "pow", "rsqrt", "sin", "sqrt", "tan", "tanh"}
)
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
_MAX_EQNS = 64  # a longer chain (a residual stream) is not worth re-evaluating


def _inner(eqn):
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return getattr(closed, "jaxpr", closed), getattr(closed, "consts", ())


def _pointwise(eqn) -> bool:
    if eqn.primitive.name in _POINTWISE:
        return True
    if eqn.primitive.name in _CALLS:
        jaxpr, _ = _inner(eqn)
        return jaxpr is not None and all(_pointwise(e) for e in jaxpr.eqns)
    return False


def _costly(eqn, size: int) -> bool:
    """A transcendental op on `size` elements (in `eqn` or the call it makes)."""
    if eqn.primitive.name in _CALLS:
        return any(_costly(e, size) for e in _inner(eqn)[0].eqns)
    return eqn.primitive.name in _TRANSCENDENTAL and any(
        math.prod(v.aval.shape) == size for v in eqn.outvars
    )


def pointwise_chain(var: Any, producers: dict) -> list | None:
    """The equations (in order) of the pointwise subgraph producing `var`, or None.

    None unless the subgraph holds a transcendental op on `var`'s full size (a cheaper
    chain XLA already recomputes in the quantise pass) and has at most 64 equations.

    Args:
      var: a jaxpr variable (an fp8 GEMM's left operand).
      producers: jaxpr variable -> the equation that outputs it.
    """
    order: list = []
    seen: set[int] = set()
    stack = [(var, False)]
    while stack:
        v, done = stack.pop()
        eqn = producers.get(v)
        if eqn is None or not _pointwise(eqn):
            continue
        if done:
            if id(eqn) not in seen:
                seen.add(id(eqn))
                order.append(eqn)
            continue
        if id(eqn) in seen:
            continue
        if len(seen) + len(stack) > _MAX_EQNS:
            return None
        stack.append((v, True))
        stack.extend((a, False) for a in eqn.invars if not isinstance(a, Literal))
    size = math.prod(var.aval.shape)
    if not order or len(order) > _MAX_EQNS or not any(_costly(e, size) for e in order):
        return None
    return order


def _f32(x):
    dtype = np.dtype(jnp.result_type(x))
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return lax.convert_element_type(x, _F32)
    return x


def _bind(eqn, ins: list) -> list:
    name = eqn.primitive.name
    if name in _CALLS:
        jaxpr, consts = _inner(eqn)
        env = dict(zip(jaxpr.constvars, map(_f32, consts), strict=True))
        return _run(jaxpr.eqns, env, jaxpr, ins)
    params = dict(eqn.params)
    if name == "convert_element_type" and jnp.issubdtype(params["new_dtype"], jnp.floating):
        params["new_dtype"] = np.promote_types(params["new_dtype"], _F32)
        params["weak_type"] = False
    out = eqn.primitive.bind(*ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _run(eqns, env: dict, jaxpr, ins: list) -> list:
    env.update(zip(jaxpr.invars, ins, strict=True))
    _eval(eqns, env, env.__getitem__)
    return [_read(a, env, env.__getitem__) for a in jaxpr.outvars]


def _read(atom, env: dict, outer: Callable):
    if isinstance(atom, Literal):
        return _f32(np.asarray(atom.val, atom.aval.dtype))
    return env[atom] if atom in env else _f32(outer(atom))


def _eval(eqns, env: dict, outer: Callable) -> None:
    for eqn in eqns:
        outs = _bind(eqn, [_read(a, env, outer) for a in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))


def reevaluate_f32(chain: list, var: Any, read: Callable) -> Any:
    """`var` recomputed by `chain` in float32 from the values `read(v)` of its inputs.

    Args:
      chain: equations from `pointwise_chain`.
      var: the variable to return.
      read: the (already computed) value of a variable the chain does not produce.
    """
    env: dict = {}
    _eval(chain, env, read)
    return env[var]
