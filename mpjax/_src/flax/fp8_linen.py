"""Fp8 GEMMs for Flax linen `Dense`/`DenseGeneral` under `apply_policy(fp8=...)`.

Delayed scaling keeps amax-history state in the `"fp8_meta"` collection; the stateless
recipes (tensorwise, rowwise and the block-scaled `"mxfp8"` / `"nvfp4"` / `"blockwise"`)
run each eligible GEMM through `mpjax.fp8.fp8_dot_general` and add no variables.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np
from jax import lax

import flax.linen as nn
from mpjax._src.fp8.delayed import (
    FP8_META,
    delayed_site_dot,
    excluded_by_name,
    init_fp8_meta,
    kernel_eligible,
)
from mpjax._src.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = [
    "DELAYED_MODULES",
    "DelayedFp8",
    "check_policy_fp8",
    "delayed_fp8_override",
    "stateless_site_dot",
]

# The linen modules whose GEMM takes a `dot_general` field, which delayed fp8 replaces.
DELAYED_MODULES = (nn.Dense, nn.DenseGeneral)


class DelayedFp8(NamedTuple):
    """`apply_policy`'s fp8 configuration: the recipe and (delayed scaling) the pmap axis name."""

    recipe: Fp8Recipe
    axis_name: Any = None


def check_policy_fp8(fp8: Any, axis_name: Any) -> DelayedFp8 | None:
    """Validates `apply_policy`'s `fp8` / `fp8_axis_name` arguments.

    Refuses a recipe that asks explicitly to keep the program's last or first GEMMs
    (`high_precision_last`/`high_precision_first` set above 0): module by module, which GEMMs
    are last is unknown. NVFP4's default rule (`high_precision_last=None`) is not applied
    here (every covered GEMM runs in NVFP4, as before the rule existed): `exclude=` the
    last layers by name for NVIDIA's recipe.
    """
    if fp8 is None:
        if axis_name is not None:
            raise ValueError("apply_policy: fp8_axis_name is given but fp8 is None")
        return None
    if not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"apply_policy: fp8 must be an mpjax Fp8Recipe, got {type(fp8).__name__}")
    if fp8.scaling != "delayed" and axis_name is not None:
        raise ValueError(
            f"apply_policy: fp8_axis_name={axis_name!r} reduces delayed scaling's amaxes; "
            f"scaling={fp8.scaling!r} keeps no state, so drop fp8_axis_name"
        )
    explicit_last = fp8.high_precision_last is not None and fp8.high_precision_rule
    if explicit_last or fp8.high_precision_first_rule:
        said = "this recipe's"
        raise ValueError(
            f"apply_policy: Fp8Recipe(scaling={fp8.scaling!r}) keeps the program's last (or "
            f"first) GEMMs in the compute dtype (high_precision_last: {said}, "
            f"high_precision_first: {fp8.high_precision_first_rule}), and apply_policy, which "
            "sees one module at a time, cannot tell which GEMMs are last; pass "
            "high_precision_last=0, high_precision_first=0 and exclude= those layers by name "
            "(e.g. exclude=('*/head', '*/block_11/*')), or use mpjax.autocast, which applies "
            "the rule"
        )
    return DelayedFp8(fp8, axis_name)


def stateless_site_dot(recipe: Fp8Recipe, name: str, lhs, rhs, dims, precision, preferred):
    """One call of a covered GEMM under a stateless recipe: `fp8_dot_general` when the call
    is eligible (`fp8_eligible` on its shapes and `name`), else `lax.dot_general`."""
    site = Fp8Site(name, np.shape(lhs), np.shape(rhs), dims)
    if not fp8_eligible(recipe, site):
        return lax.dot_general(lhs, rhs, dims, precision, preferred)
    return fp8_dot_general(lhs, rhs, dims, recipe, preferred or lhs.dtype)


@contextlib.contextmanager
def delayed_fp8_override(module: nn.Module, name: str, config: DelayedFp8 | None):
    """For one call of a `Dense`/`DenseGeneral`, sets its `dot_general` to the fp8 one.

    A stateless recipe (not `"delayed"`) runs the call through `fp8_dot_general` when
    `fp8_eligible` takes it (sizes, `exclude` / `exclude_if` against `name`), with no
    variables. Under delayed scaling, a kernel whose contracting and output sizes are
    multiples of 16 and at least `recipe.min_dim`, not excluded by `recipe.exclude` /
    `exclude_if` (matched against `name`, e.g. `"LM/head"`), gets `amax_history` /
    `scale` variables in the `"fp8_meta"` collection; its GEMM runs in fp8 when the
    activation's free size is a multiple of 16 (else in the compute dtype, recording no amax).

    Raises:
      ValueError: the module sets its own `dot_general` / `dot_general_cls`.
    """
    if config is None or not isinstance(module, DELAYED_MODULES):
        yield
        return
    if module.dot_general is not None or module.dot_general_cls is not None:
        if excluded_by_name(config.recipe, name):  # excluded: its own dot_general runs
            yield
            return
        raise ValueError(
            f"apply_policy(fp8=...): module {name!r} sets its own dot_general/dot_general_cls; "
            "exclude it with Fp8Recipe(exclude=...) or drop its custom dot_general"
        )
    recipe = config.recipe

    def dot(lhs, rhs, dims, precision=None, preferred_element_type=None):
        if recipe.scaling != "delayed":
            return stateless_site_dot(
                recipe, name, lhs, rhs, dims, precision, preferred_element_type
            )
        site = Fp8Site(name, np.shape(lhs), np.shape(rhs), dims)
        if not kernel_eligible(recipe, site):
            return lax.dot_general(lhs, rhs, dims, precision, preferred_element_type)
        state = init_fp8_meta(recipe)
        history = module.variable(FP8_META, "amax_history", lambda: state["amax_history"])
        scale = module.variable(FP8_META, "scale", lambda: state["scale"])
        del history  # updated by update_fp8_meta, outside the forward pass
        return delayed_site_dot(
            lhs, rhs, dims, scale.value, recipe, config.axis_name, precision, preferred_element_type
        )

    saved = module.__dict__.get("dot_general")
    object.__setattr__(module, "dot_general", dot)
    try:
        yield
    finally:
        object.__setattr__(module, "dot_general", saved)
