"""The blockwise fp8 GEMM kernel (Pallas, interpret mode here) against float64 arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax._src.kernels.blockwise_gemm import (
    blockwise_fp8_gemm,
    blockwise_fp8_gemm_reference,
)
from tests.helpers.blockwise_gemm import E4M3, E5M2, float64_blockwise, operands

_operands, _float64 = operands, float64_blockwise


@pytest.mark.parametrize(
    "m,n,k",
    [(16, 16, 128), (48, 96, 160), (200, 130, 384), (128, 256, 1000)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_kernel_equals_float64_per_block_sum(m, n, k, dtype):
    args = _operands(m, n, k, dtype)
    want = _float64(*args)
    got = jax.jit(lambda *a: blockwise_fp8_gemm(*a, impl="interpret"))(*args)
    # products of fp8 values are exact in float32; only the float32 sums round
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    ref = blockwise_fp8_gemm_reference(*args)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_out_dtype_and_auto_on_cpu_is_the_reference():
    args = _operands(64, 32, 256)
    got = blockwise_fp8_gemm(*args, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == (64, 32)
    want = blockwise_fp8_gemm_reference(*args, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_nonfinite_scales_and_values_propagate():
    a, sa, b, sb = _operands(16, 16, 256)
    sa = sa.at[3, 1].set(jnp.inf)
    a = a.at[5, 0].set(jnp.nan)
    got = np.asarray(blockwise_fp8_gemm(a, sa, b, sb, impl="interpret"))
    assert np.isnan(got[5]).all() and not np.isfinite(got[3]).any()
    assert np.isfinite(np.delete(got, [3, 5], axis=0)).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a, sa, b, sb: (a.astype(jnp.bfloat16), sa, b, sb), "a must be a 2-D float8"),
        (lambda a, sa, b, sb: (a, sa, b[:, :128], sb), r"must share K"),
        (lambda a, sa, b, sb: (a, sa[:, :1], b, sb), r"a_scales must be float32 of shape"),
        (lambda a, sa, b, sb: (a, sa, b, sb.astype(jnp.bfloat16)), "b_scales must be float32"),
    ],
)
def test_bad_inputs_name_the_argument(change, match):
    args = change(*_operands(16, 16, 256))
    with pytest.raises(ValueError, match=match):
        blockwise_fp8_gemm(*args)


def _mesh(explicit: bool):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_sharded_rows_stay_on_their_devices(explicit):
    # a's rows (tokens) split over "data", b's rows (output features) over "model", K whole:
    # each device multiplies its own rows; nothing of a or b is gathered
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(explicit)
    a, sa, b, sb = _operands(64, 32, 256)
    specs = (P("data", None), P("data", None), P("model", None), P("model", None))
    arrays = (a, sa, b, sb)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs, strict=True)]
    step = jax.jit(blockwise_fp8_gemm)
    with jax.set_mesh(mesh):
        got = step(*placed)
        text = step.lower(*placed).compile().as_text()
    assert got.sharding.spec == P("data", "model")
    want = _float64(a, sa, b, sb)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert "all-gather" not in text and "all-reduce" not in text, text


def test_vmap_runs_each_gemm_of_the_batch():
    ops = [_operands(32, 16, 256, seed=s) for s in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*ops, strict=True)]
    got = jax.jit(jax.vmap(lambda *a: blockwise_fp8_gemm(*a, impl="interpret")))(*stacked)
    for i, args in enumerate(ops):
        want = _float64(*args)
        np.testing.assert_allclose(
            np.asarray(got[i]), want, rtol=1e-5, atol=1e-6 * np.abs(want).max()
        )
    # the weight shared by the batch (in_axes None)
    a = jnp.stack([o[0] for o in ops])
    sa = jnp.stack([o[1] for o in ops])
    got = jax.vmap(blockwise_fp8_gemm, in_axes=(0, 0, None, None))(a, sa, ops[0][2], ops[0][3])
    want = _float64(ops[1][0], ops[1][1], ops[0][2], ops[0][3])
    np.testing.assert_allclose(np.asarray(got[1]), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_fsdp_step_compiles_and_matches_the_unsharded_one():
    # An FSDP-sharded weight with K = 512 (4 K blocks) over an 8-device axis: propagation
    # splits a block-scale array 4 ways, which the mesh cannot express; the partitioner
    # takes it as replicated (the compile failed before) and the numbers are unchanged.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mpjax import Fp8Recipe
    from mpjax.fp8 import block_scaled_dot_general

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    recipe = Fp8Recipe("blockwise", block_lowering="native")
    dims = (((1,), (0,)), ((), ()))
    x = jax.random.normal(jax.random.key(0), (256, 128))
    w1 = jax.random.normal(jax.random.key(1), (128, 512)) * 0.1
    w2 = jax.random.normal(jax.random.key(2), (512, 128)) * 0.1

    def loss(w1, w2, x):
        h = jax.nn.gelu(block_scaled_dot_general(x, w1, dims, recipe, jnp.float32))
        return jnp.sum(block_scaled_dot_general(h, w2, dims, recipe, jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)))
    want = grad(w1, w2, x)
    fsdp = NamedSharding(mesh, P("fsdp", None))
    args = [jax.device_put(a, fsdp) for a in (w1, w2, x)]
    got = grad(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-4)
