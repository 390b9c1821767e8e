"""`upgrade_state`: an optimizer state restored from an older mpjax checkpoint, in today's layout.

Works on state dicts (`flax.serialization.to_state_dict`), so it reads what orbax restores
without a target (dicts, lists, None for empty nodes), what flax msgpack restores without one
(dicts, `{}`), and a state restored into a target whose layout has since changed.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import flax.serialization
from mpjax._src.flax.upgrade_checks import (
    check_codes,
    check_dtypes,
    check_layout_version,
    check_like_template,
    place_like,
    version_leaf,
)
from mpjax._src.scaling.blockwise8 import (
    Blockwise8,
    dequantize,
    geometry,
    quantize,
    scales_shape,
    stored_block_length,
)
from mpjax._src.scaling.master_check import master_kind

__all__ = ["upgrade_state"]


def _as_dict(x: Any) -> Any:
    """`x` as nested dicts of str keys; None (orbax's empty node) as `{}`."""
    if x is None:
        return {}
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return {str(i): _as_dict(v) for i, v in enumerate(x)}
    sd = flax.serialization.to_state_dict(x)
    if isinstance(sd, dict):
        return {str(k): _as_dict(v) for k, v in sd.items()}
    return sd


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"


_KINDS = {
    "none": "no master (master_weights=False, or a float32 param under 'auto')",
    "remainder": "an int16 remainder (master_weights='remainder')",
    "old-remainder": "an int16 remainder (master_weights='remainder', 6a474e7's bare layout)",
    "float": "a float32 master (master_weights='auto' or True)",
}


def _kind(x: Any) -> str:
    """What a checkpoint's master leaf says about its `master_weights` mode."""
    return _KINDS.get(master_kind(x), f"a {type(x).__name__}")


def _mode_error(path: tuple[str, ...], raw: Any, tgt: Any) -> ValueError:
    return ValueError(
        f"upgrade_state: the checkpoint's {_name(path)} holds {_kind(raw)}, but the template "
        f"holds {_kind(tgt)}: the checkpoint was written with another master_weights mode, "
        "or for params of another dtype (under 'auto' and 'remainder' only params narrower "
        "than float32 keep a master, and only bfloat16 ones a remainder). Upgrade it with a "
        "template built with the checkpoint's mode and params' dtypes "
        "(mpjax.loss_scaled(..., master_weights=<that mode>).init(params)), then convert with "
        "mpjax.with_master_weights(opt_state, params, <this mode>) (exact)."
    )


INT8_SHAPE_LAYOUT = 2  # the first `layout_version` whose int8 blocks follow the shape alone


def _blockwise8(
    raw: dict, tgt: dict, path: tuple[str, ...], block_size: int | None, old: bool | None
) -> dict:
    """An int8 leaf in the template's layout. `old`: the checkpoint's state predates the
    layout from the shape (None: not known, no `LossScaledState` around it). A leaf of an
    old layout (6a474e7's flattened blocks, 256-long rows, 3d03840's blocks from the
    sharding) is dequantized exactly and quantized once more into the template's blocks,
    unless both cut the leaf alike (then it is kept bit for bit)."""
    codes, scales = jnp.asarray(raw["codes"]), jnp.asarray(raw["scales"])
    want = tuple(np.shape(tgt["scales"]))
    shape = tuple(codes.shape)
    if not old and (old is False or tuple(scales.shape) == want):
        if tuple(scales.shape) != want:
            raise ValueError(
                f"upgrade_state: {_name(path)}: the checkpoint's int8 scales have shape "
                f"{tuple(scales.shape)}, the template's {want}: build the template with the "
                "block_size of the checkpoint's low_precision_state"
            )
        return {"codes": codes, "scales": scales}
    if block_size is None:  # the checkpoint's default block length, read from its scales
        read = stored_block_length(shape, tuple(scales.shape))
    else:
        read = block_size
    if want == scales_shape(shape, None):
        layout = None  # today's default, from the shape
    elif block_size is not None and want == scales_shape(shape, block_size):
        layout = block_size
    else:
        raise ValueError(
            f"upgrade_state: {_name(path)}: the template's int8 scales have shape {want}, "
            f"neither today's default layout {scales_shape(shape, None)} nor that of "
            f"block_size={block_size}: pass the block_size of the template's "
            "low_precision_state"
        )
    if tuple(scales.shape) == want and geometry(shape, read) == geometry(shape, layout):
        return {"codes": codes, "scales": scales}  # cut alike: kept bit for bit
    try:
        values = dequantize(Blockwise8(codes, scales), shape, read)
    except ValueError as e:
        raise ValueError(f"upgrade_state: {_name(path)}: {e}; pass block_size=") from None
    new = quantize(values, layout)
    return {"codes": new.codes, "scales": new.scales}


_LOSS_SCALED_KEYS = {"inner_state", "master", "loss_scale", "consecutive_skips"}


def _upgrade(
    raw: Any,
    tgt: Any,
    path: tuple[str, ...],
    block_size: int | None,
    in_master: bool = False,
    old: bool | None = None,
) -> Any:
    """`raw` in the layout of `tgt`; `in_master`: inside a `loss_scaled` master tree; `old`:
    inside a `loss_scaled` state of a layout before int8 blocks from the shape (None: not
    inside one)."""
    if isinstance(tgt, dict):
        if in_master and set(tgt) == {"remainder"} and getattr(raw, "dtype", None) == jnp.int16:
            return {"remainder": raw}  # 6a474e7 kept a remainder as a bare int16 leaf
        leafy = lambda d: not d or set(d) == {"remainder"}  # noqa: E731 (a master leaf)
        if not isinstance(raw, dict) or (
            in_master and set(raw) != set(tgt) and (leafy(raw) or leafy(tgt))
        ):
            if in_master:
                raise _mode_error(path, raw, tgt)
            raise ValueError(
                f"upgrade_state: the checkpoint's {_name(path)} is a {type(raw).__name__}, "
                f"the template's a node with keys {sorted(tgt)}: the checkpoint is of another "
                "optimizer; build the template with the optimizer that wrote it"
            )
        if set(tgt) == {"codes", "scales"} and set(raw) == {"codes", "scales"}:
            check_codes(raw, tgt, path)
            return _blockwise8(raw, tgt, path, block_size, old)
        version = check_layout_version(raw, tgt, path)
        missing = sorted(set(tgt) - set(raw) - {"layout_version"})
        extra = sorted(set(raw) - set(tgt))
        if missing or extra:
            raise ValueError(
                f"upgrade_state: at {_name(path)} the checkpoint lacks {missing} and has "
                f"{extra} beyond the template: build the template with the optimizer and "
                "params that wrote the checkpoint"
            )
        state = _LOSS_SCALED_KEYS <= set(tgt)  # a LossScaledState: its master is a master tree
        if state:
            old = version is None or version < INT8_SHAPE_LAYOUT
        out = {
            k: _upgrade(
                raw[k],
                tgt[k],
                (*path, k),
                block_size,
                in_master or (state and k == "master"),
                old,
            )
            for k in tgt
            if k in raw and k != "layout_version"
        }
        if "layout_version" in tgt:
            out["layout_version"] = version_leaf(tgt["layout_version"])
        return out
    if in_master and (isinstance(raw, dict) or getattr(raw, "dtype", None) != tgt.dtype):
        raise _mode_error(path, raw, tgt)
    if isinstance(raw, dict) or np.shape(raw) != np.shape(tgt):
        raise ValueError(
            f"upgrade_state: the checkpoint's {_name(path)} has shape "
            f"{getattr(raw, 'shape', None)}, the template's {np.shape(tgt)}: build the "
            "template with the params and optimizer that wrote the checkpoint"
        )
    return raw


def upgrade_state(restored: Any, template: Any, *, block_size: int | None = None) -> Any:
    """Reads an optimizer state restored from a checkpoint of an older mpjax into `template`.

    For checkpoints written before the state layout was versioned (mpjax 6a474e7 and
    earlier): `master_weights="remainder"` kept bare int16 remainders (now `Remainder`
    nodes) and `low_precision_state(..., jnp.int8)` one scale per block of the flattened
    leaf (now per block of each row). Restore the checkpoint without a target
    (`ocp.StandardCheckpointer().restore(path)`, `flax.serialization.msgpack_restore(blob)`)
    and pass the tree here with a template of the same optimizer and params: it returns
    the state in today's layout, the template's structure, its arrays from the checkpoint.
    Remainders, float32 masters, float32 and bfloat16 states are carried over bit for bit
    (training goes on as the old release would have). int8 states of mpjax 3d03840 and
    earlier (`layout_version` below 2: 6a474e7's flattened blocks, 256-long rows, or
    3d03840's blocks from each leaf's sharding at `init`, so written on any device count)
    are dequantized exactly (the old codes times their scales, in float32) and quantized
    once more into today's blocks from the shape (to nearest). Each new block's scale is
    exactly the largest old value in it, and each element moves by at most half the gap
    between the two codes around it: at most 0.00704 of its new block's scale (the top
    decade's half gap, 0.9 / 128), ten times less per decade below; a leaf whose old
    blocks are today's is kept bit for bit. Training then follows
    today's int8 code. The result is placed like the template's arrays, so it restores on
    any device count.
    A checkpoint of another `master_weights` mode is refused, naming that mode (convert
    with `mpjax.with_master_weights` after upgrading with a template of that mode).

    Args:
      restored: the restored tree: the optimizer state, or any tree holding it (e.g.
        `{"params": ..., "opt_state": ...}`), as restored without a target, or restored
        into a target.
      template: the same tree as built today (e.g. `{"params": params, "opt_state":
        tx.init(params)}`), with the checkpoint's optimizer, `master_weights` mode and
        dtypes (nothing is cast), or its abstract form (`jax.eval_shape(tx.init, params)`,
        `jax.ShapeDtypeStruct`s with or without `.sharding`). The result is placed like it:
        each leaf with the template's sharding, and the leaves it leaves unplaced
        (`tx.init`'s scalars) replicated over the template's mesh where it has one (the
        rules: docs/guides/migration.md).
      block_size: the `block_size` of the checkpoint's `low_precision_state(..., jnp.int8)`
        when it was an int (the template then built with the same); None (default): the
        checkpoint used the default, its block length read from each leaf's scales.

    Returns:
      A tree structured like `template`, of concrete arrays.

    Raises:
      ValueError: the checkpoint is of another mode, optimizer, params or dtypes, holds int8
        codes of another shape or a corrupt `layout_version`, naming the leaf; or a template
        leaf is sharded over an abstract mesh that no concrete mesh resolves.

    Example:
      >>> import flax.serialization as fs, jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> tx = mpjax.loss_scaled(optax.sgd(0.1), master_weights="remainder")
      >>> blob = fs.to_bytes(tx.init(params))  # a checkpoint
      >>> state = mpjax.upgrade_state(fs.msgpack_restore(blob), tx.init(params))
      >>> int(state.layout_version)
      2
    """
    raw, tgt = _as_dict(restored), _as_dict(template)
    check_dtypes(raw, tgt)
    new = _upgrade(raw, tgt, (), block_size)
    state = place_like(flax.serialization.from_state_dict(template, new), template)
    check_like_template(state, template)
    return state
