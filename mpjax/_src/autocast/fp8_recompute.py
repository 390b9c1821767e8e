"""Pointwise producers of fp8 GEMM inputs: quantised from float32, recomputed in the backward.

Current scaling reads a GEMM's input twice: once for its amax, once to quantise it. When
that input is the output of a pointwise chain with a transcendental op (`gelu(x @ w + b)`),
XLA computes the chain in the amax pass and, left alone, writes the intermediates the
backward needs (gelu's `tanh`), which the quantise pass and the backward read back. Two
changes make each pass read only the chain's input (the GEMM output before it):

- the quantise pass quantises a float32 re-evaluation of the chain (`reevaluate_f32`), a
  computation XLA cannot merge with the compute-dtype one the amax comes from (float32
  values above the amax by a compute-dtype rounding saturate);
- a chain nothing but the GEMM reads is evaluated under a custom VJP (`recomputed`) that
  keeps only the chain's inputs and recomputes the chain in the backward pass, tied to the
  cotangent so that XLA cannot merge it with the forward's amax pass either.

On the H100 cost model this shortens the GELU MLP of the wide LM in both passes (the
backward pass no longer reads `tanh`); `benchmarks/fp8_cost.py` measures it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

__all__ = [
    "chain_roots",
    "exclusive_chains",
    "pointwise_chain",
    "recomputed",
    "reevaluate_f32",
    "without_small_roots",
]

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
        "copy",
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
# A GEMM, or a custom-VJP GEMM (a saved-activations `dot_general` override) taking the
# activation as its first operand: the callers' `candidate` decides which.
_GEMMS = frozenset({"dot_general", "custom_vjp_call"})
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


def chain_roots(chain: list) -> list:
    """The variables `chain` reads but does not produce, in first-use order."""
    made = {v for e in chain for v in e.outvars}
    roots: dict = {}
    for e in chain:
        for a in e.invars:
            if not isinstance(a, Literal) and a not in made:
                roots.setdefault(a, None)
    return list(roots)


def without_small_roots(chain: list) -> list:
    """`chain` less the equations that only bring a smaller input (a bias) into place.

    `gelu(h + b)` recomputed from `h` and `b` needs `b` again in the backward pass: under
    FSDP a second all-gather of the bias. Its leading equations that read a root smaller
    than the chain's output, or what such equations made (the bias's broadcast and the
    add), stay outside, so the recomputed rest starts from `h + b`, the same size as `h`.

    Args:
      chain: equations from `pointwise_chain`, in order.

    Returns:
      The equations to recompute (a suffix of the dependency order; the others run before).
    """
    size = math.prod(chain[-1].outvars[0].aval.shape)
    roots = set(chain_roots(chain))
    small = {v for v in roots if math.prod(v.aval.shape) < size}
    outside: set = set()
    rest = []
    for eqn in chain:
        ins = [a for a in eqn.invars if not isinstance(a, Literal)]
        if ins and all(v in roots or v in outside for v in ins) and any(v in small for v in ins):
            outside.update(eqn.outvars)
            if all(v in small for v in ins):
                small.update(eqn.outvars)
        else:
            rest.append(eqn)
    return rest


def exclusive_chains(jaxpr, candidate: Callable) -> dict:
    """{id(fp8 GEMM equation): chain} for left operands whose chain nothing else reads.

    Args:
      jaxpr: the jaxpr being evaluated.
      candidate: `candidate(eqn)` tells whether a `dot_general` (or `custom_vjp_call`)
        equation takes the chain producing its first operand.

    Returns:
      The chains (see `pointwise_chain`) whose intermediate values and result only the
      GEMM reads; the caller evaluates each at its GEMM (see `recomputed`).
    """
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    users: dict = {}
    for e in jaxpr.eqns:
        for a in e.invars:
            if not isinstance(a, Literal):
                users.setdefault(a, []).append(e)
    outs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    taken: set[int] = set()
    chains: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _GEMMS or not eqn.invars or isinstance(eqn.invars[0], Literal):
            continue
        chain = pointwise_chain(eqn.invars[0], producers)
        if chain is None or any(id(e) in taken for e in chain) or not candidate(eqn):
            continue
        if _only_the_gemm_reads(chain, eqn, users, outs):
            taken.update(id(e) for e in chain)
            chains[id(eqn)] = chain
    return chains


def _only_the_gemm_reads(chain: list, eqn, users: dict, outs: set) -> bool:
    """Whether nothing outside `chain` reads its values, except `eqn` reading its output.

    `eqn` (the GEMM) may read the chain's output as its left operand only: not an
    intermediate, and not as its right operand too (only the output is re-evaluated).
    """
    members = {id(e) for e in chain}
    head = eqn.invars[0]
    if eqn.invars[1] is head:
        return False
    for e in chain:
        for v in e.outvars:
            if v in outs or v is eqn.invars[1]:
                return False
            for u in users.get(v, ()):
                if id(u) not in members and not (u is eqn and v is head):
                    return False
    return True


def _tied(v, g):
    """`v + 0 * g` for a floating `v` of `g`'s size, else `v`: the same values, computed from `g`.

    Float `0 * g` does not fold (it is NaN where `g` is not finite), so XLA cannot merge a
    computation on the result with one on `v`; a non-finite cotangent stays non-finite.
    """
    dtype = np.dtype(jnp.result_type(v))
    if not jnp.issubdtype(dtype, jnp.floating) or np.size(v) != g.size:
        return v
    return v + (jnp.reshape(g, np.shape(v)) * 0).astype(dtype)


def recomputed(primal: Callable) -> Callable:
    """`primal` (a pointwise chain) with a VJP that keeps only its inputs and recomputes it.

    The backward pass re-runs `primal` on its inputs tied to the cotangent (`_tied`), so
    XLA neither keeps the chain's intermediates from the forward pass nor merges the
    recomputation with the forward's: it fuses into the backward kernel that reads the
    chain's inputs anyway. The gradient is `primal`'s own (same ops, same dtypes).

    Args:
      primal: a function of the chain's input values returning its output.

    Returns:
      A function with `primal`'s values and gradients.
    """

    def fwd(*vals):
        return primal(*vals), vals

    def bwd(vals, g):
        _, vjp = jax.vjp(primal, *[_tied(v, g) for v in vals])
        return vjp(g)

    op = jax.custom_vjp(primal)
    op.defvjp(fwd, bwd)
    return op
