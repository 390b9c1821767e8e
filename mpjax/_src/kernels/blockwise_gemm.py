"""Blockwise-scaled fp8 GEMM (DeepSeek-V3's recipe) as fp8 tensor-core GEMMs on Hopper.

`a @ b.T` for fp8 operands whose scales change every 128 elements along the contraction
axis `K` (1x128 tiles of activations and gradients; 128x128 weight blocks, given here as
their rows' scales). No GEMM library XLA calls takes such scales on Hopper, so the kernel
does what DeepGEMM does: for each 128-wide slice of `K` it runs one fp8 x fp8 tensor-core
product into float32 and promotes it, multiplied by the slice's row and column scales, into
a float32 accumulator (one Triton program per 128x128 output tile). The XLA reference
dequantises both operands to float32 and multiplies them (the same sum, in another order).

`kernel="mosaic_gpu"` runs the Pallas Mosaic GPU kernel instead
(`mpjax._src.kernels.blockwise_gemm_mgpu`: TMA, warp specialisation, two consumer warpgroups
promoting in turn) where this JAX has its API, the Triton kernel where it has not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
)
from jax.experimental.pallas import triton as pltriton
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.kernels import blockwise_gemm_mgpu as mgpu
from mpjax._src.kernels.common import MAX_ELEMENTS, next_pow2
from mpjax._src.kernels.dispatch import dispatch

__all__ = [
    "BLOCK_K",
    "KERNELS",
    "KERNEL_NAME",
    "blockwise_fp8_gemm",
    "blockwise_fp8_gemm_reference",
]

BLOCK_K = 128
# The Pallas call's name in the compiled program (mpjax's cost model counts its FLOPs).
KERNEL_NAME = "mpjax_blockwise_fp8_gemm"
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_F32 = jnp.float32
_MIN_CAPABILITY = 8.9  # fp8 tensor cores: Ada, Hopper and later
# The GPU kernels: Pallas Triton (any JAX mpjax supports), Pallas Mosaic GPU (Hopper wgmma)
KERNELS = ("triton", "mosaic_gpu")


def _check(a, a_scales, b, b_scales) -> None:
    """Raises a ValueError naming the argument whose dtype or shape is off."""
    for name, x in (("a", a), ("b", b)):
        if np.dtype(x.dtype) not in _FP8 or np.ndim(x) != 2:
            raise ValueError(
                f"blockwise_fp8_gemm: {name} must be a 2-D float8_e4m3fn or float8_e5m2 "
                f"array, got {x.dtype}{tuple(np.shape(x))}"
            )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"blockwise_fp8_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must share K "
            "(their second axis): the product is a @ b.T"
        )
    blocks = -(-a.shape[1] // BLOCK_K)
    for name, s, x in (("a_scales", a_scales, a), ("b_scales", b_scales, b)):
        if tuple(np.shape(s)) != (x.shape[0], blocks) or np.dtype(s.dtype) != np.float32:
            raise ValueError(
                f"blockwise_fp8_gemm: {name} must be float32 of shape "
                f"{(x.shape[0], blocks)} (a row's scale per {BLOCK_K} elements of K), got "
                f"{s.dtype}{tuple(np.shape(s))}"
            )


def _unsupported(a, b) -> str | None:
    """Why the kernel cannot take these inputs here, or None."""
    if max(a.size, b.size) >= MAX_ELEMENTS:
        return f"operands of {max(a.size, b.size)} elements (int32 offsets)"
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend: a deviceless compile targets Hopper (sm_90)
        return None
    low = [d for d in gpus if float(getattr(d, "compute_capability", 0)) < _MIN_CAPABILITY]
    return f"no fp8 tensor cores on {low[0].device_kind}" if low else None


def _hopper_or_deviceless() -> bool:
    """Whether every local GPU is a Hopper (wgmma: sm_90a), or there is none (a deviceless
    compile, which targets Hopper)."""
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        return True
    return all(9.0 <= float(getattr(d, "compute_capability", 0)) < 10.0 for d in gpus)


def _chosen_kernel(kernel: str, impl: str) -> str:
    """`kernel` checked; "mosaic_gpu" becomes "triton" where this JAX lacks its API (or,
    for `impl="interpret"`, Pallas GPU interpret mode) or a local GPU is not a Hopper (Ada
    has no wgmma; Blackwell's tensor cores take tcgen05)."""
    if kernel not in KERNELS:
        raise ValueError(
            f"blockwise_fp8_gemm: kernel must be one of {KERNELS}, got {kernel!r} "
            "(mosaic_gpu: Hopper's wgmma kernel, triton: the portable one)"
        )
    available = mgpu.INTERPRET_AVAILABLE if impl == "interpret" else mgpu.KERNEL_AVAILABLE
    if kernel == "mosaic_gpu" and available and _hopper_or_deviceless():
        return kernel
    return "triton"


def blockwise_fp8_gemm_reference(a, a_scales, b, b_scales, *, out_dtype=_F32) -> jax.Array:
    """The XLA reference of `blockwise_fp8_gemm`: both operands dequantised, one float32 GEMM."""
    _check(a, a_scales, b, b_scales)
    k = a.shape[1]

    def dequantize(x, s):
        return x.astype(_F32) * jnp.repeat(s, BLOCK_K, axis=1)[:, :k]

    out = lax.dot_general(
        dequantize(a, a_scales),
        dequantize(b, b_scales),
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=_F32,
    )
    return out.astype(out_dtype)


def _kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, *, num_blocks: int):
    """One output tile: per 128-wide K slice, an fp8 GEMM promoted with its scales."""
    bm, bn = a_ref.shape[0], b_ref.shape[0]

    def body(kb, acc):
        k = pl.ds(pl.multiple_of(kb * BLOCK_K, BLOCK_K), BLOCK_K)
        part = lax.dot_general(
            a_ref[:, k], b_ref[:, k], (((1,), (1,)), ((), ())), preferred_element_type=_F32
        )
        row_scales = as_ref[pl.ds(kb, 1), :].reshape(bm, 1)
        return acc + part * row_scales * bs_ref[pl.ds(kb, 1), :]

    acc = lax.fori_loop(0, num_blocks, body, jnp.zeros((bm, bn), _F32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(n: int) -> int:
    """The output tile along an axis of `n`: 128 (a Hopper tensor-core tile), less for small n."""
    return min(128, max(16, next_pow2(n)))


def _pallas_gemm(a, a_scales, b, b_scales, *, out_dtype, interpret: bool) -> jax.Array:
    (m, k), n = a.shape, b.shape[0]
    bm, bn = _tile(m), _tile(n)
    blocks = a_scales.shape[1]
    pad_m, pad_n, pad_k = -m % bm, -n % bn, blocks * BLOCK_K - k
    a = jnp.pad(a, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else a
    b = jnp.pad(b, ((0, pad_n), (0, pad_k))) if pad_n or pad_k else b
    # scales transposed: a K block's scales are one contiguous row of a tile
    a_st = jnp.pad(a_scales.T, ((0, 0), (0, pad_m)))
    b_st = jnp.pad(b_scales.T, ((0, 0), (0, pad_n)))
    kp = blocks * BLOCK_K
    # the output varies over the mesh axes its operands vary over (under shard_map)
    mats = [jax.typeof(x).mat for x in (a, b)]
    varying = frozenset().union(*(mat.varying for mat in mats))
    out_shape = jax.ShapeDtypeStruct(
        (m + pad_m, n + pad_n), out_dtype, manual_axis_type=mats[0].update(varying=varying)
    )
    out = pl.pallas_call(
        functools.partial(_kernel, num_blocks=blocks),
        out_shape=out_shape,
        grid=((m + pad_m) // bm, (n + pad_n) // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((blocks, bm), lambda i, j: (0, i)),
            pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
            pl.BlockSpec((blocks, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=8 if bm * bn >= 128 * 64 else 4),
        interpret=interpret,
        name=KERNEL_NAME,
    )(a, a_st, b, b_st)
    return out[:m, :n] if pad_m or pad_n else out


def _entry_axes(entry) -> set:
    return set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))


def _decoded_spec(mesh, sharding, ndim: int) -> tuple:
    """`sharding`'s PartitionSpec entries on `mesh`; () (replicated) where it has none.

    XLA hands the partitioner HLO shardings; one that `mesh` cannot express (a dimension
    split 4 ways on an 8-device axis, as FSDP propagation gives a block-scale array) is
    taken as replicated instead of failing the compile.
    """
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.spec)
    hlo = getattr(sharding, "_hlo_sharding", None)
    if hlo is None or mesh is None or mesh.empty:
        return ()
    from jax._src.sharding_impls import parse_flatten_op_sharding

    try:
        return tuple(parse_flatten_op_sharding(hlo, mesh)[0])[:ndim]
    except Exception:  # noqa: BLE001 - not expressible on this mesh: replicate
        return ()


def _specs(mesh, arg_shapes) -> tuple[tuple, P]:
    """Operand and result specs: rows of `a` (M) and of `b` (N) keep their split, K whole."""
    a, b = arg_shapes[0], arg_shapes[2]
    m = (_decoded_spec(mesh, a.sharding, 2) or (None,))[0]
    n = (_decoded_spec(mesh, b.sharding, 2) or (None,))[0]
    if _entry_axes(m) & _entry_axes(n):  # one mesh axis cannot split both: b gathered
        n = None
    return (P(m, None), P(m, None), P(n, None), P(n, None)), P(m, n)


_RULE = SdyShardingRule(
    (
        ArrayMapping("m", "k"),
        ArrayMapping("m", "kb"),
        ArrayMapping("n", "k"),
        ArrayMapping("n", "kb"),
    ),
    (ArrayMapping("m", "n"),),
    need_replication_factors=("k", "kb"),
)


def _by_row_blocks(fn):
    """`fn(a, a_scales, b, b_scales)` run by each device on its rows of `a` and of `b`.

    A Pallas call is a custom call XLA cannot partition: given sharded operands it would
    gather them and run the whole GEMM on every device. Wrapped in `custom_partitioning`,
    each device multiplies its rows of `a` (tokens: data parallelism) by its rows of `b`
    (output features, where split), with K whole; the result is split like both.
    """
    wrapped = custom_partitioning(fn)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, _specs(mesh, arg_shapes)[1])

    def partition(mesh, arg_shapes, result_shape):
        args, out = _specs(mesh, arg_shapes)
        arg_shardings = tuple(NamedSharding(mesh, s) for s in args)
        return mesh, fn, NamedSharding(mesh, out), arg_shardings

    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_RULE,
        decode_shardings=False,  # decoded by `_specs`, which replicates what it cannot
    )
    return wrapped


def _sharded_explicitly(*xs) -> bool:
    """Whether any of `xs` has a type sharded over Explicit mesh axes."""
    for x in xs:
        sharding = getattr(jax.typeof(x), "sharding", None)
        if sharding is not None and not sharding.mesh.empty and any(sharding.spec):
            return True
    return False


def _explicit_rows(run, a, a_scales, b, b_scales):
    """`run` under `jax.shard_map` on each device's rows (types sharded over Explicit axes)."""
    mesh = jax.typeof(a).sharding.mesh if any(jax.typeof(a).sharding.spec) else None
    mesh = mesh or jax.typeof(b).sharding.mesh
    shapes = [jax.typeof(x) for x in (a, a_scales, b, b_scales)]
    args, out = _specs(mesh, shapes)
    axes = set().union(*(_entry_axes(e) for spec in args for e in spec))
    if not axes:  # split along K only: gathered, one GEMM
        return run(
            *(jax.sharding.reshard(x, NamedSharding(mesh, P())) for x in (a, a_scales, b, b_scales))
        )
    resharded = [
        jax.sharding.reshard(x, NamedSharding(mesh, s))
        for x, s in zip((a, a_scales, b, b_scales), args, strict=True)
    ]
    mapped = jax.shard_map(run, mesh=mesh, in_specs=args, out_specs=out, axis_names=axes)
    return mapped(*resharded)


def blockwise_fp8_gemm(
    a: jax.Array,
    a_scales: jax.Array,
    b: jax.Array,
    b_scales: jax.Array,
    *,
    out_dtype=_F32,
    impl: str = "auto",
    kernel: str = "triton",
) -> jax.Array:
    """`a @ b.T` of fp8 operands scaled per 128 elements of K, accumulated in float32.

    Element `a[m, k]` stands for `a[m, k] * a_scales[m, k // 128]` (and likewise `b`): the
    layout of DeepSeek-V3's 1x128 tiles; a 128x128 weight block gives its scale to each of
    its 128 rows. On CUDA GPUs with fp8 tensor cores (compute capability 8.9 or above, and
    a deviceless compile, which targets Hopper) it runs the Pallas kernel: one fp8 GEMM per
    128-wide slice of K promoted into float32 with its scales; elsewhere the XLA reference.

    Args:
      a: `[M, K]` float8_e4m3fn or float8_e5m2.
      a_scales: `[M, ceil(K / 128)]` float32.
      b: `[N, K]` float8_e4m3fn or float8_e5m2.
      b_scales: `[N, ceil(K / 128)]` float32.
      out_dtype: the result's dtype.
      impl: "auto", "pallas", "interpret" or "xla" (see `mpjax._src.kernels.dispatch`).
      kernel: the GPU kernel `impl` runs: "triton" (Pallas Triton, compute capability 8.9
        and above) or "mosaic_gpu" (Pallas Mosaic GPU, Hopper's wgmma; "triton" where this
        JAX lacks the Mosaic GPU API it uses, or its GPU interpret mode for
        `impl="interpret"`, or a local GPU is not a Hopper).

    Returns:
      `[M, N]` in `out_dtype`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.kernels.blockwise_gemm import blockwise_fp8_gemm
      >>> a = jnp.ones((16, 256), jnp.float8_e4m3fn)
      >>> scales = jnp.array([[1.0, 0.5]] * 16)
      >>> float(blockwise_fp8_gemm(a, scales, a, scales, impl="interpret")[0, 0])
      160.0
    """
    _check(a, a_scales, b, b_scales)
    kernel = _chosen_kernel(kernel, impl)
    if impl == "xla":
        return blockwise_fp8_gemm_reference(a, a_scales, b, b_scales, out_dtype=out_dtype)
    unsupported = _unsupported(a, b)
    if kernel == "mosaic_gpu":
        body = functools.partial(mgpu.mgpu_gemm, out_dtype=out_dtype)
    else:
        body = functools.partial(_pallas_gemm, out_dtype=out_dtype)

    def run(a, a_scales, b, b_scales):
        return dispatch(
            "blockwise_fp8_gemm",
            impl,
            (a, a_scales, b, b_scales),
            kernel=body,
            reference=functools.partial(blockwise_fp8_gemm_reference, out_dtype=out_dtype),
            unsupported=unsupported,
            triton=kernel == "triton",
        )

    if _sharded_explicitly(a, b):  # sharding in the types: shard_map over the same split
        return _explicit_rows(run, a, a_scales, b, b_scales)
    if impl == "interpret" and kernel == "mosaic_gpu":
        # Mosaic GPU's interpreter has ordered effects, which `custom_partitioning` cannot
        # lower: interpreted (a CPU check of the kernel), it runs whole, unpartitioned
        return run(a, a_scales, b, b_scales)

    # `custom_partitioning` has no batching rule: under `jax.vmap` the GEMM runs vmapped as
    # it is (a batched Pallas grid on the GPU).
    @jax.custom_batching.custom_vmap
    def call(a, a_scales, b, b_scales):
        return _by_row_blocks(run)(a, a_scales, b, b_scales)

    @call.def_vmap
    def call_batched(axis_size, in_batched, *args):
        in_axes = tuple(0 if batched else None for batched in in_batched)
        return jax.vmap(run, in_axes=in_axes, axis_size=axis_size)(*args), True

    return call(a, a_scales, b, b_scales)
