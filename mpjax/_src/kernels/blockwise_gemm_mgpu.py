"""The blockwise fp8 GEMM as a Pallas Mosaic GPU kernel for Hopper, built the DeepGEMM way.

`a @ b.T` for fp8 `a [M, K]`, `b [N, K]` (both K-major) scaled per 128 elements of K
(`a_scales [M, K/128]`, `b_scales [N, K/128]`: DeepSeek-V3's 1x128 tiles, 128x128 weight
blocks given as their rows' scales). Per CTA, a persistent loop over 128 x `tile_n` output
tiles in a snake order that keeps the operands' tiles warm in L2; per tile, a warp-specialised
pipeline: one memory warpgroup TMA-loads each 128-wide K slice of `a` and `b` and their scales
into shared memory (`max_concurrent_steps` slots deep), two consumer warpgroups (64 rows each)
run one fp8 `wgmma` per slice into a fresh float32 partial and promote it into a float32
register accumulator: `acc += part * (a_scale[row] * b_scale[col])`. While one warpgroup
promotes, the other's `wgmma` keeps the tensor cores busy (the Triton kernel drains them at
every promotion). The epilogue stores the tile through shared memory with a TMA copy.

`reference_loop` is the same loop in plain `jax.numpy` (same tiles, padding, promotion and
scale order): the kernel's tiling and promotion logic, checkable on any device.

Needs the Mosaic GPU API this file uses (`KERNEL_AVAILABLE`); Pallas GPU interpret mode
(`INTERPRET_AVAILABLE`) runs the kernel on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

try:  # Mosaic GPU's Pallas API; absent or partial in older JAX: the Triton kernel then
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _NEEDED = (
        "kernel", "emit_pipeline_warp_specialized", "nd_loop", "planar_snake", "wgmma",
        "ACC", "Layout", "load", "layout_cast", "TilingTransform", "SwizzleTransform",
        "find_swizzle", "SMEM", "BlockSpec", "copy_smem_to_gmem", "commit_smem",
        "wait_smem_to_gmem",
    )  # fmt: skip
    KERNEL_AVAILABLE = all(hasattr(plgpu, name) for name in _NEEDED)
    # `load(ref, idx, layout=...)` in older JAX, `load(ref, layout=...)` in newer
    _LOAD_TAKES_IDX = KERNEL_AVAILABLE and "idx" in inspect.signature(plgpu.load).parameters
    INTERPRET_AVAILABLE = KERNEL_AVAILABLE and hasattr(plgpu, "InterpretGPUParams")
    # `kernel(body, out_shape)` in jax 0.10.0 and 0.10.1, `kernel(body, out_type=...)` after
    _OUT_TYPE = (
        "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"
    )
except ImportError:  # pragma: no cover - a JAX without Mosaic GPU
    KERNEL_AVAILABLE = INTERPRET_AVAILABLE = False

__all__ = [
    "INTERPRET_AVAILABLE",
    "KERNEL_AVAILABLE",
    "KERNEL_NAME",
    "Tiling",
    "mgpu_gemm",
    "reference_loop",
]

# The kernel's name in the compiled program (in the custom call's metadata op_name).
KERNEL_NAME = "mpjax_blockwise_fp8_gemm_mgpu"
BLOCK_K = 128  # one scale per 128 elements of K: one wgmma K slice per promotion
_F32 = jnp.float32
_H100_SMS = 132  # the persistent grid where no device says its count (a deviceless trace)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The kernel's tile sizes and schedule.

    Attributes:
      wg_tile_m: rows of `a` per consumer warpgroup (64: one wgmma's M).
      tile_n: rows of `b` (output columns) per CTA tile; both warpgroups share them.
      num_consumers: consumer warpgroups per CTA (2: CTA tile `2 * wg_tile_m` rows).
      max_concurrent_steps: shared-memory slots of the K pipeline.
      grid_tile_width: the snake order's band width in tiles (L2 reuse of both operands).
    """

    wg_tile_m: int = 64
    tile_n: int = 128
    num_consumers: int = 2
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8

    @property
    def tile_m(self) -> int:
        """Rows of the CTA's output tile."""
        return self.wg_tile_m * self.num_consumers


DEFAULT_TILING = Tiling()


def _padded(a, a_scales, b, b_scales, tiling: Tiling):
    """Operands padded to whole tiles (zeros: padded rows and K columns add nothing) and
    the scales transposed to `[K/128, rows]` (a K slice's scales contiguous for TMA)."""
    (m, k), n = a.shape, b.shape[0]
    blocks = a_scales.shape[1]
    pad_m, pad_n, pad_k = -m % tiling.tile_m, -n % tiling.tile_n, blocks * BLOCK_K - k
    a = jnp.pad(a, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else a
    b = jnp.pad(b, ((0, pad_n), (0, pad_k))) if pad_n or pad_k else b
    a_st = jnp.pad(a_scales.T, ((0, 0), (0, pad_m)))
    b_st = jnp.pad(b_scales.T, ((0, 0), (0, pad_n)))
    return a, a_st, b, b_st


def _tile_order(tiles_m: int, tiles_n: int, width: int):
    """The snake order's `(i, j)` for each linear tile index (jnp; `planar_snake`'s order
    along N in bands of `width` M tiles)."""
    lin = jnp.arange(tiles_m * tiles_n)
    band_rows = width * tiles_n
    band, within = lin // band_rows, lin % band_rows
    rows_here = jnp.minimum(width, tiles_m - band * width)
    j = within // rows_here
    i = band * width + within % rows_here
    j = jnp.where(band % 2 == 1, tiles_n - 1 - j, j)
    return i, j


def reference_loop(a, a_scales, b, b_scales, *, out_dtype=_F32, tiling: Tiling = DEFAULT_TILING):
    """The kernel's loop in `jax.numpy`: the same padding, tiles, order and promotion.

    For each output tile (in the kernel's snake order) and each consumer warpgroup's rows,
    for each 128-wide K slice: the slice's exact fp8 product summed in float32 (`part`),
    promoted as `acc = acc + part * (a_scale[row] * b_scale[col])`; the tile cast to
    `out_dtype` and cropped to `[M, N]`.

    Args:
      a: `[M, K]` float8_e4m3fn or float8_e5m2.
      a_scales: `[M, ceil(K / 128)]` float32.
      b: `[N, K]` float8_e4m3fn or float8_e5m2.
      b_scales: `[N, ceil(K / 128)]` float32.
      out_dtype: the result's dtype.
      tiling: the kernel's `Tiling`.

    Returns:
      `[M, N]` in `out_dtype`.
    """
    (m, _), n = a.shape, b.shape[0]
    a, a_st, b, b_st = _padded(a, a_scales, b, b_scales, tiling)
    tiles_m, tiles_n = a.shape[0] // tiling.tile_m, b.shape[0] // tiling.tile_n
    wm, tn, blocks = tiling.wg_tile_m, tiling.tile_n, a_st.shape[0]

    def tile(i, j, wg):  # one warpgroup's [wm, tn] tile
        rows = i * tiling.tile_m + wg * wm

        def promote(kb, acc):
            a_k = lax.dynamic_slice(a, (rows, kb * BLOCK_K), (wm, BLOCK_K)).astype(_F32)
            b_k = lax.dynamic_slice(b, (j * tn, kb * BLOCK_K), (tn, BLOCK_K)).astype(_F32)
            part = lax.dot_general(
                a_k, b_k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST
            )
            sa = lax.dynamic_slice(a_st, (kb, rows), (1, wm))[0]
            sb = lax.dynamic_slice(b_st, (kb, j * tn), (1, tn))[0]
            return acc + part * (sa[:, None] * sb[None, :])

        return lax.fori_loop(0, blocks, promote, jnp.zeros((wm, tn), _F32)).astype(out_dtype)

    i, j = _tile_order(tiles_m, tiles_n, tiling.grid_tile_width)
    wgs = jnp.arange(tiling.num_consumers)
    tiles = jax.vmap(lambda i, j: jax.vmap(lambda w: tile(i, j, w))(wgs))(i, j)
    # tiles[t, wg] is output rows i*tile_m + wg*wm.., columns j*tn..: scatter to [Mp, Np]
    out = jnp.zeros((tiles_m, tiles_n, tiling.tile_m, tn), out_dtype)
    out = out.at[i, j].set(tiles.reshape(-1, tiling.tile_m, tn))
    out = out.transpose(0, 2, 1, 3).reshape(tiles_m * tiling.tile_m, tiles_n * tn)
    return out[:m, :n]


def _load(ref, layout):
    """`ref`'s whole contents in registers, in `layout`."""
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_IDX else plgpu.load(ref, layout=layout)


def _num_sms() -> int:
    """The SMs of the GPU traced for: the abstract mesh's device, else a GPU backend's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and getattr(device, "num_cores", None):
        return int(device.num_cores)
    try:
        return int(jax.local_devices(backend="gpu")[0].core_count)
    except (RuntimeError, AttributeError, IndexError):
        return _H100_SMS


def _kernel(a_gmem, as_gmem, b_gmem, bs_gmem, out_gmem, *, tiling: Tiling):
    """The persistent kernel body (all warpgroups; the pipeline specialises them)."""
    out_dtype = out_gmem.dtype
    wm, tn, tm = tiling.wg_tile_m, tiling.tile_n, tiling.tile_m
    tiles_m, tiles_n = a_gmem.shape[0] // tm, b_gmem.shape[0] // tn
    k_iters = as_gmem.shape[0]
    swizzle = plgpu.find_swizzle(BLOCK_K * jnp.dtype(a_gmem.dtype).itemsize * 8)
    fp8_transforms = (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(a_gmem.dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    out_swizzle = plgpu.find_swizzle(tn * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, BLOCK_K), lambda k: (0, k), transforms=fp8_transforms),
                plgpu.BlockSpec((1, tm), lambda k: (k, 0)),
                plgpu.BlockSpec((tn, BLOCK_K), lambda k: (0, k), transforms=fp8_transforms),
                plgpu.BlockSpec((1, tn), lambda k: (k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=tiling.num_consumers,
            max_concurrent_steps=tiling.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(a_gmem, as_gmem, b_gmem, bs_gmem),
        out_smem=plgpu.SMEM((tiling.num_consumers, wm, tn), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((tiles_m * tiles_n,), collective_axes="sm")
        def _tiles(info):
            (lin,) = info.index
            i, j = plgpu.planar_snake(lin, (tiles_m, tiles_n), 0, tiling.grid_tile_width)
            rows = pl.ds(wg * wm, wm)

            def compute_context(run):
                acc = plgpu.layout_cast(jnp.zeros((wm, tn), _F32), plgpu.Layout.WGMMA)
                acc = run(acc)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store
                out_smem[wg] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg], out_gmem.at[pl.ds(i * tm + wg * wm, wm), pl.ds(j * tn, tn)]
                )

            def promote(_, a_smem, as_smem, b_smem, bs_smem, acc):
                def slice_product(acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.transpose((1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(slice_product, plgpu.ACC((wm, tn), _F32))
                sa = _load(as_smem.at[0, rows], plgpu.Layout.WGMMA.reduce(1))
                sb = _load(bs_smem.at[0], plgpu.Layout.WGMMA.reduce(0))
                scale = lax.broadcast_in_dim(sa, (wm, tn), [0]) * lax.broadcast_in_dim(
                    sb, (wm, tn), [1]
                )
                return acc + part * scale

            pipeline(promote, compute_context)(
                a_gmem.at[pl.ds(i * tm, tm), :],
                as_gmem.at[:, pl.ds(i * tm, tm)],
                b_gmem.at[pl.ds(j * tn, tn), :],
                bs_gmem.at[:, pl.ds(j * tn, tn)],
                allocations=allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def mgpu_gemm(
    a,
    a_scales,
    b,
    b_scales,
    *,
    out_dtype=_F32,
    interpret: bool = False,
    tiling: Tiling = DEFAULT_TILING,
) -> jax.Array:
    """`a @ b.T` of block-scaled fp8 operands by the Mosaic GPU kernel (inputs checked by
    the caller, `mpjax._src.kernels.blockwise_gemm`).

    Args:
      a: `[M, K]` float8_e4m3fn or float8_e5m2.
      a_scales: `[M, ceil(K / 128)]` float32.
      b: `[N, K]` float8_e4m3fn or float8_e5m2.
      b_scales: `[N, ceil(K / 128)]` float32.
      out_dtype: the result's dtype.
      interpret: run in Pallas GPU interpret mode (any device; `INTERPRET_AVAILABLE`).
      tiling: tile sizes and schedule.

    Returns:
      `[M, N]` in `out_dtype`.
    """
    if not KERNEL_AVAILABLE:
        raise ValueError(
            "blockwise_fp8_gemm: this JAX has no Mosaic GPU pipeline API "
            "(jax.experimental.pallas.mosaic_gpu.emit_pipeline_warp_specialized and friends); "
            "use kernel='triton' or upgrade JAX"
        )
    if interpret and not INTERPRET_AVAILABLE:
        raise ValueError(
            "blockwise_fp8_gemm: impl='interpret' with kernel='mosaic_gpu' needs Pallas GPU "
            "interpret mode (jax.experimental.pallas.mosaic_gpu.InterpretGPUParams, "
            f"JAX newer than {jax.__version__}); use kernel='triton' or impl='xla'"
        )
    (m, _), n = a.shape, b.shape[0]
    a, a_st, b, b_st = _padded(a, a_scales, b, b_scales, tiling)
    out_dtype = jnp.dtype(out_dtype)
    out = _padded_gemm(a, a_st, b, b_st, out_dtype, interpret, tiling, _num_sms())
    return out[:m, :n] if out.shape != (m, n) else out


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _padded_gemm(a, a_st, b, b_st, out_dtype, interpret: bool, tiling: Tiling, sms: int):
    """The kernel on whole tiles. A jit of its own: the GEMMs of one shape in a program (each
    layer of a model, forward and backward) share one trace and one lowering of the kernel,
    which is most of a step's tracing time (a Mosaic GPU lowering is ~0.3 s of Python)."""
    tiles = (a.shape[0] // tiling.tile_m) * (b.shape[0] // tiling.tile_n)
    call = plgpu.kernel(
        functools.partial(_kernel, tiling=tiling),
        **{_OUT_TYPE: jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype)},
        grid=(max(1, min(sms, tiles)),),
        grid_names=("sm",),
        num_threads=tiling.num_consumers + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(a, a_st, b, b_st)
