"""Multi-tensor finite check (and unscale) of a gradient pytree: one Pallas kernel per 128 leaves.

One `pallas_call` covers up to 128 leaves at once (like apex's multi-tensor apply): its 1-D grid
is the concatenation of every leaf's blocks, each grid step finds the leaf it belongs to, reads
that block once in the leaf's own dtype and writes a 0/1 flag for its own block: whether every
`g * (1 / loss_scale)` (float32; float64 for float64 leaves) is finite. `all_finite_unscaled`
writes nothing else: `loss_scaled` multiplies by `1 / loss_scale` inside the inner optimizer's
update, where XLA fuses it. `unscale_and_check` also writes the unscaled float32 copy. No leaf is
copied into a flat buffer: each leaf is passed as its own operand (a free reshape to 1-D). The
per-block flags are reduced outside the kernel, so no flag is shared between grid steps (that
would race on the GPU). The XLA references live here, beside the kernels.

Under any sharding the kernels and the grouped XLA check run on each device's shards
(`mpjax._src.kernels.sharded.per_shard`): the only collective they add is a scalar all-reduce
of the flag, and the result is the unsharded one bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mpjax._src.core.dtypes import is_floating, unscale, unscale_factors, wide_dtype
from mpjax._src.kernels.common import (
    MAX_ELEMENTS,
    compiler_params,
    compute_dtype,
    next_pow2,
    offsets,
    reciprocal,
)
from mpjax._src.kernels.dispatch import dispatch
from mpjax._src.kernels.grouped_check import grouped_all_finite
from mpjax._src.kernels.sharded import per_shard

__all__ = [
    "BLOCK",
    "MAX_LEAVES_PER_CALL",
    "all_finite_unscaled",
    "unscale_and_check",
    "xla_all_finite_unscaled",
    "xla_unscale_and_check",
]

# Elements per grid step of a large leaf (a power of two, as Triton requires).
BLOCK = 4096
# Smallest block: one element per thread of 4 warps.
MIN_BLOCK = 128
# Leaves per kernel launch: each leaf adds two pointers (16 bytes) to the kernel's parameters
# (128 leaves take about 2 KiB of CUDA's 4 KiB) and one branch to the kernel body.
MAX_LEAVES_PER_CALL = 128


def _shape_like(like: Any, shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
    """An output shape that varies over the mesh axes `like` (an array or a list) varies
    over, as `pallas_call` needs under `shard_map` with `check_vma`."""
    mats = [jax.typeof(x).mat for x in (like if isinstance(like, list) else [like])]
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def unscale_and_check(grads: Any, loss_scale: Any, *, impl: str = "auto") -> tuple[Any, jax.Array]:
    """Unscales a gradient pytree to float32 and checks it for inf/NaN in one pass.

    Floating leaves (float16, bfloat16, float32; float64 stays float64) become
    `g.astype(float32) * (1 / loss_scale)` with the reciprocal rounded once (`GradScaler`'s
    arithmetic), the same on every backend and jax version; for power-of-two scales, such as
    `DynamicLossScale`'s, it is exactly `g / loss_scale`. A scale above 2**126, whose
    reciprocal is subnormal, unscales through a power of two first (`unscale_factors`). Other
    leaves pass through. The flag is whether every unscaled value is finite. Drop-in for
    `mpjax.loss_scaled(..., unscale_and_check=...)`.

    Args:
      grads: a pytree of gradients (of the scaled loss).
      loss_scale: the scalar loss scale.
      impl: "auto" (the Pallas kernel on CUDA GPUs, XLA elsewhere), "pallas", "interpret" or
        "xla"; see `mpjax._src.kernels.dispatch`.

    Returns:
      `(unscaled, all_finite)`: the unscaled pytree and a scalar bool array.

    Example:
      >>> import mpjax
      >>> import functools, optax
      >>> tx = mpjax.loss_scaled(
      ...     optax.adam(1e-3),
      ...     unscale_and_check=functools.partial(mpjax.pallas.unscale_and_check, impl="auto"))
    """
    leaves, treedef, where, floating, scale, unsupported = _prepare(
        "unscale_and_check", grads, loss_scale
    )
    unscaled, finite = dispatch(
        "unscale_and_check",
        impl,
        (floating, scale),
        kernel=_unscale_pallas,
        reference=_xla_unscale_leaves,
        unsupported=unsupported,
    )
    out = list(leaves)
    for i, u in zip(where, unscaled, strict=True):
        out[i] = u
    return jax.tree.unflatten(treedef, out), finite


def all_finite_unscaled(grads: Any, loss_scale: Any, *, impl: str = "auto") -> jax.Array:
    """Whether every floating leaf of `grads` divided by `loss_scale` is finite; reads only.

    The same flag as `unscale_and_check(grads, loss_scale)[1]` without writing the unscaled
    copy: the Pallas kernel reads each leaf once in its own dtype (float16, bfloat16, float32,
    float64) and writes one int32 per block. Non-floating leaves are ignored.

    Args:
      grads: a pytree of gradients of the scaled loss, in any floating dtypes.
      loss_scale: the scalar loss scale.
      impl: as for `unscale_and_check`.

    Returns:
      A scalar bool array.

    Example:
      >>> import jax.numpy as jnp
      >>> import mpjax
      >>> ok = mpjax.pallas.all_finite_unscaled({"w": jnp.ones(3, jnp.float16)}, 2.0**15)
    """
    _, _, _, floating, scale, unsupported = _prepare("all_finite_unscaled", grads, loss_scale)
    return dispatch(
        "all_finite_unscaled",
        impl,
        (floating, scale),
        kernel=_check_pallas,
        reference=_xla_check_leaves,
        unsupported=unsupported,
    )


def xla_unscale_and_check(grads: Any, loss_scale: Any) -> tuple[Any, jax.Array]:
    """The XLA reference of `unscale_and_check`: `g.astype(float32) * (1 / loss_scale)`, checked.

    Args:
      grads: a pytree of (scaled) gradients.
      loss_scale: the scalar loss scale.

    Returns:
      `(unscaled, all_finite)`.
    """
    return unscale_and_check(grads, loss_scale, impl="xla")


def xla_all_finite_unscaled(grads: Any, loss_scale: Any) -> jax.Array:
    """The XLA form of `all_finite_unscaled`: a few variadic max-`|g|` reductions (one per group
    of same-sized leaves, see `grouped_check`), fusing any convert before them."""
    return all_finite_unscaled(grads, loss_scale, impl="xla")


def _prepare(where: str, grads: Any, loss_scale: Any) -> tuple:
    """Flattens `grads`, checks `loss_scale`; returns what the kernels and references take."""
    leaves, treedef = jax.tree.flatten(grads)
    scale = jnp.asarray(loss_scale)
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(
            f"{where}: loss_scale must be a floating scalar, got {scale.dtype}{scale.shape}"
        )
    scale = scale.astype(jnp.float32)
    idx = [i for i, x in enumerate(leaves) if is_floating(x)]
    floating = [jnp.asarray(leaves[i]) for i in idx]
    too_big = [g.shape for g in floating if g.size > MAX_ELEMENTS]
    unsupported = f"leaves of shapes {too_big} exceed 2**31 elements" if too_big else None
    return leaves, treedef, idx, floating, scale, unsupported


def _xla_unscale_leaves(grads: list, scale: jax.Array) -> tuple[list, jax.Array]:
    unscaled = [
        unscale(g.astype(wide_dtype(g.dtype)), scale.astype(wide_dtype(g.dtype))) for g in grads
    ]
    return unscaled, _all_finite(unscaled)


def _xla_check_leaves(grads: list, scale: jax.Array) -> jax.Array:
    # The grouped reduction reshapes and groups leaves: run it on each device's shards.
    return per_shard(lambda xs, s: ([], grouped_all_finite(xs, s)), grads, scale, write=False)[1]


def _all_finite(leaves: list) -> jax.Array:
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _unscale_pallas(grads: list, scale: jax.Array, *, interpret: bool) -> tuple[list, jax.Array]:
    def kernel(xs, s):
        return _run(xs, s, interpret=interpret, write=True)

    return per_shard(kernel, grads, scale, write=True)


def _check_pallas(grads: list, scale: jax.Array, *, interpret: bool) -> jax.Array:
    def kernel(xs, s):
        return [], _run(xs, s, interpret=interpret, write=False)[1]

    return per_shard(kernel, grads, scale, write=False)[1]


def _run(grads: list, scale: jax.Array, *, interpret: bool, write: bool) -> tuple[list, jax.Array]:
    """The kernel launches over `grads`, 128 leaves at a time; `write` says whether the unscaled
    leaves are written (else only the block flags)."""
    out: list = [None] * len(grads)
    work = []
    for i, g in enumerate(grads):
        if g.size == 0:
            out[i] = jnp.zeros(g.shape, compute_dtype(g.dtype))
        else:
            work.append(i)
    scales = {d: scale.astype(d).reshape(1) for d in {compute_dtype(g.dtype) for g in grads}}
    flags = []
    for c in range(0, len(work), MAX_LEAVES_PER_CALL):
        chunk = work[c : c + MAX_LEAVES_PER_CALL]
        unscaled, chunk_flags = _call([grads[i] for i in chunk], scales, interpret, write)
        for i, u in zip(chunk if write else [], unscaled, strict=True):
            out[i] = u.reshape(grads[i].shape)
        flags.append(chunk_flags)
    if not flags:
        return out, jnp.array(True)
    return out, jnp.min(jnp.concatenate(flags)) > 0


def _call(grads: list, scales: dict, interpret: bool, write: bool) -> tuple[list, jax.Array]:
    """One kernel launch over `grads` (non-empty arrays); returns 1-D outputs (if `write`, else
    none) and block flags."""
    sizes = [int(g.size) for g in grads]
    blocks = [min(BLOCK, max(MIN_BLOCK, next_pow2(n))) for n in sizes]
    nblocks = [pl.cdiv(n, b) for n, b in zip(sizes, blocks, strict=True)]
    starts = np.cumsum([0, *nblocks]).tolist()
    out_dtypes = [compute_dtype(g.dtype) for g in grads]
    k = len(grads)
    nout = k if write else 0
    scale_dtypes = sorted(set(out_dtypes), key=str)
    nscales = len(scale_dtypes)

    def kernel(*refs):
        # One reciprocal per compute dtype, rounded once in that dtype, computed in the
        # kernel (a separate XLA op would cost one more launch per step); `unscale_factors`'s
        # arithmetic, with the GPU's correctly rounded reciprocal.
        factors = {}
        for d, ref in zip(scale_dtypes, refs[:nscales], strict=True):
            p, _ = unscale_factors(ref[...])
            factors[d] = (p, reciprocal(ref[...] * p, interpret=interpret))
        refs = refs[nscales:]
        x_refs, o_refs, flag_ref = refs[:k], refs[k : k + nout], refs[k + nout]
        pid = pl.program_id(0)
        for j in range(k):

            @pl.when((pid >= starts[j]) & (pid < starts[j + 1]))
            def _(j=j):
                b, dtype = blocks[j], out_dtypes[j]
                mask = offsets(b, 0, (b,), pid - starts[j]) < sizes[j]
                # Loaded in the leaf's own dtype, widened in registers.
                x = pltriton.load(x_refs[j], mask=mask, other=0).astype(dtype)
                p, r = factors[dtype]
                u = (x * jnp.broadcast_to(p, (b,))) * jnp.broadcast_to(r, (b,))
                if write:
                    pltriton.store(o_refs[j], u, mask=mask)
                ok = jnp.where(mask, jnp.isfinite(u), True).astype(jnp.int32)
                flag_ref[...] = jnp.min(ok, keepdims=True)

    def leaf_spec(j):
        last = nblocks[j] - 1
        return pl.BlockSpec((blocks[j],), lambda i: (jnp.clip(i - starts[j], 0, last),))

    specs = [leaf_spec(j) for j in range(k)]
    grid = starts[-1]
    out_shapes = [
        _shape_like(g, (n,), d) for g, n, d in zip(grads, sizes, out_dtypes, strict=True)
    ][:nout]
    *unscaled, flags = pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,))] * nscales + specs,
        out_specs=[*specs[:nout], pl.BlockSpec((1,), lambda i: (i,))],
        out_shape=[*out_shapes, _shape_like(grads, (grid,), jnp.int32)],
        interpret=interpret,
        compiler_params=None if interpret else compiler_params(num_warps=4),
        name="mpjax_unscale_and_check" if write else "mpjax_all_finite_unscaled",
    )(*(scales[d] for d in scale_dtypes), *(g.reshape(-1) for g in grads))
    return unscaled, flags
