"""The fp8 branch of `autocast`: which `dot_general`s run as fp8 GEMMs, and the rebinding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["check_autocast_recipe", "fp8_lower"]


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


def fp8_lower(
    recipe: Fp8Recipe, compute: np.dtype, eqn, vals: list, lhs_quant: Callable | None = None
) -> list | None:
    """The fp8 GEMM for a `dot_general` equation, or None if it stays in the compute dtype.

    `vals` are the operands in the dtypes they arrived in (float32 masters are quantised
    directly, without a compute-dtype copy); the output is in `compute`. `lhs_quant()`, if
    given, returns a float32 recomputation of the left operand to quantise (or None; see
    `mpjax.fp8.recompute`).
    """
    if eqn.primitive.name != "dot_general" or len(vals) != 2:
        return None
    if not all(jnp.issubdtype(jnp.result_type(v), jnp.floating) for v in vals):
        return None
    dims = eqn.params["dimension_numbers"]
    site = Fp8Site(str(eqn.source_info.name_stack), np.shape(vals[0]), np.shape(vals[1]), dims)
    if not fp8_eligible(recipe, site):
        return None
    quant = None if lhs_quant is None else lhs_quant()
    return [fp8_dot_general(vals[0], vals[1], dims, recipe, compute, lhs_quant=quant)]
