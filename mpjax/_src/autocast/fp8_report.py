"""`fp8_ops`: which GEMMs and convolutions `autocast(fun, fp8=recipe)` runs in fp8, and why not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

from mpjax._src.autocast.fp8_last import OWN_RULES, kept_last
from mpjax._src.autocast.gemm_names import nnx_leaf_names
from mpjax._src.fp8.block_dot import native_block_gemms
from mpjax._src.fp8.blocks import BLOCK_SCALINGS
from mpjax._src.fp8.choose import COMPUTE, choose_gemm_format, recipe_for_format
from mpjax._src.fp8.conv import conv_gemm_site, gemm_reason
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["Fp8Op", "fp8_ops"]


class Fp8Op(NamedTuple):
    """One `dot_general` or convolution of a function, and what `autocast(fp8=)` does with it.

    Attributes:
      name: the op's name stack (the Flax module path `exclude` patterns match); for a GEMM
        reading a Variable of an NNX module argument, that module's path (`"Model/head"`).
      primitive: `"dot_general"` or `"conv_general_dilated"`.
      lhs_shape: the left operand's (input's) shape.
      rhs_shape: the right operand's (kernel's) shape.
      fp8: whether it runs as an fp8 GEMM (forward and both gradients).
      reason: why it keeps the compute dtype (empty when `fp8`).
      lowering: how an fp8 op's GEMMs run: `"fp8"` (fp8 tensor-core GEMMs), or for the
        block-scaled recipes `"native <scaling>"` (block-scaled tensor-core GEMMs) or
        `"emulated <scaling>"` (operands quantised per block and dequantised to the compute
        dtype: the numbers of the format at the compute dtype's speed); empty when not `fp8`.
        Under `choose="roofline"` it names the chosen format (`"fp8 tensorwise"`,
        `"native mxfp8"`, ...).
      choice: under `Fp8Recipe(choose="roofline")`, the roofline times behind the GEMM's
        format (also the `reason` of a GEMM kept in the compute dtype: "memory bound on
        ..."); empty otherwise.
    """

    name: str
    primitive: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    fp8: bool
    reason: str
    lowering: str = ""
    choice: str = ""


def _lowering(recipe: Fp8Recipe, reason: str, operands: tuple = ()) -> str:
    if reason:
        return ""
    if recipe.scaling not in BLOCK_SCALINGS:
        return "fp8"
    native = native_block_gemms(recipe, *operands)
    return f"{'native' if native else 'emulated'} {recipe.scaling}"


def _chosen(recipe: Fp8Recipe, site: Fp8Site, compute, operands) -> tuple[str, str, str]:
    """(reason, lowering, choice) of an eligible GEMM under `choose="roofline"`."""
    choice = choose_gemm_format(recipe, site, compute)
    if choice.format == COMPUTE:
        return choice.reason, "", choice.reason
    lowering = _lowering(recipe_for_format(recipe, choice.format), "", operands)
    if lowering == "fp8":
        lowering = f"fp8 {choice.format}"
    return "", lowering, choice.reason


def _walk(jaxpr, recipe: Fp8Recipe, found: list, compute, kept: dict, names=None) -> None:
    names = names or {}  # the top level's NNX weight variables -> their module path
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim in ("dot_general", "conv_general_dilated"):
            lhs, rhs = (tuple(np.shape(v.aval)) for v in eqn.invars[:2])
            floats = all(jax.numpy.issubdtype(v.aval.dtype, np.floating) for v in eqn.invars)
            name = str(eqn.source_info.name_stack)
            if prim == "dot_general":
                name = names.get(eqn.invars[1], name)
            if not floats:
                reason = "integer operands: not cast"
            elif prim == "dot_general":
                site = Fp8Site(name, lhs, rhs, eqn.params["dimension_numbers"])
                reason = gemm_reason(recipe, site) or ""
            else:  # a 1x1 conv's GEMM site (None when it is not one)
                site, why = conv_gemm_site(recipe, name, lhs, rhs, eqn.params)
                reason = why or ""
            reason = kept.get(id(eqn), reason)  # Fp8Recipe.high_precision_last
            operands = tuple(v.aval for v in eqn.invars[:2])
            lowering, choice = _lowering(recipe, reason, operands), ""
            if not reason and recipe.choose == "roofline":
                reason, lowering, choice = _chosen(recipe, site, compute, operands)
            found.append(Fp8Op(name, prim, lhs, rhs, not reason, reason, lowering, choice))
        if prim not in OWN_RULES:
            for sub in jaxprs_in_params(eqn.params):
                _walk(sub, recipe, found, compute, kept)


def fp8_ops(
    fun: Callable, recipe: Fp8Recipe, *args: Any, compute_dtype: Any = jnp.bfloat16
) -> list[Fp8Op]:
    """Each `dot_general` and convolution of `fun(*args)`, in order, with its fp8 choice.

    What `autocast(fun, policy, fp8=recipe)` (default `OpLists`) does with each op of the
    forward function: an fp8 GEMM, or the compute dtype and why (batched, too small,
    excluded, one of the last GEMMs `Fp8Recipe.high_precision_last` keeps, or a convolution
    other than 1x1; see `Fp8Recipe.convs`). Ops inside
    `custom_vjp` functions are not listed: autocast binds those as traced. The backward
    pass follows the forward: an fp8 op's two gradient GEMMs are fp8 too.

    Args:
      fun: the function (array arguments only; bind the others with `functools.partial`).
      recipe: the `Fp8Recipe`.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct` values).
      compute_dtype: the policy's compute dtype (its size enters `choose="roofline"`).

    Returns:
      A list of `Fp8Op`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax.fp8 import fp8_ops
      >>> f = lambda x, w: x @ w
      >>> [op.fp8 for op in fp8_ops(f, Fp8Recipe(), jnp.ones((64, 64)), jnp.ones((64, 64)))]
      [True]
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"fp8_ops: recipe must be an mpjax Fp8Recipe, got {type(recipe).__name__}")
    found: list[Fp8Op] = []
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    paths = nnx_leaf_names(args, {})
    names = {v: paths[i] for i, v in enumerate(jaxpr.invars) if i in paths}
    _walk(jaxpr, recipe, found, np.dtype(compute_dtype), kept_last(recipe, jaxpr), names)
    return found
