"""Does a `loss_scaled` state fit these params and this `master_weights` mode? Names the leaf.

The check is static (tree structure, shapes, dtypes and master kinds, read while tracing),
so it costs nothing in the compiled step. It catches params changed after `init` (a leaf
added, renamed, reshaped or cast, e.g. float32 params cast to float16 after `init`, or
bfloat16 params promoted to float32), and states restored from a checkpoint taken with
another `master_weights` mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype
from mpjax._src.scaling.master import NoMaster, Remainder, _is_masked, _keeps_master

__all__: list[str] = []

_MASTER_NODES = (NoMaster, Remainder, optax.MaskedNode)


def _is_master_leaf(x: Any) -> bool:
    return x is None or isinstance(x, _MASTER_NODES)


def master_kind(m: Any) -> str:
    """ "none", "remainder", "float", "old-remainder" (a bare int16 leaf) or "unknown"."""
    if m is None or _is_masked(m) or (isinstance(m, dict) and not m):
        return "none"  # None and {}: a master_weights=False checkpoint restored elsewhere
    if isinstance(m, Remainder) or (isinstance(m, dict) and set(m) == {"remainder"}):
        return "remainder"
    dtype = getattr(m, "dtype", None)
    if dtype is not None and jnp.dtype(dtype) == jnp.int16:
        return "old-remainder"
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return "unknown"


def expected_kind(p: Any, master_weights: bool | str) -> str:
    """The master kind `init` makes for param `p` in `master_weights` mode."""
    if not _keeps_master(p, master_weights):
        return "none"
    if master_weights == "remainder" and p.dtype == jnp.bfloat16:
        return "remainder"
    return "float"


_HOLDS = {
    "none": "no master",
    "remainder": "an int16 remainder (a state of master_weights='remainder')",
    "old-remainder": "a bare int16 remainder (saved before remainders became Remainder nodes)",
    "float": "a float32 master (a state of master_weights='auto' or True)",
}
_WANTS = {
    "none": "keeps no master for it",
    "remainder": "keeps an int16 remainder for it",
    "float": "keeps a float32 master for it",
}


def _param_paths(params: Any) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _master_paths(master: Any) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(master, is_leaf=_is_master_leaf)[0]
    return [jax.tree_util.keystr(k) for k, _ in flat]


def _fits(built: tuple, now: tuple) -> bool:
    """Whether params of shape `now` can belong to a state built for shape `built`.

    Equal shapes, or a block of it (a shard inside `shard_map`, where a `NoMaster` built
    outside still records the global shape), or another rank (a state built outside `vmap`,
    used inside it): only a shape of the same rank that no sharding explains is refused.
    """
    if len(built) != len(now):
        return True
    return all((b == 0) if n == 0 else (b % n == 0) for b, n in zip(built, now, strict=True))


def check_master(params: Any, master: Any, master_weights: Any, what: str) -> None:
    """Raises a ValueError naming the leaf, what the state holds and the fix, on a mismatch.

    `master_weights`: the optimizer's mode, or None to accept any mode's master kinds.
    """
    init_again = "call tx.init again with these params"
    try:
        masters = jax.tree.structure(params).flatten_up_to(master)
    except (ValueError, TypeError):
        p_paths, m_paths = set(_param_paths(params)), set(_master_paths(master))
        only_p, only_m = sorted(p_paths - m_paths)[:5], sorted(m_paths - p_paths)[:5]
        raise ValueError(
            f"{what}: the params do not match the tree the optimizer state was built for "
            f"(in params only: {only_p}; in the state only: {only_m}). The params changed "
            f"after tx.init (a leaf added, removed or renamed): {init_again}, or restore "
            "the params that belong to this state."
        ) from None
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, p), m in zip(flat, masters, strict=True):
        name = jax.tree_util.keystr(path)
        if not _is_floating(p):
            if not _is_masked(m) and m is not None:
                raise ValueError(
                    f"{what}: param {name} is {jnp.dtype(p.dtype)}, not floating, but the "
                    f"state keeps a master for it: the params changed after tx.init; "
                    f"{init_again}"
                )
            continue
        have = master_kind(m)
        dtype = jnp.dtype(p.dtype).name
        built_for = getattr(m, "dtype", None) if isinstance(m, NoMaster) else None
        if built_for is not None and built_for != dtype:
            raise ValueError(_changed_dtype(what, name, dtype, built_for))
        if master_weights is None:  # any mode: the kind must only fit the param
            want = have if have != "unknown" else "none"
            if have in ("remainder", "old-remainder") and dtype != "bfloat16":
                want = "float" if jnp.dtype(p.dtype).itemsize < 4 else "none"
        else:
            want = expected_kind(p, master_weights)
        leaf = m.remainder if isinstance(m, Remainder) else m
        shape = getattr(leaf, "shape", None)
        if have in ("float", "remainder", "old-remainder", "none") and shape is not None:
            if not _fits(tuple(shape), tuple(jnp.shape(p))):
                raise ValueError(
                    f"{what}: param {name} has shape {tuple(jnp.shape(p))}, but the state was "
                    f"built for shape {tuple(shape)}: the params changed after tx.init; "
                    f"{init_again}"
                )
        if have == want and (have != "float" or m.dtype == _wide_dtype(p.dtype)):
            continue
        raise ValueError(_mismatch(what, name, dtype, have, want, master_weights, m))


def _changed_dtype(what: str, name: str, dtype: str, built_for: str) -> str:
    msg = (
        f"{what}: param {name} is {dtype}, but the optimizer state was built for "
        f"{built_for} params: call tx.init again with the {dtype} params."
    )
    if jnp.dtype(dtype).itemsize > jnp.dtype(built_for).itemsize:
        msg += (
            f" If the {built_for} params were promoted by adding loss_scaled's float32 "
            f"updates (`p + u`, as eqx.apply_updates does), apply them with "
            f"optax.apply_updates(params, updates), which keeps each param's dtype and "
            f"lands exactly on the rounded master."
        )
    return msg


def _mismatch(what, name, dtype, have, want, master_weights, m) -> str:
    convert = f"mpjax.with_master_weights(opt_state, params, {master_weights!r})"
    mode = "" if master_weights is None else f"(master_weights={master_weights!r})"
    if master_weights is None:
        convert = "mpjax.with_master_weights(opt_state, params, master_weights)"
    head = (
        f"{what}{mode}: param {name} is {dtype} and "
        f"{'this optimizer' if mode else 'a state for it'} {_WANTS[want]}, but the state holds "
    )
    if have == "none" and want == "float" and dtype in ("float16", "bfloat16"):
        return head + (
            f"none: the state was built for float32 params (tx.init before the params were "
            f"cast to {dtype}), or with master_weights=False (a checkpoint restored into "
            f"another mode). Call tx.init again with the {dtype} params, or convert a "
            f"restored state with {convert}."
        )
    if have in ("float", "remainder") and want == "none" and dtype in ("float32", "float64"):
        held = "a float32 master" if have == "float" else "an int16 remainder"
        return head + (
            f"{held}: the state was built for bfloat16/float16 params. If they "
            f"were promoted to {dtype} by adding loss_scaled's float32 updates (`p + u`, as "
            f"eqx.apply_updates does), apply them with optax.apply_updates(params, "
            f"updates), which keeps each param's dtype and lands exactly on the rounded "
            f"master; if you cast them, call tx.init again with the {dtype} params; a state "
            f"restored from another master_weights mode converts with {convert}."
        )
    if have == "unknown":
        return head + (
            f"a {type(m).__name__}, not a master leaf: the state was restored into a "
            f"target of another master_weights mode. Restore into a target built with the "
            f"checkpoint's mode, then convert with {convert}, or call tx.init again."
        )
    return head + (
        f"{_HOLDS[have]}. The checkpoint was taken with another master_weights mode: "
        f"restore it into a target built with that mode, then convert with {convert} "
        "(exact: no bit of the master is lost), or build this optimizer with the "
        "checkpoint's mode."
    )
