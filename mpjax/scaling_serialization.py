"""flax.serialization of the loss scales (checkpoints through `flax.serialization` and orbax).

The state dict holds the numeric state (the leaves, by field name); the configuration comes
from the restore target, so it is never lost (jmp loses its minimum here). This module
imports Flax, so it belongs to the Flax layer; `import mpjax` registers it.
"""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp

from mpjax.scaling.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale

__all__: list[str] = []


def _leaf_names(ls: LossScale) -> list[str]:
    return [path[0].name for path, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]


def _state_dict(ls: LossScale) -> dict:
    leaves = jax.tree.leaves(ls)
    return {
        name: flax.serialization.to_state_dict(leaf)
        for name, leaf in zip(_leaf_names(ls), leaves, strict=True)
    }


def _restore(target: LossScale, state: dict) -> LossScale:
    leaves, treedef = jax.tree.flatten(target)
    names = _leaf_names(target)
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"{type(target).__name__}: checkpoint lacks {missing}")
    new = [
        jnp.asarray(flax.serialization.from_state_dict(leaf, state[name]), leaf.dtype)
        for name, leaf in zip(names, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, new)


def _register() -> None:
    for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
        flax.serialization.register_serialization_state(cls, _state_dict, _restore)


_register()
