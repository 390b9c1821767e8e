"""Linen scope and variable helpers of `PolicyModule`: own-param casts, variable paths, rewind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

import flax.linen as nn
from mpjax._src.core.policy import cast_floating


def _changed(new: Any, old: Any) -> bool:
    """Whether `cast_floating` replaced any leaf (it returns unchanged leaves as they are)."""
    return any(a is not b for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True))


def _own_cast(collection: Mapping, dtype) -> dict | None:
    """A copy of `collection` with its own (non-submodule) leaves cast, or None if unchanged.

    Values that are mappings are submodule collections (cast when that submodule runs).
    """
    out, changed = {}, False
    for name, value in collection.items():
        if isinstance(value, Mapping):
            out[name] = value
            continue
        cast = cast_floating(value, dtype)
        changed |= _changed(cast, value)
        out[name] = cast
    return out if changed else None


def scope_path(scope: Any, true_paths: dict) -> tuple[str, ...]:
    """The path of `scope`'s variables in the variable tree, parts as in the params dict.

    `Scope.path` is not always that path: `nn.share_scope` (which `PolicyModule` uses to
    share its variables with the wrapped module) re-parents the scopes of submodules bound
    before it (an `nn.Sequential`'s layers, a submodule passed in as an attribute) without
    changing their recorded path (`("module", "layers_0")` for the params' `layers_0`).
    The parent chain is right; a lifted transform's inner scope has no parent but copies
    the recorded path of its outer scope, mapped back through `true_paths` (filled here
    for every scope with a parent chain).
    """
    names = []
    top = scope
    while top.parent is not None:
        names.append(top.name)
        top = top.parent
    path = true_paths.get(tuple(top.path), tuple(top.path)) + tuple(reversed(names))
    if names:
        true_paths[tuple(scope.path)] = path
    return path


def variable_paths(variables: Mapping) -> set[str]:
    """The "/"-joined paths of the modules holding `variables` (every collection)."""
    out = set()

    def walk(tree: Mapping, prefix: tuple) -> None:
        out.add("/".join(prefix))
        for name, value in tree.items():
            if isinstance(value, Mapping):
                walk(value, (*prefix, str(name)))

    for collection in variables.values():
        if isinstance(collection, Mapping):
            walk(collection, ())
    return out


def rewind(module: nn.Module) -> None:
    """Lets a module's method run again inside the same call, as Flax does between calls.

    Flax rewinds a compact module's scope (name reservations) and its auto-naming
    cursor after each method call; a retry inside the call needs the same.
    """
    object.__setattr__(module, "scope", module.scope.rewound())
    module._state.autoname_cursor = {}
