"""Module paths from JAX's name stack (the `op_name` of HLO metadata).

`jit(step)/transpose(jvp(Model.apply))/Model/Model.__call__/blk/Dense_0/dot_general` names a
dot of the backward pass (`transpose(...)`) in the Flax module `blk/Dense_0` of the root class
`Model`. The path keeps the module scopes: jit scopes, transform wrappers (`jvp(...)`), method
scopes (`Model.__call__`), the last part (the primitive), the root class (recognised by a method
or `.apply` naming it), the `module` child of mpjax's linen policy wrapper and the scope
autocast puts a GEMM kept by `Fp8Recipe.high_precision_last` under are dropped. A
name stack with no scope left names the innermost jitted function (`jit(loss)` -> `loss`).
What `loss_scaled` adds to a step (its name scope) is one path, `LOSS_SCALING`, and the
optimizer it wraps another, `OPTIMIZER`.
"""

from __future__ import annotations

import re

from mpjax._src.autocast.fp8_last import KEPT_SCOPE
from mpjax._src.scaling.scopes import INNER_SCOPE, LOSS_SCALING_SCOPE

__all__ = ["LOSS_SCALING", "OPTIMIZER", "library_last", "split_op_name"]

LOSS_SCALING = "mpjax: loss scaling"  # loss_scaled's and scale_loss's own ops, as one row
OPTIMIZER = "optimizer"  # the optimizer loss_scaled wraps (its update, under loss_scaled)

_CALL = re.compile(r"^([\w<>\-]+)\((.*)\)$")
_WRAPPER = "PolicyModule"  # mpjax's linen policy wrapper; it calls its model `module`


def _split(op_name: str) -> list[str]:
    """`op_name` split at the slashes outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in op_name:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "/" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p]


def _classes(op_name: str) -> set[str]:
    """Class names the name stack shows methods of (`Model.apply`, `Model.__call__`)."""
    return set(re.findall(r"(?:^|[/(])(\w+)\.\w+", op_name))


def split_op_name(op_name: str) -> tuple[str, str]:
    """(module path or function name, "forward" | "backward") of an HLO `op_name`.

    Args:
      op_name: the `op_name` of an instruction's metadata.

    Returns:
      The path (`""` when the name stack names nothing) and the pass.

    Example:
      >>> from mpjax._src.report.paths import split_op_name
      >>> split_op_name("jit(step)/transpose(jvp(M.apply))/M/blk/Dense_0/dot_general")
      ('blk/Dense_0', 'backward')
    """
    parts = _split(op_name)
    backward = any(p.startswith("transpose(") for p in parts)
    function, scopes = "", []
    for part in parts[:-1]:
        call = _CALL.match(part)
        if call and call.group(1) in ("jit", "pjit"):
            function = call.group(2)
        elif not call and "." not in part and part != KEPT_SCOPE:
            scopes.append(part)
    if LOSS_SCALING_SCOPE in scopes:
        path = OPTIMIZER if INNER_SCOPE in scopes else LOSS_SCALING
        return path, "backward" if backward else "forward"
    classes = _classes(op_name)
    if scopes and scopes[0] in classes:
        root = scopes.pop(0)
        if root == _WRAPPER and scopes[:1] == ["module"]:
            scopes.pop(0)
    path = "/".join(scopes) or function
    return path, "backward" if backward else "forward"


def library_last(path: str) -> tuple:
    """Sort key of module paths: the model's, then `OPTIMIZER`, then `LOSS_SCALING`."""
    return (path in (OPTIMIZER, LOSS_SCALING), path == LOSS_SCALING, path)
