"""`Fp8Recipe.high_precision_last` / `_first`: which of a program's last and first GEMMs keep
the compute dtype.

The eligible GEMMs (those `autocast(fp8=recipe)` would run in fp8: `fp8_eligible` on a
`dot_general`, or a 1x1 convolution's GEMM) are listed in the order the forward program runs
them, sub-jaxprs (`jit`, `remat`, `cond`, `scan`, `while`, `custom_jvp`) inline; a `scan`
body's GEMM counts once per iteration. The last `recipe.high_precision_count(count)` of
them (and the first `recipe.high_precision_count(count, "first")`) keep the compute dtype,
except that the kept run stops at the first GEMM, from its end of the program, that cannot
stay alone: one inside a `scan` / `while` body (it runs for every layer of a
stacked model) or one whose equation also runs earlier (a jitted function called twice shares
its jaxpr).
Autocast binds a kept GEMM under the name scope `KEPT_SCOPE`, which `mpjax.report` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

from mpjax._src.autocast.regions import in_nested_region
from mpjax._src.fp8.conv import conv_gemm_site
from mpjax._src.fp8.dot import fp8_eligible
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = ["KEPT_SCOPE", "OWN_RULES", "kept_last"]

# The name scope autocast binds a kept GEMM under (its HLO op_name shows it: `mpjax.report`).
KEPT_SCOPE = "mpjax_high_precision_last"

# autocast binds these as traced (their own rules), so nothing inside them turns fp8.
OWN_RULES = ("custom_vjp_call",)


class _Site(NamedTuple):
    """One run of an eligible GEMM: its equation, and how many times it runs (a scan's
    length; 0 inside a `while`, whose trip count is unknown: it never stays)."""

    eqn: Any
    runs: int


def _eligible(recipe: Fp8Recipe, eqn) -> bool:
    prim = eqn.primitive.name
    if prim not in ("dot_general", "conv_general_dilated") or len(eqn.invars) != 2:
        return False
    if not all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
        return False
    name = str(eqn.source_info.name_stack)
    lhs, rhs = (tuple(np.shape(v.aval)) for v in eqn.invars)
    if prim == "conv_general_dilated":
        return conv_gemm_site(recipe, name, lhs, rhs, eqn.params)[0] is not None
    return fp8_eligible(recipe, Fp8Site(name, lhs, rhs, eqn.params["dimension_numbers"]))


def _sites(recipe: Fp8Recipe, jaxpr, lower: Callable, runs: int, out: list) -> None:
    for eqn in jaxpr.eqns:
        if in_nested_region(eqn):  # an inner autocast's region: its own rule
            continue
        if lower(eqn) and _eligible(recipe, eqn):
            out.append(_Site(eqn, runs))
        prim = eqn.primitive.name
        if prim in OWN_RULES:
            continue
        inner = runs * eqn.params["length"] if prim == "scan" else 0 if prim == "while" else runs
        for sub in jaxprs_in_params(eqn.params):
            _sites(recipe, sub, lower, inner, out)


def _end(sites: list, want: int, seen: dict) -> tuple[list, str]:
    """The first `want` of `sites` that can stay alone, and why the run stopped short."""
    kept: list[_Site] = []
    for s in sites:
        if len(kept) == want:
            break
        if s.runs != 1:
            return kept, "inside a lax.scan / while body (runs for every layer)"
        if seen[id(s.eqn)] > 1:
            return kept, "whose equation runs more than once (a shared jitted function)"
        kept.append(s)
    return kept, ""


def _why(recipe: Fp8Recipe, end: str, kept: int, want: int, total: int, stop: str) -> str:
    rule = getattr(recipe, f"high_precision_{end}")
    resolved = recipe.high_precision_rule if end == "last" else recipe.high_precision_first_rule
    said = f"{rule!r}" if rule is not None else f"None ({resolved} for {recipe.scaling})"
    short = f"; stopped at a GEMM {stop} after {kept} of {want}" if stop else ""
    return (
        f"high_precision_{end}={said}: one of the {end} {kept} of {total} eligible GEMMs, "
        f"kept in the compute dtype{short} (high_precision_{end}=0 runs it in "
        f"{recipe.scaling})"
    )


def kept_last(recipe: Fp8Recipe | None, jaxpr, lower: Callable | None = None) -> dict[int, str]:
    """{id(equation): why it keeps the compute dtype} for the GEMMs the rules keep.

    `Fp8Recipe.high_precision_last` from the end of the program, then
    `high_precision_first` from its start.

    Args:
      recipe: the `Fp8Recipe` (None: nothing is kept).
      jaxpr: the forward program (a `Jaxpr`).
      lower: `eqn -> bool`, whether the op lists run the op in the compute dtype at all
        (autocast's "lower" category); default: every GEMM.

    Returns:
      A dict from `id(eqn)` to the reason `fp8_ops` reports; empty when the rules keep none.
    """
    if recipe is None or not (recipe.high_precision_rule or recipe.high_precision_first_rule):
        return {}
    sites: list[_Site] = []
    _sites(recipe, jaxpr, lower or (lambda eqn: True), 1, sites)
    total = sum(max(s.runs, 1) for s in sites)
    seen: dict[int, int] = {}
    for s in sites:
        seen[id(s.eqn)] = seen.get(id(s.eqn), 0) + 1
    out: dict[int, str] = {}
    for end, order in (("first", sites), ("last", sites[::-1])):
        want = recipe.high_precision_count(total, end)
        if want:
            kept, stop = _end(order, want, seen)
            why = _why(recipe, end, len(kept), want, total, stop)
            out.update({id(s.eqn): why for s in kept})
    return out
