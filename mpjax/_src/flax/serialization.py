"""Checkpointing of the loss scales through `flax.serialization` (and so orbax and Flax's
`TrainState`): the numeric state is stored; the configuration comes from the restore target,
so it is never lost (jmp loses its minimum here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import flax.serialization
from mpjax._src.scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)

__all__: list[str] = []


def _state_dict(ls: LossScale) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(ls)[0]:
        out[path[0].name] = flax.serialization.to_state_dict(leaf)
    return out


def _restore(target: LossScale, state: dict) -> LossScale:
    leaves, treedef = jax.tree.flatten(target)
    names = [p[0].name for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]]
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"{type(target).__name__}: checkpoint lacks {missing}")
    new = [
        jnp.asarray(flax.serialization.from_state_dict(leaf, state[name]), leaf.dtype)
        for name, leaf in zip(names, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, new)


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    flax.serialization.register_serialization_state(_cls, _state_dict, _restore)
