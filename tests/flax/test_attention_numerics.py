"""NNX attention under the bf16 policy against float64: outputs and gradients, with masks.

`float32_softmax_attention` (mpjax/policy/nnx.py) computes the logits and the weighted sum as
bfloat16 GEMMs around a float32 softmax; here its results stay within bfloat16 tolerance of the
same model run in float64 by Flax, with a padding mask that masks one batch row entirely.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax._src.flax.nnx import float32_softmax_attention
from tests.helpers.policy import TOL, rel_error

B, T, D, HEADS = 3, 7, 32, 4
LENGTHS = np.array([T, 4, 0])  # the last batch row: every key masked
POLICY = "params=float32,compute=bfloat16,output=float32"


class Model(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)

    def __call__(self, x, mask):
        return self.attn(x, mask=mask)


def padding_mask():
    keep = np.arange(T)[None, :] < LENGTHS[:, None]
    return jnp.asarray(np.broadcast_to(keep[:, None, None, :], (B, 1, T, T)))


def inputs(seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    scale = 10.0 ** jax.random.uniform(k2, (B, T, 1), minval=-1.5, maxval=0.5)
    x = jax.random.normal(k1, (B, T, D)) * scale  # rows over two decades of magnitude
    return x, jax.random.normal(k3, (B, T, D))


def loss(model, x, mask, cotangent):
    return jnp.sum(model(x, mask).astype(cotangent.dtype) * cotangent)


def float64_reference(model, x, mask, cotangent):
    graphdef, state = nnx.split(model)
    state64 = jax.tree.map(lambda a: np.asarray(a, np.float64), state)
    x64, ct64 = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)
    with jax.enable_x64(True):
        model64 = nnx.merge(graphdef, state64)
        out = model64(x64, mask)
        grads = nnx.grad(loss, argnums=(0, 1))(model64, x64, mask, ct64)
    return np.asarray(out), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_policy_attention_matches_float64_with_padding_mask(seed):
    x, ct = inputs(seed)
    mask = padding_mask()
    plain = Model(nnx.Rngs(seed))
    ref_out, (ref_model_grads, ref_x_grad) = float64_reference(plain, x, mask, ct)
    model = mpjax.apply_policy(plain, POLICY)
    out = jax.jit(lambda m, x: m(x, mask))(model, x)
    grads = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, x, mask, ct)
    model_grads, x_grad = grads
    assert out.dtype == jnp.float32
    assert rel_error(out, ref_out) < TOL["bfloat16"]
    # the fully masked row attends uniformly, as Flax's attention does
    assert rel_error(out[2], ref_out[2]) < TOL["bfloat16"]
    assert rel_error(x_grad, ref_x_grad) < TOL["bfloat16"]
    ours = nnx.to_flat_state(nnx.state(model_grads, nnx.Param))
    ref = dict(nnx.to_flat_state(nnx.state(ref_model_grads, nnx.Param)))
    assert len(ours) == len(ref) == 8  # q, k, v, out kernels and biases
    for path, g in ours:
        assert g.dtype == jnp.float32
        if path == ("attn", "key", "bias"):
            # exactly zero: it shifts a query's logits by one constant; bf16 rounding noise
            # stays small against the query bias gradient's scale
            scale = np.linalg.norm(ref[("attn", "query", "bias")].get_value())
            assert np.linalg.norm(g.get_value()) < TOL["bfloat16"] * scale
        else:
            assert rel_error(g.get_value(), ref[path].get_value()) < TOL["bfloat16"], path


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_with_bias_and_mask_matches_float64(causal):
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (B, T, HEADS, 8)) * 3
    k, v = (jax.random.normal(ks[i], (B, T, 2, 8)) for i in (1, 2))
    bias = jax.random.normal(ks[3], (B, HEADS, T, T))
    mask = padding_mask()
    ct = jax.random.normal(ks[4], (B, T, HEADS, 8))
    kwargs = dict(bias=bias, mask=mask, is_causal=causal)

    def f(q, k, v, attention, ct):
        return jnp.sum(attention(q, k, v, **kwargs).astype(ct.dtype) * ct)

    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    out = float32_softmax_attention(*bf, **kwargs)
    grads = jax.grad(f, argnums=(0, 1, 2))(*bf, float32_softmax_attention, ct)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    with jax.enable_x64(True):
        args64 = [np.asarray(a, np.float64) for a in bf]
        kwargs["bias"] = np.asarray(bias, np.float64)
        ref = nnx.dot_product_attention(*args64, **kwargs)
        ref_grads = jax.grad(f, argnums=(0, 1, 2))(
            *args64, nnx.dot_product_attention, np.asarray(ct, np.float64)
        )
    assert rel_error(out, ref) < TOL["bfloat16"]
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_error(g, r) < TOL["bfloat16"]


def test_mismatched_heads_raise_naming_them():
    q = jnp.zeros((1, 4, 3, 8), jnp.bfloat16)
    kv = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"query heads \(3\).*key/value heads \(2\)"):
        float32_softmax_attention(q, kv, kv)


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_inputs_propagate_like_float32(bad):
    x, _ = inputs(4)
    x = x.at[0, 0, 0].set(bad).at[1, 3, 16].set(bad).at[2, -1, -1].set(bad)  # first, mid, last
    mask = padding_mask()
    plain = Model(nnx.Rngs(0))
    ref = plain(x, mask)
    out = mpjax.apply_policy(plain, POLICY)(x, mask)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    assert not np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mpjax_attention_fn_takes_grouped_query_heads_off_cuda(dtype, with_bias):
    # Before: off CUDA (Flax's linen attention as the fallback) it raised Flax's
    # "AssertionError: q, k num_heads must match" for the documented kv_heads | heads.
    ks = jax.random.split(jax.random.key(5), 5)
    q = jax.random.normal(ks[0], (B, T, HEADS, 8)).astype(dtype)
    k, v = (jax.random.normal(ks[i], (B, T, 2, 8)).astype(dtype) for i in (1, 2))
    bias = jax.random.normal(ks[3], (B, HEADS, T, T)).astype(dtype) if with_bias else None
    ct = jax.random.normal(ks[4], (B, T, HEADS, 8))
    mask = padding_mask()

    def f(q, k, v, attention):
        out = attention(q, k, v, bias=bias, mask=mask)
        return jnp.sum(out.astype(ct.dtype) * ct), out

    grads, out = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, mpjax.nn.dot_product_attention
    )
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    with jax.enable_x64(True):
        args64 = [np.asarray(a, np.float64) for a in (q, k, v)]
        bias = None if bias is None else np.asarray(bias, np.float64)
        ct = np.asarray(ct, np.float64)
        ref_grads, ref = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(
            *args64, nnx.dot_product_attention
        )
    tol = TOL[np.dtype(dtype).name]
    assert rel_error(out, ref) < tol
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_error(g, r) < tol


def test_sown_weights_under_nnx_capture_without_deprecation_warnings():
    """`sow_weights=True` with mpjax's attention records the float32-softmax weights through
    `nnx.capture`, with no DeprecationWarning (flax >= 0.12.8 deprecates `Module.sow` only
    outside `nnx.capture`, for flax's own attention the same)."""
    m = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=8,
        qkv_features=8,
        decode=False,
        rngs=nnx.Rngs(0),
        attention_fn=float32_softmax_attention,
    )
    x = jax.random.normal(jax.random.key(1), (1, 3, 8), jnp.bfloat16)

    @nnx.capture(nnx.Intermediate)
    def forward(m, x):
        return m(x, sow_weights=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out, captured = forward(m, x)
    (weights,) = nnx.to_pure_dict(captured)["attention_weights"]
    q = m.query(x).astype(jnp.float32)
    k = m.key(x).astype(jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(4.0)
    assert weights.dtype == jnp.float32 and weights.shape == (1, 2, 3, 3)  # the float32 softmax
    np.testing.assert_allclose(weights, jax.nn.softmax(logits), rtol=1e-5, atol=1e-6)
    assert out.shape == x.shape
