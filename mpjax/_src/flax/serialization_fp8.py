"""Checkpointing of block-quantised weight copies through `flax.serialization` (and so
`to_bytes` / `from_bytes`, msgpack checkpoints and Flax's `TrainState`).

A training state may hold `mpjax.fp8.weight_copies`' `WeightCopies` (kept across micro-batches
under gradient accumulation). Each of its classes is registered with Flax's public
`register_serialization_state`: the state dict holds the arrays of each field, by name (the
8-bit and 4-bit elements and scales in their own dtypes, which msgpack stores bit for bit);
the static configuration (sites, tree structure, block sizes) comes from the restore target,
as for the loss scales. A restore checks each array's shape and dtype against the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

import flax.serialization
from mpjax._src.fp8.blocks import BlockQuantized
from mpjax._src.fp8.oriented import OrientedBlocks
from mpjax._src.fp8.weight_copies import WeightCopies

__all__: list[str] = []


def _fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if not f.metadata.get("static", False)]


def _state_dict(obj: Any) -> dict:
    out = {}
    for name in _fields(obj):
        value = getattr(obj, name)
        if isinstance(value, tuple):  # WeightCopies.copies: one entry per site
            out[name] = {str(i): flax.serialization.to_state_dict(v) for i, v in enumerate(value)}
        elif value is not None:
            out[name] = flax.serialization.to_state_dict(value)
    return out


def _restore_array(target: Any, state: Any, where: str) -> Any:
    value = np.asarray(state)
    if value.shape != tuple(target.shape) or value.dtype != np.dtype(target.dtype):
        raise ValueError(
            f"{where}: the checkpoint holds {value.dtype}{list(value.shape)}, the target "
            f"{np.dtype(target.dtype)}{list(target.shape)}: restore into a target made by "
            "weight_copies from weights of the checkpoint's shapes and recipe"
        )
    return jax.numpy.asarray(value)


def _restore_value(target: Any, state: Any, where: str) -> Any:
    if target is None:
        if state is not None:
            raise ValueError(f"{where}: the checkpoint holds a value, the target None")
        return None
    if state is None:
        raise ValueError(f"{where}: the checkpoint lacks it")
    if isinstance(target, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return _restore_array(target, state, where)
    return flax.serialization.from_state_dict(target, state, name=where)


def _restore(target: Any, state: dict) -> Any:
    where = type(target).__name__
    values = {}
    for name in _fields(target):
        value = getattr(target, name)
        if isinstance(value, tuple):
            entries = state.get(name, {})
            if len(entries) != len(value):
                raise ValueError(
                    f"{where}.{name}: the checkpoint holds {len(entries)} copies, the target "
                    f"{len(value)}: restore into copies made from the same function and weights"
                )
            values[name] = tuple(
                _restore_value(v, entries.get(str(i)), f"{where}.{name}[{i}]")
                for i, v in enumerate(value)
            )
        else:
            values[name] = _restore_value(value, state.get(name), f"{where}.{name}")
    return target.replace(**values)


for _cls in (WeightCopies, OrientedBlocks, BlockQuantized):
    flax.serialization.register_serialization_state(_cls, _state_dict, _restore)
