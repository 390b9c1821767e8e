"""Activations that keep one tensor for the backward: `gelu(h) @ w` saves `h`, not `tanh(...)`.

Left to JAX's autodiff, a GELU MLP (`gelu(x @ w1 + b1) @ w2`) keeps for the backward pass
the hidden activation `h`, the `tanh(...)` of the tanh-approximate GELU (and its other
pointwise intermediates) and the GELU's output, which the next GEMM's weight gradient
reads: several MLP-hidden-sized tensors, the largest activations of a transformer. SiLU
gates (SwiGLU's `silu(a) * b @ w`) keep `a`, the sigmoid and the product the same way.

Here a pointwise chain with a transcendental op (GELU, SiLU, ...) that only one GEMM reads,
as its left operand, is evaluated together with that GEMM under `jax.checkpoint`: the
backward pass keeps only the chain's inputs (`h`, or `a` and `b`) and the GEMM's weight,
and recomputes the chain, a cheap elementwise pass it fuses with the chain's own backward.
The values are the same ops on the same dtypes as before (so the forward is unchanged) and
the gradient is the autodiff gradient of those ops; forward-mode (`jax.jvp`,
`jax.linearize`) works as before.

`autocast` evaluates these regions under its own rules (float32-list ops stay float32);
`apply_policy`'s linen models run through `keep_activation_inputs`, which rebinds every
other equation as it was traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend.core import DropVar, Literal

from mpjax._src.autocast.fp8_recompute import chain_roots, exclusive_chains

__all__ = ["activation_regions", "keep_activation_inputs", "recomputed_region"]


def _float_gemm(eqn: Any) -> bool:
    """Whether `eqn` is a `dot_general` of two floating operands."""
    if eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return False
    return all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars)


class _Region:
    """A chain and its GEMM as a sub-jaxpr (the fields jaxpr evaluators read)."""

    def __init__(self, chain: list, gemm: Any, inputs: Sequence) -> None:
        self.constvars = ()
        self.invars = tuple(inputs)
        self.eqns = (*chain, gemm)
        self.outvars = tuple(gemm.outvars)


def activation_regions(jaxpr: Any, candidate: Callable | None = None) -> dict:
    """{id(GEMM equation): (chain, inputs)} for the activation chains only a GEMM reads.

    Args:
      jaxpr: a jaxpr (its top level; sub-jaxprs are not searched).
      candidate: which `dot_general` equations of two floating operands may take a
        region (default: every one).

    Returns:
      For each such GEMM, the chain (see `mpjax._src.autocast.fp8_recompute.pointwise_chain`)
      and the region's inputs: the chain's inputs, then the GEMM's right operand. Empty for
      a region itself (its evaluation finds no region again).
    """
    if isinstance(jaxpr, _Region):
        return {}

    def take(eqn):
        return _float_gemm(eqn) and (candidate is None or candidate(eqn))

    regions = {}
    for key, chain in exclusive_chains(jaxpr, take).items():
        gemm = next(e for e in jaxpr.eqns if id(e) == key)
        inputs = chain_roots(chain)
        rhs = gemm.invars[1]
        if not isinstance(rhs, Literal) and rhs not in inputs:
            inputs.append(rhs)
        regions[key] = (chain, inputs)
    return regions


def recomputed_region(evaluate: Callable, chain: list, gemm: Any, inputs: Sequence) -> Callable:
    """The region `chain` + `gemm` as a function of `inputs`, keeping only them for the VJP.

    Args:
      evaluate: `evaluate(sub_jaxpr, values)` returns the sub-jaxpr's outputs.
      chain: the pointwise chain the GEMM's left operand comes from.
      gemm: the `dot_general` equation.
      inputs: the region's input variables (see `activation_regions`).

    Returns:
      A function of the input values returning the GEMM's outputs, under
      `jax.checkpoint` (nothing inside saved: the GEMM's transpose reads only its inputs).
    """
    region = _Region(chain, gemm, inputs)
    return jax.checkpoint(lambda *vals: evaluate(region, vals), prevent_cse=True)


def _bind_all(eqns: Sequence, env: dict, regions: dict) -> None:
    """Binds `eqns` as traced into `env`; each region's GEMM (and its chain) recomputed."""
    deferred = {id(e) for chain, _ in regions.values() for e in chain}

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn in eqns:
        if id(eqn) in deferred:
            continue
        if id(eqn) in regions:
            chain, inputs = regions[id(eqn)]

            def run(region, vals):
                sub = dict(zip(region.invars, vals, strict=True))
                _bind_all(region.eqns, sub, {})
                return [sub[v] for v in region.outvars]

            outs = recomputed_region(run, chain, eqn, inputs)(*map(read, inputs))
        else:
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (
                source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
                eqn.ctx.manager,
            ):
                params = eqn.primitive.get_bind_params(eqn.params)
                out = eqn.primitive.bind(*map(read, eqn.invars), **params)
            outs = out if eqn.primitive.multiple_results else [out]
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def keep_activation_inputs(fun: Callable) -> Callable:
    """`fun` with its activation chains keeping only their inputs for the backward pass.

    Under a JAX transformation (an array argument is a tracer: `jit`, `grad`, `vjp`), `fun`
    is traced to a jaxpr and re-evaluated with each activation region (see
    `activation_regions`) under `jax.checkpoint`; every other equation is bound as traced.
    Called on concrete arrays only (no backward pass to shrink), `fun` runs as it is, so
    Python control flow on values works as without this wrapper.

    Args:
      fun: a function of arrays and static values (a Flax `apply`) returning a pytree.

    Returns:
      A function with `fun`'s signature, values and gradients.
    """

    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        if not any(isinstance(leaves[i], jax.core.Tracer) for i in dynamic):
            return fun(*args, **kwargs)
        outs: list = []

        def flat_fun(*dyn):
            full = list(leaves)
            for i, value in zip(dynamic, dyn, strict=True):
                full[i] = value
            a, k = jax.tree.unflatten(treedef, full)
            out_leaves, out_tree = jax.tree.flatten(fun(*a, **k))
            traced = [isinstance(leaf, jax.core.Tracer) for leaf in out_leaves]
            outs.append((out_leaves, out_tree, traced))
            return [leaf for leaf, t in zip(out_leaves, traced, strict=True) if t]

        dyn = [leaves[i] for i in dynamic]
        closed = jax.make_jaxpr(flat_fun)(*dyn)
        jaxpr = closed.jaxpr
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, dyn, strict=True))
        _bind_all(jaxpr.eqns, env, activation_regions(jaxpr))
        values = iter(v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars)
        out_leaves, out_tree, traced = outs[0]
        final = [next(values) if t else leaf for leaf, t in zip(out_leaves, traced, strict=True)]
        return jax.tree.unflatten(out_tree, final)

    return wrapped
