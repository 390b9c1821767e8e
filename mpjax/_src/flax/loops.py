"""Loop carries under a policy: a carry leaves a loop body in the dtype it entered.

`lax.scan` (and so `nn.scan`, `nnx.scan`, `nn.while_loop`, `nnx.fori_loop`) requires the
carry a body returns to have the dtype it was given. A policy casts a module's inputs to its
compute dtype and its outputs to its output dtype, so a module run as a loop body over a
carry that enters in float32 (a residual stream upcast before scanned layers, as Flax's
lm1b decoder does) would return it in bfloat16. The linen and NNX integrations therefore
cast the carry such a module returns back to the dtype its first argument entered in.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.extend

import flax.linen as nn
from mpjax._src.core.policy import is_floating_array

__all__ = ["current_trace", "in_lifted_loop", "keep_carry_dtype"]

# A lifted loop in the name Flax gives the scope of a lifted transform's clone.
_LOOP_SCOPE = re.compile(r"(^|\()(scan|while_loop)\(")


def in_lifted_loop(module: nn.Module) -> bool:
    """Whether the linen `module` is the body `nn.scan` or `nn.while_loop` runs (its clone).

    Flax names the scope of a lifted transform's clone after the transforms around it
    (`Scope.debug_path`, e.g. `"scan(ScanBlock_0)"`, `"remat(scan(ScanRematBlock_0))"`).
    """
    scope = module.scope
    if isinstance(module.parent, nn.Module) or not scope.debug_path:
        return False
    return _LOOP_SCOPE.search(str(scope.debug_path[-1])) is not None


def current_trace() -> Any:
    """The JAX trace now running (compared with `==`), as NNX's own trace checks take it."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


def keep_carry_dtype(carry: Any, out: Any) -> Any:
    """`out` with the carry it returns cast back to the dtypes `carry` entered in.

    The carry returned is `out[0]` for a scan body (`(carry, ys)`), else `out` itself (a
    `while_loop` body, or a layer whose output is the carry); when neither has `carry`'s
    structure, `out` is returned as it is (the loop then names the mismatch).

    Args:
      carry: the module's first argument, as it entered (before the policy's cast).
      out: what the module returns, after the policy's cast.

    Returns:
      `out`, its carry's floating leaves in the dtypes of `carry`'s.
    """

    def like(value: Any) -> Any:
        def cast(c, v):
            if is_floating_array(c) and is_floating_array(v) and v.dtype != c.dtype:
                return v.astype(c.dtype)
            return v

        return jax.tree.map(cast, carry, value)

    structure = jax.tree.structure(carry)
    if isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == structure:
        return (like(out[0]), out[1])
    if jax.tree.structure(out) == structure:
        return like(out)
    return out
