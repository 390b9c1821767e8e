"""The fp8 branch of `autocast`: which `dot_general`s run as fp8 GEMMs, and the rebinding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from mpjax._src.autocast.fp8_recompute import (
    chain_roots,
    exclusive_chains,
    pointwise_chain,
    recomputed,
    reevaluate_f32,
    without_small_roots,
)
from mpjax._src.autocast.saved_hook import saved_candidate
from mpjax._src.fp8.conv import conv_gemm_site, fp8_conv_1x1
from mpjax._src.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = [
    "check_autocast_recipe",
    "evaluate_chain",
    "fp8_candidate",
    "fp8_chains",
    "fp8_lower",
    "requantised_lhs",
]


def check_autocast_recipe(recipe: Any) -> Fp8Recipe | None:
    """Validates `autocast`'s `fp8` argument (None, or a current-scaling `Fp8Recipe`)."""
    if recipe is None:
        return None
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"autocast: fp8 must be an mpjax Fp8Recipe, got {type(recipe).__name__}")
    if recipe.scaling == "delayed":
        raise ValueError(
            "autocast: Fp8Recipe(scaling='delayed') needs per-tensor amax state, which a "
            "stateless function rewrite cannot keep; use scaling='tensorwise' or 'rowwise'"
        )
    return recipe


def fp8_candidate(recipe: Fp8Recipe, eqn) -> bool:
    """Whether `fp8_lower` takes a `dot_general` equation (judged from its traced shapes)."""
    if eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return False
    avals = [v.aval for v in eqn.invars]
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in avals):
        return False
    name = str(eqn.source_info.name_stack)
    site = Fp8Site(name, avals[0].shape, avals[1].shape, eqn.params["dimension_numbers"])
    return fp8_eligible(recipe, site)


def fp8_lower(
    recipe: Fp8Recipe,
    compute: np.dtype,
    eqn,
    vals: list,
    lhs_quant: Callable | None = None,
    weights: Any = None,
    names: Any = None,
) -> list | None:
    """The fp8 GEMM for a `dot_general` or 1x1 convolution, or None (compute dtype).

    `vals` are the operands in the dtypes they arrived in (float32 masters are quantised
    directly, without a compute-dtype copy); the output is in `compute`. `lhs_quant()`, if
    given, returns a float32 recomputation of the left operand to quantise (or None; see
    `mpjax._src.autocast.fp8_recompute`). `weights`, if given, is a `WeightLookup`: the
    block-quantised copies of the right operand when it is one of the weights it knows.
    `names`, if given, is a `GemmNames`: the name `exclude` matches (an NNX weight's module
    path where the name stack has none).
    """
    if eqn.primitive.name not in ("dot_general", "conv_general_dilated") or len(vals) != 2:
        return None
    if not all(jnp.issubdtype(jnp.result_type(v), jnp.floating) for v in vals):
        return None
    if eqn.primitive.name == "conv_general_dilated":  # 1x1 convs only (mpjax/fp8/conv.py)
        name, shapes = str(eqn.source_info.name_stack), (np.shape(vals[0]), np.shape(vals[1]))
        if conv_gemm_site(recipe, name, *shapes, eqn.params)[0] is None:
            return None
        return [fp8_conv_1x1(vals[0], vals[1], eqn.params, recipe, compute)]
    dims = eqn.params["dimension_numbers"]
    name = str(eqn.source_info.name_stack)
    name = name if names is None else names.name(name, vals[1])
    site = Fp8Site(name, np.shape(vals[0]), np.shape(vals[1]), dims)
    if not fp8_eligible(recipe, site):
        return None
    quant = None if lhs_quant is None else lhs_quant()
    copies = None if weights is None else functools.partial(weights, vals[1])
    return [
        fp8_dot_general(vals[0], vals[1], dims, recipe, compute, lhs_quant=quant, rhs_copies=copies)
    ]


def fp8_chains(ctx: Any, jaxpr: Any) -> dict:
    """{id(GEMM equation): the pointwise chain only it reads} (see `exclusive_chains`).

    Every GEMM the op lists run in the compute dtype (and, under a recipe, every fp8 GEMM
    and every GEMM whose left operand `Policy.saved_activations` keeps in fp8) evaluates
    the activation chain producing its left operand (gelu, SiLU, a SwiGLU product) with a
    VJP that keeps only the chain's inputs (`recomputed`): left to autodiff, the chain's
    intermediates (tanh-gelu's `tanh(...)`, SiLU's sigmoid, their float32 copies) would be
    kept for the backward pass beside the GEMM's own operand.
    """
    saved = getattr(ctx, "saved", None)

    def candidate(eqn):
        if ctx.lists.category(eqn.primitive.name, eqn.params) != "lower":
            return False
        kept = id(eqn) in getattr(ctx, "fp8_kept", ())  # Fp8Recipe.high_precision_last
        if ctx.fp8 is not None and not kept and fp8_candidate(ctx.fp8, eqn):
            return True
        if saved is not None and eqn.primitive.name == "dot_general" and saved_candidate(eqn):
            return True
        return eqn.primitive.name == "dot_general" and all(_floating(v) for v in eqn.invars)

    chains = exclusive_chains(jaxpr, candidate)
    if ctx.fp8 is not None or saved is not None:
        return chains
    # Recomputed under jax.checkpoint: a bias add stays outside (no second FSDP gather).
    trimmed = {key: without_small_roots(chain) for key, chain in chains.items()}
    return {key: chain for key, chain in trimmed.items() if chain}


def _floating(var: Any) -> bool:
    return jnp.issubdtype(var.aval.dtype, jnp.floating)


class _Chain(NamedTuple):
    """A pointwise chain as a sub-jaxpr (the fields autocast's evaluator reads)."""

    constvars: tuple
    invars: tuple
    eqns: tuple
    outvars: tuple


def evaluate_chain(evaluate: Callable, ctx: Any, chain: list, out: Any, env: dict) -> None:
    """Evaluates `chain`, producing an fp8 GEMM's input `out`, into autocast's `env`.

    `evaluate(ctx, jaxpr, consts, args, origins)` is autocast's evaluator; the chain runs
    under its rules as usual, with a VJP that recomputes it (`recomputed`).
    """
    roots = chain_roots(chain)
    sub = _Chain((), tuple(roots), tuple(chain), (out,))
    origins = [env[r][1] for r in roots]
    found = []

    def primal(*vals):
        outs, out_origins = evaluate(ctx, sub, (), vals, origins)
        found.append(out_origins[0])
        return outs[0]

    value = _recompute(ctx, primal)(*[env[r][0] for r in roots])
    env[out] = (value, found[-1])


def _recompute(ctx: Any, primal: Callable) -> Callable:
    """`primal` keeping only its inputs for the backward pass.

    With fp8 or fp8 saved activations, `recomputed`'s custom VJP (its recomputation tied to
    the cotangent, so XLA cannot merge it with the forward amax pass); otherwise
    `jax.checkpoint`, which forward-mode autodiff (`jax.jvp`, `jax.linearize`) goes through.
    """
    if ctx.fp8 is not None or getattr(ctx, "saved", None) is not None:
        return recomputed(primal)
    return jax.checkpoint(primal, prevent_cse=True)


def requantised_lhs(eqn: Any, producers: dict, env: dict) -> Any:
    """A float32 recomputation of `eqn`'s left operand to quantise (or None)."""
    lhs = eqn.invars[0]
    chain = None if isinstance(lhs, Literal) else pointwise_chain(lhs, producers)
    return None if chain is None else reevaluate_f32(chain, lhs, lambda v: env[v][0])
