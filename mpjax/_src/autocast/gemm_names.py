"""The names `Fp8Recipe.exclude` matches for the GEMMs of an NNX model under `mpjax.autocast`.

Linen modules push their path as a JAX name scope, which autocast reads from each GEMM's name
stack; NNX modules push none, so an NNX model's GEMMs have no name there. Autocast names a GEMM
whose right operand (the weight) is a `Variable` of an NNX module passed as an argument by that
module's path instead, as `mpjax.nnx.apply_policy` names it: `"Root/attr/0/attr"` (the root
module's class name, then the attribute path; list items by index), e.g. `"Model/head"` for
`model.head.kernel`. `GemmNames` also records each GEMM's name, so that an `exclude` that
matched nothing while GEMMs had no name at all is refused instead of silently ignored.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["GemmNames", "nnx_leaf_names"]


def _key_text(key: Any) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_nnx_module(x: Any) -> bool:
    """Whether `x` is a `flax.nnx.Module` (by its classes: this layer imports no Flax)."""
    return any(
        c.__name__ == "Module" and c.__module__.startswith("flax.nnx") for c in type(x).__mro__
    )


def nnx_leaf_names(args: tuple, kwargs: dict) -> dict[int, str]:
    """{index of a leaf of `(args, kwargs)`: its NNX module path} for the Variables of the NNX
    modules among the positional and keyword arguments (pytree modules, flax >= 0.11)."""
    out = {}
    paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    for index, (path, _) in enumerate(paths):
        if len(path) < 2:
            continue
        root = (args, kwargs)[path[0].idx]
        root = root[_key_text(path[1])] if isinstance(root, dict) else root[path[1].idx]
        if not _is_nnx_module(root):
            continue
        keys = [_key_text(k) for k in path[2:]]
        if keys and keys[-1] == "value":  # a Variable's value
            keys = keys[:-1]
        out[index] = "/".join([type(root).__name__, *keys[:-1]])  # without the Variable's name
    return out


class GemmNames:
    """One autocast call's GEMM names: NNX module paths by the weight's traced value, and a
    record of the names each candidate GEMM had (to refuse an `exclude` that matched none)."""

    def __init__(self, ids: dict):
        self._ids = ids  # id(traced weight) -> NNX module path
        self.seen: list[str] = []

    def name(self, stack_name: str, rhs: Any) -> str:
        """The name `exclude` matches: the weight's NNX path if it has one, else the stack."""
        name = self._ids.get(id(rhs)) or stack_name
        self.seen.append(name)
        return name

    def passed(self, outer: list, inner: list) -> GemmNames:
        """The names inside a body that receives `outer` as `inner` (`jax.checkpoint`)."""
        child = GemmNames(
            {
                id(i): self._ids[id(o)]
                for o, i in zip(outer, inner, strict=True)
                if id(o) in self._ids
            }
            | self._ids
        )
        child.seen = self.seen
        return child

    def check(self, recipe: Any, where: str) -> None:
        """Refuses `recipe.exclude` patterns that matched no GEMM of a call where some GEMM
        had no name (an NNX model not passed as an argument: nothing to match)."""
        import fnmatch

        patterns = getattr(recipe, "exclude", ())
        if not patterns or not self.seen or "" not in self.seen:
            return
        if any(fnmatch.fnmatchcase(n, p) for n in self.seen for p in patterns):
            return
        raise ValueError(
            f"autocast: Fp8Recipe(exclude={patterns!r}) matched no GEMM of {where}, and "
            f"{self.seen.count('')} of its {len(self.seen)} fp8 GEMMs have no name (an NNX "
            "module pushes no name scope): pass the NNX model as an argument of the autocast "
            "function (its GEMMs are then named by module path, e.g. 'Model/head'), wrap the "
            "call in jax.named_scope, or exclude by shape with exclude_if="
        )
