"""Activations that keep one tensor for the backward: `gelu(h) @ w` keeps `h`, not `tanh(...)`.

Left to JAX's autodiff, a GELU MLP (`gelu(x @ w1 + b1) @ w2`) keeps for the backward pass
the hidden activation `h`, the `tanh(...)` of the tanh-approximate GELU and its other
pointwise intermediates, besides the GELU's output that the next GEMM's weight gradient
reads: several MLP-hidden-sized tensors, the largest activations of a transformer. A SiLU
gate (SwiGLU's `silu(a) * b @ w`) keeps `a`, the sigmoid, its float32 copies and the product.

`keep_activation_inputs(fun)` traces `fun` and binds its equations again as traced, except
that each pointwise chain with a transcendental op that only a GEMM reads (as its left
operand) runs under `jax.checkpoint`: its VJP keeps the chain's inputs (`h`; `a` and `b`) and
recomputes the chain in the backward, where it fuses with the chain's own gradient. The GEMM
is left alone: it keeps its operand as before, and its weight is read (gathered, under FSDP)
as before. Values are the same ops on the same dtypes, gradients autodiff's.

`autocast` does the same inside its own evaluator (`fp8_hook.fp8_chains`); `apply_policy`'s
linen models run through this wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend.core import DropVar, Literal

from mpjax._src.autocast.fp8_recompute import (
    chain_roots,
    exclusive_chains,
    without_small_roots,
)

__all__ = ["keep_activation_inputs"]


def _float_gemm(eqn: Any) -> bool:
    """Whether `eqn` is a GEMM of a floating left operand: a `dot_general`, or a custom-VJP
    call of one (a saved-activations `dot_general` override)."""
    if not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
        return False
    if eqn.primitive.name == "dot_general":
        return True
    inner = eqn.params.get("call_jaxpr")
    return inner is not None and any(e.primitive.name == "dot_general" for e in inner.jaxpr.eqns)


def _bind(eqn: Any, ins: list) -> list:
    """Binds `eqn` on `ins` under its own name stack and traceback (HLO metadata kept)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _chain_value(chain: list, read: Callable) -> Any:
    """The chain's output from the values of its inputs, recomputed in the backward pass."""
    roots = chain_roots(chain)

    def primal(*vals):
        env = dict(zip(roots, vals, strict=True))
        for eqn in chain:
            ins = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
            env.update(zip(eqn.outvars, _bind(eqn, ins), strict=True))
        return env[chain[-1].outvars[0]]

    return jax.checkpoint(primal, prevent_cse=True)(*map(read, roots))


def bind_keeping_activation_inputs(jaxpr: Any, consts: list, args: list) -> list:
    """The outputs of `jaxpr` on `args`, its exclusive activation chains recomputed."""
    chains = {k: without_small_roots(c) for k, c in exclusive_chains(jaxpr, _float_gemm).items()}
    chains = {k: c for k, c in chains.items() if c}
    deferred = {id(e) for chain in chains.values() for e in chain}
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        if id(eqn) in deferred:
            continue
        if id(eqn) in chains:
            chain = chains[id(eqn)]
            env[eqn.invars[0]] = _chain_value(chain, read)
        for var, val in zip(eqn.outvars, _bind(eqn, list(map(read, eqn.invars))), strict=True):
            if not isinstance(var, DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def keep_activation_inputs(fun: Callable) -> Callable:
    """`fun` with its activation chains keeping only their inputs for the backward pass.

    Under a JAX transformation (an array argument is a tracer: `jit`, `grad`, `vjp`), `fun`
    is traced to a jaxpr and bound again equation by equation, each activation chain only a
    GEMM reads under a recomputing VJP. Called on concrete arrays (no backward pass to
    shrink), `fun` runs as it is, so Python control flow on values works as written.

    Args:
      fun: a function of arrays and static values (a Flax `apply`) returning a pytree.

    Returns:
      A function with `fun`'s signature, values and gradients.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.autocast.activation_residuals import keep_activation_inputs
      >>> mlp = lambda h, w: jax.nn.gelu(h) @ w
      >>> h, w = jnp.ones((4, 8)), jnp.ones((8, 2))
      >>> _, vjp = jax.vjp(keep_activation_inputs(mlp), h, w)
      >>> sum(jnp.shape(r) == (4, 8) for r in jax.tree.leaves(vjp))  # h and gelu(h)
      2
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
        values = iter(bind_keeping_activation_inputs(closed.jaxpr, closed.consts, dyn))
        out_leaves, out_tree, traced = outs[0]
        final = [next(values) if t else leaf for leaf, t in zip(out_leaves, traced, strict=True)]
        return jax.tree.unflatten(out_tree, final)

    return wrapped
