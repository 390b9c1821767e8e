"""Autocast's fp8 saved activations (`Policy.saved_activations`): which GEMM operands, and how.

A lower-precision `dot_general` without batch dimensions (a linear layer; attention's
batched products are left alone, as Transformer Engine leaves them) or a convolution keeps
its activation operands for the backward pass in fp8 (`mpjax._src.fp8.saved`). An operand
is an activation unless it is parameter-like: an argument of the autocast function (the
parameters and the batch, alive for the whole step anyway), a constant, or such a value
moved by layout ops only (a transposed tied embedding, a reshaped kernel).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from mpjax._src.autocast.rules import ARG, dtype_of, is_float
from mpjax._src.fp8.saved import saved_in_fp8

__all__ = ["lower_saved", "saved_candidate", "saved_operands"]

# Ops that move or reinterpret a value without computing from it.
_LAYOUT = frozenset(
    {
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "expand_dims",
        "reshape",
        "rev",
        "slice",
        "squeeze",
        "transpose",
    }
)
_MAX_WALK = 32


def saved_candidate(eqn: Any) -> bool:
    """Whether a `dot_general`/conv equation may keep an operand in fp8 (from its shapes)."""
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated") or len(eqn.invars) != 2:
        return False
    if not all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
        return False
    if name == "dot_general":
        (_, _), (lb, _) = eqn.params["dimension_numbers"]
        return not lb
    return True


def _param_like(atom: Any, producers: dict, env: dict, constant: set) -> bool:
    for _ in range(_MAX_WALK):
        if isinstance(atom, Literal) or atom in constant or env[atom][1] == ARG:
            return True
        eqn = producers.get(atom)
        if eqn is None or eqn.primitive.name not in _LAYOUT:
            return False
        atom = eqn.invars[0]
    return False


def saved_operands(eqn: Any, producers: dict, env: dict, constant: set) -> tuple | None:
    """Which operands of `eqn` to keep in fp8 (activations), or None (none of them).

    Args:
      eqn: a lower-precision equation.
      producers: variable -> the equation of the current jaxpr producing it.
      env: autocast's environment (variable -> (value, origin)).
      constant: the variables computed from constants alone.
    """
    if not saved_candidate(eqn):
        return None
    which = [
        np.ndim(env[a][0]) > 0 and not _param_like(a, producers, env, constant)
        if not isinstance(a, Literal)
        else False
        for a in eqn.invars
    ]
    if eqn.primitive.name == "conv_general_dilated":
        which[1] = False  # the kernel
    return tuple(which) if any(which) else None


def _axes(eqn: Any, shapes: list) -> tuple:
    """The amax axes of each operand: its contracting axes (conv: the input features)."""
    if eqn.primitive.name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        return tuple(lc), tuple(rc)
    specs = lax.conv_dimension_numbers(*shapes, eqn.params["dimension_numbers"])
    return (specs.lhs_spec[1],), None


def lower_saved(lower: Any, eqn: Any, vals: list, which: tuple, dtype: np.dtype) -> list:
    """`lower(vals)` (autocast's GEMM lowering, one output) keeping `which` in fp8.

    Only floating, non-scalar operands are kept in fp8; the lowering and its VJP are
    otherwise unchanged (see `mpjax._src.fp8.saved.saved_in_fp8`).
    """
    which = tuple(w and is_float(dtype_of(v)) for w, v in zip(which, vals, strict=True))
    if not any(which):
        return lower(vals)
    axes = _axes(eqn, [np.shape(v) for v in vals])
    return [saved_in_fp8(lambda *xs: lower(list(xs))[0], vals, which, axes, dtype)]
