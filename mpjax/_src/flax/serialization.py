"""Checkpointing of the loss scales through `flax.serialization` (and so orbax and Flax's
`TrainState`): the numeric state is stored; the configuration comes from the restore target,
so it is never lost (jmp loses its minimum here)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import flax.serialization
from mpjax._src.scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from mpjax._src.scaling.master import NoMaster, Remainder

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


# The master weights of `loss_scaled` (see `mpjax/_src/scaling/master.py`). A checkpoint
# records each leaf's kind, so a restore into another `master_weights` mode converts where
# that is exact, and otherwise fails here, naming the leaf and the fix.
_CONVERT = (
    "restore into a target built with the checkpoint's master_weights, then convert with "
    "mpjax.with_master_weights(opt_state, params, master_weights)"
)


def _no_master_state_dict(_: NoMaster) -> dict:
    return {}


def _no_master_restore(target: NoMaster, state: Any) -> NoMaster:
    # A master saved here (by "auto", True or "remainder") is dropped: a target that keeps
    # no master (master_weights=False) trains on the params, which are restored as saved.
    del state
    return target


def _remainder_state_dict(m: Remainder) -> dict:
    return {"remainder": flax.serialization.to_state_dict(m.remainder)}


def _remainder_restore(target: Remainder, state: Any) -> Remainder:
    if isinstance(state, dict) and set(state) == {"remainder"}:
        state = state["remainder"]
    elif isinstance(state, dict) and not state:
        # Saved with master_weights=False: the param is its own master, remainder zero.
        return Remainder(jnp.zeros_like(target.remainder))
    dtype = getattr(state, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.int16:
        what = f"a {jnp.dtype(dtype).name} master" if dtype is not None else type(state).__name__
        raise ValueError(
            f"loss_scaled checkpoint: {flax.serialization.current_path()} holds {what}, "
            "but the target keeps int16 remainders (master_weights='remainder'): the "
            f"checkpoint was taken with master_weights='auto' or True; {_CONVERT}"
        )
    return Remainder(jnp.asarray(state, jnp.int16))  # a bare int16 leaf: an older state


flax.serialization.register_serialization_state(NoMaster, _no_master_state_dict, _no_master_restore)
flax.serialization.register_serialization_state(
    Remainder, _remainder_state_dict, _remainder_restore
)

# block-quantised weight copies (`mpjax.fp8.weight_copies`) in a training state
from mpjax._src.flax import serialization_fp8 as _serialization_fp8  # noqa: E402, F401
