"""A block-scaled GEMM keeps for its backward the quantised copy its weight gradient reads,
not the activation: the saved residual is the block-quantised operand itself (issue 36).

The weight gradient contracts the tokens, so it reads the activation as `[K, M]` quantised
along M; the forward makes that copy (the same bits the backward would make: the gradients are
unchanged, tests/fp8/test_block_dot.py) and keeps it in place of the bfloat16 `[M, K]`
activation: 1 byte an element (NVFP4: half a byte) with its scales, where bfloat16 takes 2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import mpjax
from mpjax.fp8 import block_scaled_dot_general

M, K, N = 256, 512, 384
LOW = {"mxfp8": jnp.float8_e4m3fn, "blockwise": jnp.float8_e4m3fn, "nvfp4": jnp.float4_e2m1fn}
DIMS = (((1,), (0,)), ((), ()))


def _residuals(fn, *args):
    return [(tuple(aval.shape), jnp.dtype(aval.dtype)) for aval, _ in saved_residuals(fn, *args)]


def _bytes(shape, dtype) -> float:
    bits = 4 if dtype == jnp.float4_e2m1fn else 8 * jnp.dtype(dtype).itemsize
    return np.prod(shape) * bits / 8


@pytest.mark.parametrize("scaling", sorted(LOW))
def test_the_activation_is_kept_as_its_quantised_weight_gradient_copy(scaling):
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
    recipe = mpjax.Fp8Recipe(scaling)

    def loss(x, w):
        return jnp.sum(block_scaled_dot_general(x, w, DIMS, recipe, jnp.bfloat16))

    saved = _residuals(loss, x, w)
    assert ((M, K), jnp.dtype(jnp.bfloat16)) not in saved  # no bfloat16 activation
    assert ((K, M), jnp.dtype(LOW[scaling])) in saved  # its [K, M] quantised copy
    activation = [(s, d) for s, d in saved if s != (K, N)]  # all but the weight (a param)
    kept = sum(_bytes(s, d) for s, d in activation)
    assert kept < 0.6 * _bytes((M, K), jnp.bfloat16), activation


@pytest.mark.parametrize("scaling", sorted(LOW))
def test_under_autocast_with_fp8_saved_activations_no_bf16_gemm_input_is_kept(scaling):
    policy = mpjax.get_policy("p=f32,c=bf16,o=f32").with_saved_activations("float8_e4m3fn")
    recipe = mpjax.Fp8Recipe(scaling, min_dim=64)
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.float32)
    w1 = jax.random.normal(jax.random.key(1), (K, N), jnp.float32) / 20
    w2 = jax.random.normal(jax.random.key(2), (N, K), jnp.float32) / 20

    def mlp(x, w1, w2):  # two GEMMs, nothing between them that keeps a residual itself
        return jnp.sum((x @ w1) @ w2)

    fn = mpjax.autocast(mlp, policy, fp8=recipe)
    saved = _residuals(fn, x, w1, w2)
    gemm_inputs = {((M, K), jnp.dtype(jnp.bfloat16)), ((M, N), jnp.dtype(jnp.bfloat16))}
    assert not gemm_inputs & set(saved), saved
    assert ((K, M), jnp.dtype(LOW[scaling])) in saved and ((N, M), jnp.dtype(LOW[scaling])) in saved


@pytest.mark.parametrize("scaling", sorted(LOW))
def test_scanned_layers_stack_the_quantised_copies(scaling):
    """Over `lax.scan` (a scanned LM's layers) the residuals are stacked across the loop, where
    XLA cannot move the backward's quantisation into the forward: the stack is the low-precision
    copies, not the bfloat16 activations."""
    layers, recipe = 4, mpjax.Fp8Recipe(scaling)

    def loss(ws, x):
        def body(h, w):
            return block_scaled_dot_general(h, w, DIMS, recipe, jnp.bfloat16), None

        return jnp.sum(jax.lax.scan(body, x, ws)[0].astype(jnp.float32))

    ws = jax.random.normal(jax.random.key(0), (layers, K, K), jnp.bfloat16) / 20
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
    saved = _residuals(loss, ws, x)
    assert ((layers, M, K), jnp.dtype(jnp.bfloat16)) not in saved, saved
    assert ((layers, K, M), jnp.dtype(LOW[scaling])) in saved, saved
