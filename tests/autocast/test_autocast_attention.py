"""`jax.nn.dot_product_attention` under `mpjax.autocast`: the hand-written compute-dtype call.

On CPU (the XLA implementation); the cuDNN kernel under autocast is checked on the deviceless
H100 compile in tests/flax/test_attention_gpu.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from tests.helpers.numerics import tree_rel_err

B, T, N, H = 2, 16, 2, 8


def attention(q, k, v, bias, mask):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)


def reference64(q, k, v, bias, mask):
    """softmax(q k^T / sqrt(H) + bias, masked, causal) v in float64, from the definition."""
    q, k, v, bias = (np.asarray(x, np.float64) for x in (q, k, v, bias))
    logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H) + bias
    keep = np.asarray(mask) & np.tril(np.ones((T, T), bool))
    logits = np.where(keep, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", weights, v)


@pytest.fixture(scope="module")
def inputs():
    kq, kk, kv, kb = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in (kq, kk, kv))
    bias = 0.5 * jax.random.normal(kb, (1, N, T, T))
    mask = (jnp.arange(T)[None, :] < jnp.array([T, T // 2])[:, None])[:, None, None, :]
    return q, k, v, bias, mask


def hand_written(q, k, v, bias, mask):
    return attention(*(x.astype(jnp.bfloat16) for x in (q, k, v, bias)), mask)


def test_autocast_attention_is_the_hand_written_compute_dtype_attention(inputs):
    ours = jax.jit(mpjax.autocast(attention, "params=float32,compute=bfloat16,output=float32"))(
        *inputs
    )
    # Bit for bit (before: the logits GEMM rounded to bfloat16, up to 2^-7 apart).
    np.testing.assert_array_equal(ours, jax.jit(hand_written)(*inputs).astype(jnp.float32))
    assert tree_rel_err(ours, reference64(*inputs)) < 2e-2


def test_autocast_attention_gradients_are_the_hand_written_ones(inputs):
    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, *inputs[3:]).astype(jnp.float32) ** 2)

    ours = jax.jit(jax.grad(loss(mpjax.autocast(attention)), argnums=(0, 1, 2)))(*inputs[:3])
    hand = jax.jit(jax.grad(loss(hand_written), argnums=(0, 1, 2)))(*inputs[:3])
    for a, b in zip(ours, hand, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)


def test_attention_outside_autocast_and_in_a_float32_autocast_is_untouched(inputs):
    plain = jax.jit(attention)(*inputs)
    assert plain.dtype == jnp.float32
    f32 = jax.jit(mpjax.autocast(attention, "params=float32,compute=float32,output=float32"))(
        *inputs
    )
    np.testing.assert_array_equal(f32, plain)


def test_a_function_jitted_inside_autocast_is_traced_again_outside_it(inputs):
    # Before: jax.jit's cache handed back the bfloat16 trace (result bfloat16, rounded).
    jitted = jax.jit(attention)
    mpjax.autocast(lambda *a: jitted(*a))(*inputs)
    after = jitted(*inputs)
    assert after.dtype == jnp.float32
    np.testing.assert_array_equal(after, jax.jit(lambda *a: attention(*a))(*inputs))
