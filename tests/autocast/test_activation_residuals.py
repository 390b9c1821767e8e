"""gelu / SwiGLU MLPs under autocast and apply_policy keep one activation for the backward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax

HIDDEN = (8, 64)
DTYPES = {"float32": "f32", "bfloat16": "p=f32,c=bf16,o=f32", "float16": "p=f32,c=f16,o=f32"}
TOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}


def gelu_mlp(x, w1, b1, w2):
    return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2


def swiglu_mlp(x, w1, w3, w2):
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def _args(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (8, 16), dtype)
    w1 = jax.random.normal(k[1], (16, 64), dtype) / 4
    w2 = jax.random.normal(k[2], (64, 16), dtype) / 8
    w3 = jax.random.normal(k[3], (16, 64), dtype) / 4
    return {
        "gelu": (gelu_mlp, (x, w1, jnp.full((64,), 0.1, dtype), w2)),
        "swiglu": (swiglu_mlp, (x, w1, w3, w2)),
    }


def _hidden(fun, *args):
    """The residuals of `jax.vjp(fun, *args)` of the MLP's hidden size (kept activations)."""
    _, vjp = jax.vjp(fun, *args)
    return [r for r in jax.tree.leaves(vjp) if np.shape(r) == HIDDEN]


# The hidden-sized residuals each MLP must keep: gelu's input; SwiGLU's two GEMM outputs.
KEPT = {"gelu": 1, "swiglu": 2}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_autocast_mlp_keeps_only_the_activation_inputs(mlp, dtype):
    fun, args = _args()[mlp]
    f = mpjax.autocast(fun, DTYPES[dtype])
    kept = _hidden(f, *args)
    assert len(kept) == KEPT[mlp], [r.dtype for r in kept]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_autocast_gelu_linearize_keeps_one_hidden_tensor(dtype):
    fun, (x, *ws) = _args()["gelu"]
    f = mpjax.autocast(fun, DTYPES[dtype])
    _, lin = jax.linearize(lambda x: f(x, *ws), x)
    consts = [c for c in jax.tree.leaves(lin) if hasattr(c, "shape")]
    assert [tuple(c.shape) for c in consts].count(HIDDEN) == 1


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_autocast_mlp_gradients_match_float64(mlp, dtype, jit):
    fun, args = _args()[mlp]
    grad = jax.grad(lambda *a: mpjax.autocast(fun, DTYPES[dtype])(*a).sum(), range(len(args)))
    grads = (jax.jit(grad) if jit else grad)(*args)
    with jax.enable_x64():
        args64 = [np.asarray(a, np.float64) for a in args]
        ref = jax.grad(lambda *a: fun(*a).sum(), range(len(args)))(*map(jnp.asarray, args64))
        ref = [np.asarray(r) for r in ref]
    for g, r in zip(grads, ref, strict=True):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < TOL[dtype], (mlp, dtype, err)


class _GeluMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))


class _SwiGLU(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.silu(nn.Dense(64)(x)) * nn.Dense(64)(x))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_apply_policy_mlp_keeps_only_the_activation_inputs(mlp, dtype):
    model = mpjax.apply_policy({"gelu": _GeluMLP, "swiglu": _SwiGLU}[mlp](), DTYPES[dtype])
    x = jax.random.normal(jax.random.key(1), (8, 16))
    v = model.init(jax.random.key(0), x)
    kept = _hidden(lambda v: model.apply(v, x), v)
    assert len(kept) == KEPT[mlp], [r.dtype for r in kept]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_apply_policy_gelu_values_and_gradients_are_unchanged(dtype, jit):
    """The rewritten apply gives the values and gradients of the module run directly."""
    model = mpjax.apply_policy(_GeluMLP(), DTYPES[dtype])
    x = jax.random.normal(jax.random.key(1), (8, 16))
    v = model.init(jax.random.key(0), x)

    def loss(v, direct):
        call = nn.Module.apply if direct else type(model).apply
        return call(model, v, x, method=model._outer_method(None) if direct else None).sum()

    grad = jax.value_and_grad(loss)
    run = jax.jit(grad, static_argnums=1) if jit else grad
    (new, g_new), (old, g_old) = run(v, False), run(v, True)
    np.testing.assert_array_equal(new, old)
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


def test_apply_policy_eager_call_runs_as_written():
    """Concrete arrays: no trace, so Python control flow on values works as in Flax."""

    class Branchy(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(64)(x))
            return nn.Dense(16)(h) if float(h.sum()) > -1e9 else h

    model = mpjax.apply_policy(Branchy(), "p=f32,c=bf16,o=f32")
    x = jnp.ones((8, 16))
    v = model.init(jax.random.key(0), x)
    assert model.apply(v, x).shape == (8, 16)
