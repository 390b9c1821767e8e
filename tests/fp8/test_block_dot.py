"""Block-scaled GEMMs (emulated): forward and both gradients equal the dequantised reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax import Fp8Recipe
from mpjax._src.fp8 import block_dot
from mpjax._src.fp8.block_dot import gradient_seed
from mpjax._src.fp8.blocks import hash_uniform, quantize_with_blocks, row_major_index
from mpjax.fp8 import (
    block_scaled_dot_general,
    dequantize_blocks,
    fp8_ops,
    quantize_blocks,
    random_hadamard,
)

DIMS = (((1,), (0,)), ((), ()))
F32 = jnp.float32


@jax.jit(static_argnums=(1, 2, 3))
def _deq_jit(x, recipe, axis, role):
    return dequantize_blocks(quantize_blocks(x, recipe, axis=axis, role=role))


def _deq(x, recipe, axis, role):
    return np.asarray(_deq_jit(x, recipe, axis, role), np.float64)


def _operands():
    x = jax.random.normal(jax.random.key(0), (48, 160)) * jnp.exp(
        3 * jax.random.normal(jax.random.key(1), (48, 1))
    )  # rows over ~8 binades
    w = jax.random.normal(jax.random.key(2), (160, 96)) * 0.05
    g = jax.random.normal(jax.random.key(3), (48, 96))
    return x, w, g


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4", "blockwise"])
def test_forward_and_gradients_equal_the_dequantised_reference(scaling):
    recipe = Fp8Recipe(scaling=scaling)
    x, w, g = _operands()

    @jax.jit
    def run(a, b, g):
        out, vjp = jax.vjp(lambda a, b: block_scaled_dot_general(a, b, DIMS, recipe, F32), a, b)
        return out, *vjp(g)

    out, dx, dw = run(x, w, g)
    # forward: x in 1-D blocks along K, w as a weight (2-D blocks for nvfp4 / blockwise)
    want = _deq(x, recipe, 1, "activation") @ _deq(w, recipe, 0, "weight")
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # input gradient: g along N, w along N
    want_dx = _deq(g, recipe, 1, "gradient") @ _deq(w, recipe, 1, "weight").T
    np.testing.assert_allclose(
        np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5 * np.abs(want_dx).max()
    )
    # weight gradient: both along the tokens (nvfp4: Hadamard-rotated, g stochastic)
    if scaling == "nvfp4":  # the gradient rounded stochastically, seeded by its own bits
        xs, gs = random_hadamard(x, 0), random_hadamard(g, 0)
        draws = hash_uniform(gradient_seed(g), row_major_index(gs.T.shape))
        gq = jax.jit(quantize_with_blocks, static_argnums=(1, 2))(
            gs.T, "nvfp4", (1, 16), False, draws
        )
        want_dw = (
            _deq(xs, recipe, 0, "activation").T @ np.asarray(dequantize_blocks(gq), np.float64).T
        )
    else:
        want_dw = _deq(x, recipe, 0, "activation").T @ _deq(g, recipe, 0, "gradient")
    np.testing.assert_allclose(
        np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5 * np.abs(want_dw).max()
    )


def test_random_hadamard_is_orthogonal_along_the_contraction():
    x, _, g = _operands()
    got = np.asarray(random_hadamard(x, 0), np.float64).T @ np.asarray(
        random_hadamard(g, 0), np.float64
    )
    want = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # and it spreads a single outlier over its run of 16
    spike = jnp.zeros((16, 1)).at[3, 0].set(16.0)
    assert np.allclose(np.abs(np.asarray(random_hadamard(spike, 0))), 4.0)


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
def test_autocast_runs_block_scaled_gemms_and_fp8_ops_says_emulated(scaling):
    recipe = Fp8Recipe(scaling=scaling, min_dim=16)
    x, w, _ = _operands()
    f = lambda a, b: jnp.tanh(a @ b)
    got = jax.jit(mpjax.autocast(f, "float32", fp8=recipe))(x, w)
    want = np.tanh(_deq(x, recipe, 1, "activation") @ _deq(w, recipe, 0, "weight"))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    (op,) = fp8_ops(f, recipe, x, w)
    assert op.fp8 and op.lowering == f"emulated {scaling}"
    (op,) = fp8_ops(f, Fp8Recipe(min_dim=16), x, w)
    assert op.lowering == "fp8"


def _scaled_matmul_as_documented(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=F32):
    """`jax.nn.scaled_matmul`'s documented semantics (it has no CPU lowering)."""
    a = lhs.astype(F32) * jnp.repeat(
        lhs_scales.astype(F32), lhs.shape[-1] // lhs_scales.shape[-1], -1
    )
    b = rhs.astype(F32) * jnp.repeat(
        rhs_scales.astype(F32), rhs.shape[-1] // rhs_scales.shape[-1], -1
    )
    return jnp.einsum("BMK,BNK->BMN", a, b).astype(preferred_element_type)


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_native_lowering_computes_what_the_emulated_one_does(scaling, monkeypatch):
    # The operands, block scales, K padding and tensor scales handed to scaled_matmul give
    # the emulated path's numbers (the weight gradient contracts M = 48: a padded block).
    monkeypatch.setattr(jax.nn, "scaled_matmul", _scaled_matmul_as_documented)
    # scaled_matmul stands in for the GPU: the refusal of "native" without one is lifted
    monkeypatch.setattr(block_dot, "_gpu_lowering_possible", lambda: True)
    x, w, g = _operands()

    def grads(lowering):
        recipe = Fp8Recipe(scaling=scaling, block_lowering=lowering)
        f = lambda a, b: block_scaled_dot_general(a, b, DIMS, recipe, F32)
        out, vjp = jax.vjp(f, x, w)
        return out, *vjp(g)

    native, emulated = jax.jit(lambda: grads("native"))(), jax.jit(lambda: grads("emulated"))()
    for got, want in zip(native, emulated, strict=True):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=1e-5)


def test_several_contracted_axes_pair_in_the_given_order():
    # dims contract a's axes (1, 2) with b's (1, 0): b transposed to pair them in sorted
    # order is the same product, with the same blocks (K flattened in pairing order).
    a = jax.random.normal(jax.random.key(0), (4, 2, 48))
    b = jax.random.normal(jax.random.key(1), (48, 2, 5))
    b_sorted = jnp.transpose(b, (1, 0, 2))
    recipe = Fp8Recipe(scaling="mxfp8")

    def loss(a, b, dims):
        out = block_scaled_dot_general(a, b, (dims, ((), ())), recipe, F32)
        return jnp.sum(jnp.sin(out))

    val, (da, db) = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)(
        a, b, ((1, 2), (1, 0))
    )
    val2, (da2, db2) = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)(
        a, b_sorted, ((1, 2), (0, 1))
    )
    np.testing.assert_array_equal(np.asarray(val), np.asarray(val2))
    np.testing.assert_array_equal(np.asarray(da), np.asarray(da2))
    np.testing.assert_array_equal(np.asarray(db), np.asarray(jnp.transpose(db2, (1, 0, 2))))


def test_blockwise_native_runs_the_kernel_with_the_emulated_numbers(monkeypatch):
    # "native" blockwise GEMMs are mpjax's Pallas kernel (fp8 GEMMs promoted per K block),
    # here in interpret mode; all three GEMMs equal the dequantised (emulated) ones.

    from mpjax._src.kernels.blockwise_gemm import blockwise_fp8_gemm

    calls = []

    def interpreted(*args, **kw):
        calls.append(args[0].dtype)
        return blockwise_fp8_gemm(*args, **kw, impl="interpret")

    monkeypatch.setattr(block_dot, "blockwise_fp8_gemm", interpreted)
    x, w, g = _operands()

    def grads(lowering):
        recipe = Fp8Recipe(scaling="blockwise", block_lowering=lowering)
        f = lambda a, b: block_scaled_dot_general(a, b, DIMS, recipe, F32)
        out, vjp = jax.vjp(f, x, w)
        return out, *vjp(g)

    native = jax.jit(lambda: grads("native"))()
    assert calls == [jnp.float8_e4m3fn] * 3  # forward, input and weight gradient
    emulated = jax.jit(lambda: grads("emulated"))()
    for got, want in zip(native, emulated, strict=True):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=1e-5)
    recipe = Fp8Recipe("blockwise", block_lowering="native", min_dim=16)
    (op,) = fp8_ops(lambda a, b: a @ b, recipe, x, w)
    assert op.lowering == "native blockwise"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is for hosts without one")
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_native_lowering_without_a_gpu_is_refused_at_the_call(scaling):
    """It failed at lowering with "MLIR translation rule for primitive 'scaled_matmul' not
    found for platform cpu"; now the call names block_lowering and the fix."""
    recipe = Fp8Recipe(scaling, block_lowering="native", min_dim=16)
    dims = (((1,), (0,)), ((), ()))
    with pytest.raises(ValueError, match="block_lowering='native'\\) needs a GPU.*'emulated'"):
        block_scaled_dot_general(jnp.ones((4, 32)), jnp.ones((32, 8)), dims, recipe, jnp.float32)
