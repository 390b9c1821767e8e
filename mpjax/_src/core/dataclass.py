"""Frozen dataclasses registered as pytrees, with static (configuration) fields.

A small, Flax-free analogue of `flax.struct.PyTreeNode`: fields are leaves unless declared
with `field(static=True)`, which puts them in the tree definition (so they survive
`jax.jit`, flatten/unflatten and checkpoint round trips, and must be hashable). Unflatten
and `replace` bypass the class's `__init__`, which may therefore validate and take its
own arguments: leaves may be tracers or placeholders there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["field", "pytree_dataclass"]


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; `static=True` makes it configuration (tree definition), not a leaf.

    Example:
      >>> from mpjax._src.core.dataclass import field
      >>> field(static=True, default=3).metadata["static"]
      True
    """
    return dataclasses.field(metadata={"static": static}, **kwargs)


def _split_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static = tuple(f.name for f in fields if f.metadata.get("static", False))
    return data, static


def _build(cls: type, values: dict) -> Any:
    """A new instance with these field values, bypassing `__init__`."""
    obj = object.__new__(cls)
    _set_fields(obj, **values)
    return obj


def _set_fields(self: Any, **values: Any) -> None:
    """Sets fields of a frozen instance; for a custom `__init__` only."""
    for name, value in values.items():
        object.__setattr__(self, name, value)


def _replace(self: Any, **changes: Any) -> Any:
    """Returns a copy with some fields replaced (no `__init__` validation)."""
    names = [f.name for f in dataclasses.fields(self)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"{type(self).__name__}.replace: unknown fields {unknown}")
    values = {name: getattr(self, name) for name in names}
    values.update(changes)
    return _build(type(self), values)


def pytree_dataclass(cls: type) -> type:
    """Makes `cls` a frozen dataclass (identity equality) registered as a pytree with keys.

    Leaves are the non-static fields, in declaration order, keyed by `GetAttrKey(name)`;
    static fields form the tree definition. A `replace(**changes)` method is added unless the
    class defines one. `__init__` is the dataclass's unless the class defines its own
    (which must set fields with `object.__setattr__`, or `self._set(...)`).

    Args:
      cls: the class to decorate.

    Returns:
      The decorated class.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax
      >>> from mpjax._src.core.dataclass import field, pytree_dataclass
      >>> @pytree_dataclass
      ... class Counter:
      ...     count: jnp.ndarray
      ...     limit: int = field(static=True, default=3)
      >>> c = Counter(jnp.zeros(()))
      >>> jax.tree.leaves(jax.tree.map(lambda x: x + 1, c))
      [Array(1., dtype=float32)]
    """
    own_init = "__init__" in cls.__dict__
    cls = dataclasses.dataclass(frozen=True, eq=False, init=not own_init)(cls)
    data, static = _split_fields(cls)

    def aux_data(obj):  # None when there is no configuration
        return tuple(getattr(obj, n) for n in static) if static else None

    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data)
        return children, aux_data(obj)

    def flatten(obj):
        return tuple(getattr(obj, n) for n in data), aux_data(obj)

    def unflatten(aux, children):
        values = dict(zip(static, aux or (), strict=True))
        values.update(zip(data, children, strict=True))
        return _build(cls, values)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    if "replace" not in cls.__dict__:
        cls.replace = _replace
    cls._set = _set_fields
    return cls
