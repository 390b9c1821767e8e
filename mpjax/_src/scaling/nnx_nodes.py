"""mpjax's state nodes back from the `flax.nnx.State`s that `nnx.Optimizer` turns them into.

`nnx.Optimizer` stores each param's optimizer-state subtree in a Variable and, after each
update, writes the new state back through `nnx.state(new_opt_state)`: a pytree node inside a
Variable (a `Remainder` master, a `Blockwise8` int8 moment) comes back as an `nnx.State`
keyed by its fields. The next update reads them here as the nodes they stand for. Recognised
by the class's module, so this layer does not import Flax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from mpjax._src.scaling.blockwise8 import Blockwise8
from mpjax._src.scaling.master import NoMaster, Remainder

__all__ = ["is_flax_nnx", "loss_scaled_from_nnx", "nodes_from_nnx"]


def is_flax_nnx(x: Any) -> bool:
    """A flax.nnx object (nnx.Optimizer stores opt_state leaves in Variables), by its module.

    Never by duck typing: a user's container may answer any attribute (the JAX training
    cookbook's `dot_dict`, whose `__getattr__` is `__getitem__`, raises KeyError for
    `get_value`).
    """
    return any(c.__module__.startswith("flax.nnx") for c in type(x).__mro__)


def _stand_in(x: Any, master: bool) -> bool:
    """An nnx.State standing for one of mpjax's nodes (an empty one: `NoMaster`, in a master)."""
    keys = ({"remainder"}, {"codes", "scales"}, set()) if master else ({"codes", "scales"},)
    return is_flax_nnx(x) and isinstance(x, Mapping) and set(x) in keys


def _node(x: Any, master: bool) -> Any:
    if not _stand_in(x, master):
        return x
    if not x:
        return NoMaster()  # a master-less param's node (it has no children)
    if set(x) == {"remainder"}:
        return Remainder(x["remainder"])
    return Blockwise8(x["codes"], x["scales"])


def nodes_from_nnx(tree: Any, *, master: bool = False) -> Any:
    """`tree` with each nnx.State standing for a `Blockwise8` (and in a master tree, for a
    `Remainder` or `NoMaster`) replaced by that node; any other tree is returned as it is.

    Args:
      tree: a `loss_scaled` master tree or an optimizer state.
      master: whether `tree` is a `loss_scaled` master tree.

    Returns:
      The tree with mpjax's nodes.
    """
    return jax.tree.map(lambda x: _node(x, master), tree, is_leaf=lambda x: _stand_in(x, master))


def loss_scaled_from_nnx(state: Any) -> Any:
    """A `LossScaledState` with the nodes of its master and inner state read back."""
    return state._replace(
        master=nodes_from_nnx(state.master, master=True),
        inner_state=nodes_from_nnx(state.inner_state),
    )
