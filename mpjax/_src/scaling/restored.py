"""Old and target-less restored states, recognised where mpjax's entry points meet them.

A checkpoint restored without a target (`ocp.StandardCheckpointer().restore(path)`,
`flax.serialization.msgpack_restore(blob)`, flax's `restore_checkpoint(dir, None)`) is a tree of
dicts; a `LossScaledState` of mpjax 6a474e7 or older has no `layout_version` (a dict without
the key, or a state unpickled with the field's default None). Either one reaches the update,
`scale_loss` and the other state helpers; they answer with the way through
`mpjax.upgrade_state` instead of a bare type error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["old_state_message", "restored_state_in"]

_STATE_KEYS = {"inner_state", "master", "loss_scale"}  # what every LossScaledState dict holds
_FIX = (
    "restore it through mpjax.upgrade_state(old, template), the template being today's "
    "tx.init(params) (or the tree holding it) of the optimizer and params that wrote it "
    "(see docs/guides/migration.md)"
)


def _is_state_dict(x: Any) -> bool:
    return isinstance(x, Mapping) and _STATE_KEYS <= {str(k) for k in x}


def restored_state_in(tree: Any, path: str = "", depth: int = 0) -> tuple[str, Any] | None:
    """The path and node of the first `loss_scaled` state dict in a tree of dicts and lists.

    Args:
      tree: anything; only plain `Mapping`, list and tuple nodes are searched (a `NamedTuple`
        is mpjax's or optax's own state, not a restored dict).
      path: the path of `tree`.
      depth: the nesting searched so far (the search stops at 32).

    Returns:
      `(path, node)`, or None.
    """
    if _is_state_dict(tree):
        return path or "<root>", tree
    if depth > 32:
        return None
    if isinstance(tree, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in tree.items()]
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(tree)]
    else:
        return None
    for where, v in items:
        found = restored_state_in(v, where, depth + 1)
        if found is not None:
            return found
    return None


def old_state_message(what: str, state: Any, where: str = "") -> str | None:
    """The message for an old or target-less `loss_scaled` state, or None for another value.

    Args:
      what: the entry point, as its messages begin ("loss_scaled").
      state: a `LossScaledState`, or a state dict (`restored_state_in`'s node).
      where: the state's path in the tree given, if not the tree itself.

    Returns:
      A sentence naming the state's kind and `mpjax.upgrade_state`, or None.
    """
    at = f" at {where}" if where and where != "<root>" else ""
    if hasattr(state, "_fields") and "layout_version" in state._fields:
        if state.layout_version is not None:
            return None
        return (
            f"{what}: the LossScaledState{at} has no layout_version (None): it is a state of "
            f"mpjax 6a474e7 or older (e.g. unpickled), in that release's layout; {_FIX}"
        )
    if not _is_state_dict(state):
        return None
    if "layout_version" not in state or state["layout_version"] is None:
        kind = (
            "a loss_scaled state of mpjax 6a474e7 or older (a dict without layout_version, "
            "as orbax and flax restore a checkpoint without a target)"
        )
    else:
        kind = "a loss_scaled state restored without a target (a dict, not a LossScaledState)"
    return f"{what}: the state{at} is {kind}; {_FIX}"
