"""Tests for fp8 GEMMs: `fp8_dot_general` and `autocast(..., fp8=Fp8Recipe(...))`."""

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import fp8_dot_general
from tests.helpers.fp8 import TOL_E4M3, TOL_E5M2, f64_grads, gemm_operand_dtypes, rel_err, wide

E4, E5 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
DENSE = (((1,), (0,)), ((), ()))
POLICY = "params=float32,compute=bfloat16,output=float32"
# Stated tolerances (relative L2 error vs float64): e4m3 rounds to 2**-4 relative, e5m2 to
# 2**-3; a GEMM's output error is about the RMS of its operands' rounding.
TOL_BF16 = 0.01


# ----------------------------------------------------------------------------- fp8_dot_general


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("backward", [E5, E4])
def test_fp8_dense_gradients_vs_float64(scaling, backward):
    rng = np.random.default_rng(0)
    x, w = wide(rng, (64, 128)), rng.standard_normal((128, 96)).astype(np.float32)
    r = wide(rng, (64, 96))  # the output gradient, wide range
    rec = Fp8Recipe(scaling=scaling, backward_dtype=backward)

    def loss(a, b):
        return jnp.sum(fp8_dot_general(a, b, DENSE, rec, jnp.bfloat16).astype(jnp.float32) * r)

    val, (gx, gw) = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    ref_val, (rx, rw) = f64_grads(lambda a, b: jnp.sum((a @ b) * r), x, w)
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.float32  # master dtype kept
    out = fp8_dot_general(x, w, DENSE, rec, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, x.astype(np.float64) @ w) < TOL_E4M3
    tol = TOL_E5M2 if backward == E5 else TOL_E4M3
    assert rel_err(gx, rx) < tol and rel_err(gw, rw) < tol


def test_high_precision_grad_weight():
    rng = np.random.default_rng(1)
    x, w, r = (
        wide(rng, (64, 128)),
        rng.standard_normal((128, 96)).astype(np.float32),
        wide(rng, (64, 96)),
    )
    for hp in (False, True):
        rec = Fp8Recipe(high_precision_grad_weight=hp)
        fn = lambda a, b, rec=rec: jnp.sum(
            fp8_dot_general(a, b, DENSE, rec, jnp.bfloat16).astype(jnp.float32) * r
        )  # noqa: E731
        gw = jax.grad(fn, 1)(x, w)
        err = rel_err(gw, x.astype(np.float64).T @ r)
        assert (err < TOL_BF16) == hp, (hp, err)
        dtypes = gemm_operand_dtypes(jax.grad(fn, (0, 1)), x, w)
        assert len(dtypes) == 3
        assert dtypes[-1] == ((np.dtype(jnp.bfloat16),) * 2 if hp else (E4, E5))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gemm_forms_are_fp8_forward_and_backward(scaling):
    """Forward: e4m3 x e4m3; input gradient e5m2 x e4m3; weight gradient e4m3 x e5m2."""
    x, w = jnp.ones((32, 64)), jnp.ones((64, 48))
    rec = Fp8Recipe(scaling=scaling, min_dim=16)
    fn = lambda a, b: jnp.sum(fp8_dot_general(a, b, DENSE, rec, jnp.bfloat16))  # noqa: E731
    assert gemm_operand_dtypes(jax.grad(fn, (0, 1)), x, w) == [(E4, E4), (E5, E4), (E4, E5)]


def test_batched_and_permuted_dimension_numbers():
    rng = np.random.default_rng(2)
    a, b = wide(rng, (32, 3, 48)), rng.standard_normal((16, 48, 3)).astype(np.float32)
    dims = (((2, 1), (1, 2)), ((), ()))  # contract two axes, in a different order
    rec = Fp8Recipe(scaling="rowwise", min_dim=16)
    r = rng.standard_normal((32, 16)).astype(np.float32)
    fn = lambda x, y: jnp.sum(fp8_dot_general(x, y, dims, rec, jnp.float32) * r)  # noqa: E731
    gx, gy = jax.grad(fn, (0, 1))(a, b)
    _, (rx, ry) = f64_grads(lambda x, y: jnp.sum(jax.lax.dot_general(x, y, dims) * r), a, b)
    assert rel_err(gx, rx) < TOL_E5M2 and rel_err(gy, ry) < TOL_E5M2


# ----------------------------------------------------------------------------- autocast


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(128)(x))
        x = nn.gelu(nn.Dense(128)(x))
        return nn.Dense(10, name="head")(x)  # 10 outputs: not a multiple of 16


def mlp_setup(seed=0):
    rng = np.random.default_rng(seed)
    model = MLP()
    x = wide(rng, (64, 64), 2.0)
    params = model.init(jax.random.key(seed), x)
    y = jnp.asarray(rng.integers(0, 10, 64))
    return model, params, x, y


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_autocast_flax_fp8_gradients_vs_float64():
    model, params, x, y = mlp_setup()
    fwd = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe())
    dtypes = gemm_operand_dtypes(fwd, params, x)
    assert dtypes == [(E4, E4), (E4, E4), (np.dtype(jnp.bfloat16),) * 2]  # head: 10 outputs

    loss = jax.jit(jax.value_and_grad(lambda p: xent(fwd(p, x), y)))
    val, grads = loss(params)
    ref_val, ref = f64_grads(lambda p: xent(model.apply(p, x), y), params)
    assert jax.tree.all(jax.tree.map(lambda g: g.dtype == jnp.float32, grads))
    assert abs(float(val) - float(ref_val)) / abs(float(ref_val)) < 0.02
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert rel_err(g, r) < 2 * TOL_E5M2  # two fp8 layers back to back


def test_autocast_exclusion_by_path_and_predicate():
    model, params, x, _ = mlp_setup()
    bf16 = (np.dtype(jnp.bfloat16),) * 2
    by_path = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe(exclude=("*/Dense_0",)))
    assert gemm_operand_dtypes(by_path, params, x) == [bf16, (E4, E4), bf16]
    by_pred = Fp8Recipe(exclude_if=lambda site: site.name.endswith("Dense_1"))
    fwd = mpjax.autocast(model.apply, POLICY, fp8=by_pred)
    assert gemm_operand_dtypes(fwd, params, x) == [(E4, E4), bf16, bf16]
    small = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe(min_dim=256))
    assert gemm_operand_dtypes(small, params, x) == [bf16] * 3


def test_autocast_plain_jnp_under_jit_and_grad():
    rng = np.random.default_rng(4)
    w1, w2 = (
        rng.standard_normal((96, 128)).astype(np.float32) / 10,
        rng.standard_normal((128, 32)).astype(np.float32) / 10,
    )
    x = wide(rng, (256, 96), 2.0)

    def f(w1, w2, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

    g = jax.jit(
        jax.grad(mpjax.autocast(f, POLICY, fp8=Fp8Recipe(scaling="rowwise", min_dim=32)), (0, 1))
    )(w1, w2, x)
    _, ref = f64_grads(f, w1, w2, x)
    assert rel_err(g[0], ref[0]) < 2 * TOL_E5M2 and rel_err(g[1], ref[1]) < 2 * TOL_E5M2
    dt = gemm_operand_dtypes(
        jax.grad(mpjax.autocast(f, POLICY, fp8=Fp8Recipe(min_dim=32)), (0, 1)), w1, w2, x
    )
    assert Counter(dt) == Counter({(E4, E4): 2, (E5, E4): 2, (E4, E5): 2})


def test_autocast_rejects_delayed_and_non_recipe():
    with pytest.raises(ValueError, match="delayed"):
        mpjax.autocast(lambda x: x, POLICY, fp8=Fp8Recipe(scaling="delayed"))
    with pytest.raises(TypeError, match="Fp8Recipe"):
        mpjax.autocast(lambda x: x, POLICY, fp8="e4m3")


def _nan_grad(where):
    """Identity whose backward puts NaN into the activation gradient at `where`."""

    @jax.custom_vjp
    def ident(h):
        return h

    def bwd(_, g):
        return (g.reshape(-1).at[where].set(jnp.nan).reshape(g.shape),)

    ident.defvjp(lambda h: (h, None), bwd)
    return ident


class NanMLP(nn.Module):
    where: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(128)(x))
        h = _nan_grad(self.where)(h)
        return nn.Dense(64)(nn.gelu(nn.Dense(128)(h)))


@pytest.mark.parametrize("where", [0, 64 * 128 // 2, 64 * 128 - 1])
def test_nan_activation_gradient_makes_loss_scaled_skip(where):
    rng = np.random.default_rng(5)
    x = wide(rng, (64, 64), 2.0)
    model = NanMLP(where)
    params = model.init(jax.random.key(0), x)
    fwd = mpjax.autocast(model.apply, POLICY, fp8=Fp8Recipe())
    assert all(d == (E4, E4) for d in gemm_operand_dtypes(fwd, params, x))
    tx = mpjax.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: mpjax.scale_loss(jnp.mean(fwd(p, x) ** 2), state))(params)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    new_params, new_state, grads = step(params, state)
    # the NaN reached the first layer's weight gradient through the fp8 backward GEMMs
    assert np.isnan(np.asarray(grads["params"]["Dense_0"]["kernel"])).any()
    assert not bool(new_state.grads_finite) and int(new_state.skipped_steps) == 1
    for a, b in zip(
        jax.tree.leaves((params, state.inner_state)),
        jax.tree.leaves((new_params, new_state.inner_state)),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
