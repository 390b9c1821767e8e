"""`upgrade_state`'s checks and placement: what the checkpoint may hold, where the result lives.

The rules (docs/guides/migration.md, "Checkpoints of an older mpjax"):

- Every array of the checkpoint has the template's dtype at the same path: `upgrade_state`
  casts nothing (a float16 param never comes back bfloat16, a float32 one never becomes a
  bfloat16 one with a master).
- An int8 leaf's codes have the template's shape and dtype.
- `layout_version`, where the checkpoint holds one, is an integer scalar from 0 to
  `STATE_LAYOUT_VERSION`.
- The result is placed like the template: a leaf with a sharding of its own (a committed
  array, a `jax.ShapeDtypeStruct` with `.sharding`) gets it, resolved to the template's or
  `jax.set_mesh`'s concrete mesh when it names an abstract one (`jax.eval_shape` under Explicit
  mesh axes). Where the template's other leaves span one mesh, a scalar on a single device
  or on none (`tx.init`'s scalars: Adam's count, the loss scale) is replicated over that mesh.
  Any other leaf is placed as in the template: on its one device, or, without a sharding (an
  uncommitted array, an abstract leaf without `.sharding`), on the default device,
  uncommitted.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.scaling.loss_scaled import STATE_LAYOUT_VERSION

__all__ = [
    "check_codes",
    "check_dtypes",
    "check_layout_version",
    "check_like_template",
    "place_like",
    "version_leaf",
]

_LOSS_SCALED_KEYS = {"inner_state", "master", "loss_scale", "consecutive_skips"}
_REBUILD = "build the template from the params and optimizer that wrote the checkpoint"


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"


def _dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


def _scalar_fits(value: Any, dtype: np.dtype) -> bool:
    """Whether a Python scalar stands exactly for a value of `dtype` (its kind, its value)."""
    kind = dtype.kind
    if isinstance(value, bool):
        return kind == "b"
    if isinstance(value, int):
        return kind in "iu" and np.can_cast(np.min_scalar_type(value), dtype)
    if isinstance(value, float):
        return kind == "f" and float(np.asarray(value, dtype)) == value
    return False


def check_dtypes(raw: Any, tgt: Any, path: tuple[str, ...] = ()) -> None:
    """Raises a ValueError at the first array of `raw` whose dtype is not `tgt`'s there.

    Args:
      raw: the checkpoint as nested dicts (`upgrade.py`'s `_as_dict`).
      tgt: the template as nested dicts.
      path: the path of `raw` in the whole tree.

    Raises:
      ValueError: naming the leaf, both dtypes and the fix.
    """
    if isinstance(tgt, dict):
        if isinstance(raw, dict):
            # layout_version: check_layout_version's; a loss_scaled master: `_upgrade` names a
            # master of another kind (an int16 remainder for a float32 master) by its mode
            state = _LOSS_SCALED_KEYS <= set(tgt)
            for k in tgt:
                if k in raw and k != "layout_version" and not (state and k == "master"):
                    check_dtypes(raw[k], tgt[k], (*path, k))
        return  # a structure that does not fit: `_upgrade` names it
    if isinstance(raw, dict) or not hasattr(tgt, "dtype"):
        return
    want = np.dtype(tgt.dtype)
    if not hasattr(raw, "dtype"):
        if _scalar_fits(raw, want):
            return
        raise ValueError(
            f"upgrade_state: the checkpoint's {_name(path)} is {raw!r:.60} (a "
            f"{type(raw).__name__}), the template's an array of {want.name}: the checkpoint is "
            f"not the one this template describes; {_REBUILD}"
        )
    if np.dtype(raw.dtype) != want:
        raise ValueError(
            f"upgrade_state: the checkpoint's {_name(path)} is {_dtype_name(raw)}, the "
            f"template's {want.name}: upgrade_state casts nothing. Upgrade with a template built "
            f"with the dtypes that wrote the checkpoint (the params' dtypes, "
            f"low_precision_state's dtype: {_dtype_name(raw)} here); to train in other dtypes, "
            "cast the upgraded params and call tx.init with them"
        )


def check_codes(raw: dict, tgt: dict, path: tuple[str, ...]) -> None:
    """Raises a ValueError if an int8 leaf's codes are not an int8 array of the template's shape.

    Args:
      raw: the checkpoint's `{"codes", "scales"}` node.
      tgt: the template's.
      path: the node's path.
    """
    codes, want = raw["codes"], tgt["codes"]
    shape = tuple(np.shape(codes)) if hasattr(codes, "shape") else None
    dtype = _dtype_name(codes) if hasattr(codes, "dtype") else type(codes).__name__
    if shape != tuple(np.shape(want)) or dtype != _dtype_name(want):
        raise ValueError(
            f"upgrade_state: the checkpoint's int8 state {_name(path)} has codes of shape "
            f"{shape} and dtype {dtype}, the template's {tuple(np.shape(want))} and "
            f"{_dtype_name(want)} (codes are shaped like the param): {_REBUILD}"
        )


def _bad_version(value: Any, path: tuple[str, ...], why: str) -> ValueError:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return ValueError(
        f"upgrade_state: the checkpoint's {_name(path)} is {text} ({why}), not a state layout "
        f"version (mpjax writes an int32 scalar from 0 to {STATE_LAYOUT_VERSION}): the "
        "checkpoint is corrupt or not an mpjax loss_scaled state. Pass the tree restored from "
        "the files mpjax wrote, without a target (ocp.StandardCheckpointer().restore(path), "
        "flax.serialization.msgpack_restore(blob)), unchanged"
    )


def check_layout_version(raw: dict, tgt: dict, path: tuple[str, ...]) -> int | None:
    """The layout version `raw` holds (0 where the template has the field and `raw` not).

    Args:
      raw: a checkpoint node (a dict).
      tgt: the template's node.
      path: the node's path.

    Returns:
      The version, or None where neither holds the field.

    Raises:
      ValueError: a value that is not an integer scalar in [0, STATE_LAYOUT_VERSION].
    """
    if "layout_version" not in raw:
        return 0 if "layout_version" in tgt else None
    value, where = raw["layout_version"], (*path, "layout_version")
    if isinstance(value, dict) and not value:
        return 0  # None (an old state rebuilt with the field's default): no version
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == np.bool_:
        raise _bad_version(value, where, "a bool")
    if isinstance(value, int | np.integer):
        version = int(value)
    elif hasattr(value, "dtype") and hasattr(value, "shape"):
        if tuple(value.shape) != ():
            raise _bad_version(value, where, f"an array of shape {tuple(value.shape)}")
        if np.dtype(value.dtype).kind not in "iu":
            raise _bad_version(value, where, f"a {_dtype_name(value)} scalar")
        version = int(np.asarray(value))
    else:
        raise _bad_version(value, where, f"a {type(value).__name__}")
    if version < 0:
        raise _bad_version(value, where, "negative")
    if version > STATE_LAYOUT_VERSION:
        raise ValueError(
            f"upgrade_state: {_name(path)} has state layout version {version}, newer "
            f"than this mpjax reads ({STATE_LAYOUT_VERSION}): upgrade mpjax"
        )
    return version


def version_leaf(tgt: Any) -> np.ndarray:
    """Today's layout version in the template's dtype (an array, a `ShapeDtypeStruct`)."""
    return np.asarray(STATE_LAYOUT_VERSION, np.dtype(getattr(tgt, "dtype", np.int32)))


def _own_sharding(t: Any) -> Any:
    """The placement a template leaf asks for: a committed array's or an abstract leaf's
    sharding; None for an uncommitted array (`tx.init`'s scalars), NumPy and the rest."""
    if isinstance(t, jax.ShapeDtypeStruct):
        return getattr(t, "sharding", None)
    if isinstance(t, jax.Array) and not isinstance(t, jax.core.Tracer):
        return t.sharding if t.committed else None
    return None


def _is_abstract(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and isinstance(
        sharding.mesh, jax.sharding.AbstractMesh
    )


def _resolve(sharding: Any, meshes: list, path: str) -> Any:
    """`sharding` over a concrete mesh: the template's or `jax.set_mesh`'s, for an abstract one."""
    if not _is_abstract(sharding):
        return sharding
    current = jax.sharding.get_mesh()
    for mesh in [*meshes, *([current] if current.devices.size else [])]:
        if mesh.abstract_mesh == sharding.mesh:
            return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    raise ValueError(
        f"upgrade_state: the template's {path} is sharded over an abstract mesh "
        f"({sharding.mesh}; jax.eval_shape gives one for Explicit mesh axes), and no concrete "
        "mesh of its shape is in the template or set: call upgrade_state under "
        "`with jax.set_mesh(mesh):`, or give the template concrete shardings "
        "(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)))"
    )


def place_like(state: Any, template: Any) -> Any:
    """`state`'s leaves (NumPy or JAX arrays) placed like `template`'s (see the module doc).

    Args:
      state: the upgraded tree, structured like `template`.
      template: the template (arrays and/or `jax.ShapeDtypeStruct`s).

    Returns:
      `state` with JAX arrays as leaves.

    Raises:
      ValueError: a leaf sharded over an abstract mesh no concrete mesh resolves.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    values = treedef.flatten_up_to(state)
    template_leaves = [t for _, t in flat]
    owns = [_own_sharding(t) for _, t in flat]
    meshes = [s.mesh for s in owns if isinstance(s, NamedSharding) and not _is_abstract(s)]
    owns = [
        None if s is None else _resolve(s, meshes, jax.tree_util.keystr(p))
        for (p, _), s in zip(flat, owns, strict=True)
    ]
    meshes = [s.mesh for s in owns if isinstance(s, NamedSharding)]  # the resolved ones too
    # A template whose leaves span one mesh: its single-device and unplaced leaves (tx.init's
    # scalars, committed or not) are replicated over that mesh, so that a jitted step sees
    # every argument on the same devices.
    homes = {frozenset(s.device_set) for s in owns if s is not None and len(s.device_set) > 1}
    if len(homes) == 1:
        (devices,) = homes
        same = [m for m in meshes if frozenset(m.devices.flat) == devices]
        if same:
            shared = NamedSharding(same[0], P())
        else:
            mesh = jax.sharding.Mesh(np.asarray(sorted(devices, key=lambda d: d.id)), ("_all",))
            shared = NamedSharding(mesh, P())
        for i, (t, s) in enumerate(zip(template_leaves, owns, strict=True)):
            if np.ndim(t) == 0:
                owns[i] = shared if s is None or len(s.device_set) == 1 else s
            # any other leaf as in the template: on its one device, or uncommitted (an array
            # without sharding: a mesh with Explicit axes types it unsharded)
    out = []
    for (_, t), v, sharding in zip(flat, values, owns, strict=True):
        if not hasattr(v, "dtype") and hasattr(t, "dtype"):
            v = np.asarray(v, np.dtype(t.dtype))  # a Python scalar check_dtypes let through
        if sharding is None:
            out.append(jax.numpy.asarray(v))  # NumPy: the default device, uncommitted
        elif isinstance(v, jax.Array) and v.committed and v.sharding == sharding:
            out.append(v)
        else:
            out.append(jax.device_put(v, sharding))
    return jax.tree.unflatten(treedef, out)


def check_like_template(state: Any, template: Any) -> None:
    """Raises a ValueError at the first leaf of `state` whose shape or dtype is not the
    template's (what every rule above guarantees; a last guard that names the leaf)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    for (path, t), v in zip(flat, treedef.flatten_up_to(state), strict=True):
        if not hasattr(t, "dtype"):
            continue
        got = (tuple(np.shape(v)), np.dtype(v.dtype).name)
        want = (tuple(np.shape(t)), np.dtype(t.dtype).name)
        if got != want:
            raise ValueError(
                f"upgrade_state: the upgraded {jax.tree_util.keystr(path)} has shape and dtype "
                f"{got}, the template's {want}: {_REBUILD}"
            )
