"""`low_precision_state`: any optax optimizer's state stored in bfloat16, int8 or another dtype.

Each update widens the stored state to the dtypes the inner optimizer made it in (float32),
runs the inner update there, and rounds the new state back: to nearest, or stochastically
(unbiased: `E[round(x)] == x`), so that increments below half a bfloat16 ulp (Adam's second
moment decaying by 0.999 a step) are kept on average instead of lost. With `jnp.int8`
each floating leaf is stored as blockwise-scaled 8-bit codes (`blockwise8.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.policy import DTYPE_NAMES
from mpjax._src.scaling.blockwise8 import Blockwise8, dequantize, quantize, scales_shape
from mpjax._src.scaling.nnx_nodes import nodes_from_nnx
from mpjax._src.scaling.random_bits import fmix32 as _fmix32
from mpjax._src.scaling.random_bits import random_bits16 as _random_bits16
from mpjax._src.scaling.random_bits import u32 as _u32

__all__ = ["LowPrecisionState", "low_precision_state", "stochastic_round"]

_ROUNDINGS = ("stochastic", "nearest")


class LowPrecisionState(NamedTuple):
    """State of `low_precision_state`.

    Attributes:
      inner_state: the inner transformation's state, its wider floating leaves stored in
        the low precision dtype.
      count: int32 scalar, the updates taken so far; with the seed it keys the stochastic
        rounding of the next update, so a resumed run rounds bit for bit as the first.
    """

    inner_state: Any
    count: jax.Array


def stochastic_round(x: jax.Array, seed: jax.Array) -> jax.Array:
    """Rounds float32 `x` to bfloat16 stochastically: up with probability (x - down) / ulp.

    Adds 16 random bits below the bfloat16 mantissa and truncates, so `E[result] == x` for
    every finite `x` whose rounding does not overflow; infinities and NaN stay so.

    Args:
      x: a float32 array.
      seed: a uint32 scalar; the same seed gives the same rounding.

    Returns:
      A bfloat16 array shaped like `x`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.scaling.low_precision import stochastic_round
      >>> x = jnp.full((10000,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 of a bf16 ulp above 1
      >>> r = stochastic_round(x, jnp.uint32(0)).astype(jnp.float32)
      >>> sorted(set(r.tolist())), 0.08 < float((r > 1).mean()) < 0.17
      ([1.0, 1.0078125], True)
    """
    if x.dtype != jnp.float32:
        raise TypeError(f"stochastic_round: needs a float32 array, got {x.dtype}")
    # lax primitives, not jnp operators: no jit dispatch per call while tracing (random_bits)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    noisy = lax.select(lax.is_finite(x), lax.add(bits, _random_bits16(x.shape, seed)), bits)
    hi = lax.convert_element_type(lax.shift_right_logical(noisy, _u32(noisy, 16)), jnp.uint16)
    return lax.bitcast_convert_type(hi, jnp.bfloat16)


def _leaf_seed(seed: int, count: jax.Array, leaf: int) -> jax.Array:
    count = lax.convert_element_type(count, jnp.uint32)
    mixed = _fmix32(lax.add(count, _u32(count, 0x632BE5AB)))
    mixed = _fmix32(lax.bitwise_xor(_u32(count, seed), mixed))
    return _fmix32(lax.bitwise_xor(mixed, _u32(count, leaf * 0x27D4EB2F)))


def _narrows(x: Any, dtype: jnp.dtype) -> bool:
    return _is_floating(x) and jnp.dtype(x.dtype).itemsize > jnp.dtype(dtype).itemsize


def _storage_dtype(dtype: Any) -> np.dtype:
    """The storage dtype: a dtype, or a name ("bf16", "bfloat16", "f16", "int8", ...)."""
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPE_NAMES:
        dtype = DTYPE_NAMES[dtype.strip().lower()]
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"low_precision_state: dtype {dtype!r} is not a dtype; use jnp.bfloat16 (or "
            f"'bf16'), jnp.int8 or another floating dtype ({sorted(DTYPE_NAMES)})"
        ) from None
    if not (dtype == jnp.int8 or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"low_precision_state: dtype must be a floating dtype or int8, got {dtype}")
    return dtype


def _check_rounding(rounding: str | None, dtype: np.dtype) -> str:
    if rounding is None:
        rounding = "nearest" if dtype == jnp.int8 else "stochastic"
    if rounding not in _ROUNDINGS:
        raise ValueError(
            f"low_precision_state: rounding must be one of {_ROUNDINGS}, got {rounding!r}"
        )
    if rounding == "stochastic" and dtype not in (jnp.bfloat16, jnp.int8):
        raise ValueError(
            f"low_precision_state: stochastic rounding is implemented for bfloat16 and int8, "
            f"got dtype={dtype}; use rounding='nearest'"
        )
    if dtype == jnp.float16:
        warnings.warn(
            "low_precision_state(dtype=float16): float16 has 5 exponent bits, so optimizer "
            "state below 6e-8 flushes to zero (Adam's second moment of gradients below "
            "~2e-4 underflows and its updates grow); store the state in bfloat16 "
            "(dtype=jnp.bfloat16, float32's range) instead",
            UserWarning,
            stacklevel=3,
        )
    return rounding


def _accumulators(tree: Any) -> list[bool]:
    """Per leaf of `tree`: whether it is an `optax.MultiSteps` gradient accumulator (kept
    in its own dtype: summed gradients, not optimizer statistics meant to be compressed)."""

    def mark(node):
        if not isinstance(node, optax.MultiStepsState):
            return False
        flags = jax.tree.map(lambda _: False, node)
        return flags._replace(
            inner_opt_state=_mask(node.inner_opt_state),
            acc_grads=jax.tree.map(lambda _: True, node.acc_grads),
        )

    def _mask(tree):
        return jax.tree.map(mark, tree, is_leaf=lambda n: isinstance(n, optax.MultiStepsState))

    return jax.tree.leaves(_mask(tree))


def _check_layout(x: Blockwise8, shape: tuple[int, ...], block_size: Any, leaf: int) -> None:
    """Refuses an int8 leaf whose scales are not in this transformation's layout (a state
    of an earlier mpjax, or of another `block_size`), naming the fix."""
    want = scales_shape(tuple(shape), block_size)
    if tuple(x.scales.shape) != want and not (
        isinstance(block_size, int) and x.scales.ndim == 1  # the flattened layout, read too
    ):
        raise ValueError(
            f"low_precision_state: int8 state leaf {leaf} (shape {tuple(shape)}) has scales of "
            f"shape {tuple(x.scales.shape)}, not {want} of block_size={block_size!r}: the state "
            "was written by an earlier mpjax (whose layout depended on the sharding) or with "
            "another block_size; restore it without a target and convert it with "
            "mpjax.upgrade_state(restored, tx.init(params))"
        )


def low_precision_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    rounding: str | None = None,
    seed: int = 0,
    *,
    block_size: int | Callable[[tuple[int, ...]], int] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Stores `inner`'s floating state in `dtype`; each update runs in float32 and rounds back.

    Every floating leaf of the inner state wider than `dtype` (Adam's `mu` and `nu`, Lion's
    momentum, Adafactor's factored moments) is stored in `dtype`; counts and other integer
    leaves are untouched. An update widens the state to the dtypes `inner.init` gives,
    runs `inner.update`, and rounds the new state to `dtype`. Put it inside
    `mpjax.loss_scaled`: a skipped step then leaves this state (and its count)
    bit-identical.

    With `dtype=jnp.int8` each such leaf becomes a `Blockwise8`: int8 codes shaped like the
    leaf and one float32 scale per block of its last axis (the block's absolute maximum),
    the codes a decade code of magnitudes from 1e-6 to 1 of the scale, dense near the top,
    computed arithmetically (8-bit Adam: about 1.03 bytes per moment element instead of 2
    or 4). The layout is a function of each leaf's shape and `block_size` alone, never of
    its sharding or of how `init` is called (eagerly, under `jit` or `jax.eval_shape`):
    the scales are shaped like the leaf with its last axis counting blocks; shard them
    like the leaf's codes (the same `PartitionSpec`). A leaf split over devices along any
    axis but the last, or evenly along its last axis into up to 8 pieces of at least 32
    elements (up to 64 of at least 128), holds whole blocks on each device: no extra
    collective under FSDP. `optax.MultiSteps`' gradient accumulator keeps its dtype.

    Args:
      inner: the optax transformation whose state to store narrow.
      dtype: the storage dtype of the floating state: bfloat16 (default), int8
        (blockwise-scaled 8-bit codes) or another floating dtype, or its name ("bf16").
        float16 warns: its range is too narrow for second moments (use bfloat16).
      rounding: "stochastic" (bfloat16 and int8): unbiased stochastic rounding keyed from
        `seed` and the update count, so a run resumed from a checkpoint is bitwise
        identical; "nearest": round to the nearest value (ties to even for floating
        dtypes). None (default): "nearest" for int8, else "stochastic". (Between int8
        codes a decade apart, stochastic rounding of Adam's second moment is unbiased but
        1 / sqrt of it is not: measured, it converges worse than nearest.)
      seed: an int in [0, 2**32) seeding the stochastic rounding.
      block_size: with `dtype=jnp.int8`, the blocks along each leaf's last axis. None
        (default): from the shape (`mpjax._src.scaling.blockwise8`): the last axis, `L`,
        cut into `p` equal segments (`p` the largest power of two up to 64 dividing `L`
        with segments of at least 32 elements, 128 beyond 8 segments), each in blocks of
        `min(256, L / p)` (1.042 bytes per element for L = 768, 1.031 for 1024 and 4096,
        1.016 for 50257, 1.125 for 64).
        An int: blocks of `min(block_size, shape[-1])`, each row's last block
        zero-padded. A callable `shape -> int`: each leaf's block length. A state of
        another layout (of mpjax 3d03840 and earlier, whose default followed the sharding)
        is refused at `update`: convert it with `mpjax.upgrade_state`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LowPrecisionState`.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> tx = mpjax.low_precision_state(optax.adamw(1e-3))
      >>> params = {"w": jnp.ones((3,))}
      >>> state = tx.init(params)
      >>> state.inner_state[0].mu["w"].dtype
      dtype(bfloat16)
      >>> updates, state = tx.update({"w": jnp.ones((3,))}, state, params)
    """
    dtype = _storage_dtype(dtype)
    rounding = _check_rounding(rounding, dtype)
    if (
        block_size is not None
        and not callable(block_size)
        and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1)
    ):
        raise ValueError(
            f"low_precision_state: block_size must be None (from each leaf's shape), an "
            f"int >= 1 or a callable shape -> int, got {block_size!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"low_precision_state: seed must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**32:
        raise ValueError(
            f"low_precision_state: seed must be in [0, 2**32) (it keys a uint32 hash), got "
            f"{seed}; e.g. seed={int(seed) % 2**32}"
        )
    seed = int(seed)
    int8 = dtype == jnp.int8
    inner = optax.with_extra_args_support(inner)

    def narrow(tree, count, lengths):
        leaves, treedef = jax.tree.flatten(tree)
        kept = _accumulators(tree)
        out = []
        for i, (x, keep, b) in enumerate(zip(leaves, kept, lengths, strict=True)):
            if keep or not _narrows(x, dtype):
                out.append(x)
            elif int8:
                key = None if rounding == "nearest" else _leaf_seed(seed, count, i)
                out.append(quantize(x, b, key))
            elif rounding == "nearest":
                out.append(x.astype(dtype))
            else:
                out.append(stochastic_round(x.astype(jnp.float32), _leaf_seed(seed, count, i)))
        return jax.tree.unflatten(treedef, out)

    def widen_leaf(x, r, b):
        if isinstance(x, Blockwise8):
            return dequantize(x, r.shape, b).astype(r.dtype)
        return x.astype(r.dtype) if _narrows(r, dtype) else x

    def stored(tree, reference):
        """The stored leaves of `tree` (a `Blockwise8` one leaf), their layouts checked."""
        ref_leaves, treedef = jax.tree.flatten(reference)
        leaves = treedef.flatten_up_to(tree)
        for i, (x, r) in enumerate(zip(leaves, ref_leaves, strict=True)):
            if isinstance(x, Blockwise8):
                _check_layout(x, r.shape, block_size, i)
        return leaves, ref_leaves, treedef, [block_size] * len(leaves)

    def init_fn(params):
        count = jnp.zeros((), jnp.int32)
        state = inner.init(params)
        lengths = [block_size] * len(jax.tree.leaves(state))
        return LowPrecisionState(narrow(state, count, lengths), count)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                "low_precision_state: state must be a LowPrecisionState, got "
                f"{type(state).__name__}"
            )
        # Under nnx.Optimizer, the int8 nodes of the last update come back as nnx.States.
        state = state._replace(inner_state=nodes_from_nnx(state.inner_state))
        reference = jax.eval_shape(inner.init, updates if params is None else params)
        leaves, ref_leaves, treedef, lengths = stored(state.inner_state, reference)
        parts = zip(leaves, ref_leaves, lengths, strict=True)
        wide = treedef.unflatten([widen_leaf(x, r, b) for x, r, b in parts])
        updates, new_inner = inner.update(updates, wide, params, **extra_args)
        return updates, LowPrecisionState(narrow(new_inner, state.count, lengths), state.count + 1)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
