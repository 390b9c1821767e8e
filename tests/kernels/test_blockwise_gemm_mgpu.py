"""The Mosaic GPU blockwise fp8 GEMM on the CPU: its loop in `jax.numpy` (`reference_loop`:
the kernel's tiles, padding, promotion and scale order) and the kernel itself in Pallas GPU
interpret mode, against the XLA reference and float64 arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax._src.kernels import blockwise_gemm_mgpu as mgpu
from mpjax._src.kernels.blockwise_gemm import blockwise_fp8_gemm, blockwise_fp8_gemm_reference
from tests.helpers.blockwise_gemm import E4M3, E5M2
from tests.helpers.blockwise_gemm import float64_blockwise as _float64
from tests.helpers.blockwise_gemm import operands as _operands
from tests.helpers.fp8 import named_calls

# ragged M and N (not multiples of the 128-row CTA tile or the 128-column tile), K multiples
# of 128 and one that is not (padded with zeros inside its last block)
SHAPES = [(16, 16, 128), (200, 130, 384), (130, 257, 256), (1, 300, 512), (128, 128, 160)]


def _close(got, want):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6 * np.abs(want).max()
    )


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_loop_equals_float64_and_the_xla_reference(m, n, k, dtype):
    args = _operands(m, n, k, dtype)
    got = jax.jit(mgpu.reference_loop)(*args)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # fp8 products are exact in float32; only the float32 sums and the promotion round
    _close(got, _float64(*args))
    _close(got, blockwise_fp8_gemm_reference(*args))


def test_loop_tiling_changes_nothing_but_rounding():
    args = _operands(100, 200, 384)
    small = mgpu.Tiling(wg_tile_m=16, tile_n=32, num_consumers=3, grid_tile_width=2)
    _close(mgpu.reference_loop(*args, tiling=small), mgpu.reference_loop(*args))


def test_loop_out_dtype_is_one_rounding_of_the_float32_result():
    args = _operands(64, 96, 256)
    got = mgpu.reference_loop(*args, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = mgpu.reference_loop(*args).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _nonfinite_operands():
    """inf and NaN scales, a NaN element, an all-zero block with scale 0, huge and tiny scales."""
    a, sa, b, sb = _operands(200, 130, 384)
    sa = sa.at[3, 1].set(jnp.inf).at[7, 2].set(jnp.nan).at[9, 0].set(3e38)
    a = a.at[5, 200].set(jnp.nan)
    b = b.at[11, 128:256].set(0).astype(b.dtype)
    sb = sb.at[11, 1].set(0.0).at[13, 0].set(1e-38)
    return a, sa, b, sb


HUGE_ROW = 9  # a's scale 3e38 in K block 0


def _float64_in_float32(args) -> np.ndarray:
    """The block-scaling definition in float64, then float32's range (inf beyond it)."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as it should be
        want = _float64(*args)
    big = np.abs(want) > np.finfo(np.float32).max
    return np.where(big, np.sign(want) * np.inf, want)


def _check_nonfinite(got, args):
    got, want = np.asarray(got), _float64_in_float32(args)
    # finite where the definition is: an inf scale gives inf (part * inf), a NaN element or
    # scale a NaN row, the zero block nothing, the huge scale inf only beyond float32
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    for row in (5, 7):
        assert np.isnan(got[row]).all()
    assert not np.isfinite(got[3]).any() and np.isfinite(got[HUGE_ROW]).any()
    finite = np.isfinite(want)
    np.testing.assert_allclose(
        got[finite], want[finite], rtol=1e-5, atol=1e-6 * np.abs(want[finite]).max()
    )
    # the XLA reference: the same, but for the huge scale (its dequantised a[9] overflows
    # before the product: inf where the promoted product is finite)
    ref = np.asarray(blockwise_fp8_gemm_reference(*args))
    rows = [r for r in range(ref.shape[0]) if r != HUGE_ROW]
    np.testing.assert_array_equal(np.isfinite(got[rows]), np.isfinite(ref[rows]))
    assert np.isfinite(got[HUGE_ROW]).sum() > np.isfinite(ref[HUGE_ROW]).sum()


def test_loop_nonfinite_and_zero_blocks_as_the_block_scaling_definition():
    args = _nonfinite_operands()
    got = mgpu.reference_loop(*args)
    _check_nonfinite(got, args)
    # the zero block (scale 0) adds nothing: column 11 is as if its K block were absent
    a, sa, b, sb = args
    keep = np.r_[0:128, 256:384]
    rows = [r for r in range(200) if r not in (3, 5, 7, HUGE_ROW)]
    with np.errstate(invalid="ignore", over="ignore"):
        want = _float64(a[:, keep], sa[:, [0, 2]], b[:, keep], sb[:, [0, 2]])
    np.testing.assert_allclose(np.asarray(got)[rows, 11], want[rows, 11], rtol=1e-5)


def test_tile_order_visits_each_tile_once_in_mosaic_gpus_snake_order():
    for tiles_m, tiles_n, width in [(5, 3, 2), (8, 8, 2), (3, 7, 8), (1, 1, 8), (17, 4, 8)]:
        i, j = mgpu._tile_order(tiles_m, tiles_n, width)
        pairs = sorted(zip(np.asarray(i).tolist(), np.asarray(j).tolist(), strict=True))
        assert pairs == [(x, y) for x in range(tiles_m) for y in range(tiles_n)]
        snake = jax.vmap(
            lambda lin, s=(tiles_m, tiles_n), w=width: mgpu.plgpu.planar_snake(lin, s, 0, w)
        )(jnp.arange(tiles_m * tiles_n, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(snake[0]))
        np.testing.assert_array_equal(np.asarray(j), np.asarray(snake[1]))


# --- the kernel itself, in Pallas GPU interpret mode -----------------------------------------


def _interpret(*args, **kw):
    return blockwise_fp8_gemm(*args, impl="interpret", kernel="mosaic_gpu", **kw)


def _refused_without_interpret_mode(args) -> bool:
    """On a JAX without Pallas GPU interpret mode: the kernel refuses by name, and
    `blockwise_fp8_gemm` interprets the Triton kernel instead (same numbers). True there."""
    if mgpu.INTERPRET_AVAILABLE:
        return False
    with pytest.raises(ValueError, match="interpret mode"):
        mgpu.mgpu_gemm(*args, interpret=True)
    traced = str(jax.make_jaxpr(_interpret)(*args))
    assert (
        f"name={mgpu.KERNEL_NAME}\n" not in traced and "name=mpjax_blockwise_fp8_gemm\n" in traced
    )
    _close(_interpret(*args), mgpu.reference_loop(*args))
    return True


@pytest.mark.parametrize(
    "m,n,k,dtype", [(200, 130, 384, E4M3), (16, 16, 160, E4M3), (72, 200, 256, E5M2)], ids=str
)
def test_kernel_in_interpret_mode_equals_its_loop(m, n, k, dtype):
    args = _operands(m, n, k, dtype)
    if _refused_without_interpret_mode(args):
        return
    got = jax.jit(_interpret)(*args)  # jit: as a program runs it (eager below)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    _close(got, mgpu.reference_loop(*args))
    _close(got, _float64(*args))


def test_kernel_in_interpret_mode_nonfinite_and_bf16_out():
    args = _nonfinite_operands()
    if _refused_without_interpret_mode(_operands(64, 128, 256)):
        return
    _check_nonfinite(_interpret(*args), args)
    args = _operands(64, 128, 256)
    got = _interpret(*args, out_dtype=jnp.bfloat16)
    want = mgpu.reference_loop(*args, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    _close(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- the choice of kernel ---------------------------------------------------------------------


def test_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kernel must be one of \('triton', 'mosaic_gpu'\)"):
        blockwise_fp8_gemm(*_operands(16, 16, 128), kernel="cutlass")


def _traced(kernel: str) -> str:
    args = _operands(64, 64, 256)
    return str(jax.make_jaxpr(lambda *a: blockwise_fp8_gemm(*a, kernel=kernel))(*args))


def test_each_kernel_is_the_one_traced_for_the_gpu():
    # "auto": the GPU kernel and the XLA reference behind `platform_dependent` (for the
    # Triton kernel only where JAX does not deprecate Pallas Triton: before 0.11)
    from mpjax._src.kernels.dispatch import TRITON_DEPRECATED

    mosaic, triton = _traced("mosaic_gpu"), _traced("triton")
    assert mgpu.KERNEL_AVAILABLE  # both JAX versions mpjax supports have the API
    assert f"name={mgpu.KERNEL_NAME}\n" in mosaic and "mgpu" not in triton
    assert ("name=mpjax_blockwise_fp8_gemm\n" in triton) == (not TRITON_DEPRECATED)


def test_explicit_native_lowering_takes_the_mosaic_kernel_and_auto_does_not():
    from mpjax import Fp8Recipe
    from mpjax.fp8 import block_scaled_dot_general

    dims = (((1,), (0,)), ((), ()))
    x, w = jnp.ones((256, 256)), jnp.ones((256, 128))

    def jaxpr(lowering):
        recipe = Fp8Recipe("blockwise", block_lowering=lowering)
        grad = jax.grad(
            lambda x, w: jnp.sum(block_scaled_dot_general(x, w, dims, recipe, jnp.float32)),
            (0, 1),
        )
        return jax.make_jaxpr(grad)(x, w).jaxpr

    # forward, input gradient, weight gradient: each the Mosaic GPU kernel on a CUDA GPU
    assert named_calls(jaxpr("native"), mgpu.KERNEL_NAME) == 3
    assert mgpu.KERNEL_NAME not in str(jaxpr("auto"))  # auto (emulated on a CPU) never picks it


def test_auto_keeps_the_mosaic_kernel_where_jax_deprecates_only_triton(monkeypatch):
    """`impl="auto"` stages the Mosaic GPU kernel for CUDA on every jax (the Triton kernel
    falls back to the XLA reference where JAX deprecates Pallas Triton, from 0.11), so
    `block_lowering="native"` runs the new kernel on the newest JAX too."""
    from mpjax._src.kernels import blockwise_gemm
    from mpjax._src.kernels.dispatch import TRITON_DEPRECATED, dispatch

    x = jnp.ones(3)

    def staged(triton):
        fn = lambda x: dispatch("f", "auto", (x,), kernel=lambda x, interpret: jnp.sin(x),
                                reference=jnp.cos, triton=triton)  # fmt: skip
        return "sin" in str(jax.make_jaxpr(fn)(x))

    assert staged(triton=False)
    assert staged(triton=True) == (not TRITON_DEPRECATED)
    # the blockwise GEMM tells dispatch which backend its kernel lowers through
    monkeypatch.setattr(blockwise_gemm, "_hopper_or_deviceless", lambda: True)
    seen = []

    def recording(*a, triton=True, **kw):
        seen.append(triton)
        return dispatch(*a, triton=triton, **kw)

    monkeypatch.setattr(blockwise_gemm, "dispatch", recording)
    args = _operands(128, 128, 256)
    for kernel in ("mosaic_gpu", "triton"):
        jax.eval_shape(lambda *a, k=kernel: blockwise_fp8_gemm(*a, kernel=k), *args)
    assert set(seen) == ({False, True} if mgpu.KERNEL_AVAILABLE else {True}), seen
    assert seen[0] is (not mgpu.KERNEL_AVAILABLE) and seen[-1] is True, seen
