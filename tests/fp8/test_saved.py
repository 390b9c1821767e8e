"""Tests for fp8 saved activations (`mpjax.fp8.saved_in_fp8`, `Policy.saved_activations`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax.fp8 import fp8_saved_dot_general, saved_activations_policy
from tests.helpers.saved import BF16, E4M3, bf16_exact, residuals, weight_grad_bound

DIMS = (((1,), (0,)), ((), ()))


def _dot(x, w):
    return fp8_saved_dot_general(x, w, DIMS, saved_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize("compute", [jnp.float32, jnp.bfloat16])
def test_weight_gradient_within_e4m3_bound(compute):
    """dW = x_hat^T g with x kept in e4m3 (rowwise scale) is within the derived bound of
    the float64 x^T g, rows of very different magnitudes and tiny values included."""
    rng = np.random.default_rng(0)
    x = bf16_exact(rng, (32, 64)) * np.exp2(rng.integers(-8, 8, (32, 1))).astype(np.float32)
    x[0, :8] *= 2.0**-12  # subnormal after scaling
    w, c = bf16_exact(rng, (64, 16)), bf16_exact(rng, (32, 16))
    xs, ws, cs = (jnp.asarray(a, compute) for a in (x, w, c))

    def loss(w):
        return jnp.sum(_dot(xs, w).astype(jnp.float32) * cs.astype(jnp.float32))

    dw = np.asarray(jax.jit(jax.grad(loss))(ws), np.float64)
    ref = x.astype(np.float64).T @ c.astype(np.float64)
    bound = weight_grad_bound(x, c, bf16=compute == jnp.bfloat16)
    assert np.all(np.abs(dw - ref) <= bound)
    # and the activation really went through e4m3: not the plain GEMM's gradient
    plain = jax.jit(
        jax.grad(lambda w: jnp.sum((xs @ w).astype(jnp.float32) * cs.astype(jnp.float32)))
    )
    assert np.abs(dw - np.asarray(plain(ws), np.float64)).max() > 0


def test_input_gradient_is_exact_and_weight_kept():
    """The input gradient g w^T does not touch the fp8 copy; the weight is kept as is."""
    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((8, 32), (32, 16)))
    f = lambda x, w: _dot(x, w).astype(jnp.float32).sum()  # noqa: E731
    g = lambda x, w: (x @ w).astype(jnp.float32).sum()  # noqa: E731
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(x, w), jax.jit(jax.grad(g))(x, w))
    assert residuals(f, x, w) == [(BF16, (32, 16)), (E4M3, (8, 32)), (np.dtype("float32"), (8, 1))]


def test_remat_policy_saves_the_fp8_residuals_only():
    """Under jax.checkpoint with `saved_activations_policy`, the block keeps its fp8 GEMM
    inputs (and its arguments); the default policy keeps none of them (all recomputed)."""
    x = jnp.ones((8, 32), jnp.bfloat16)
    w1, w2 = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 16), jnp.bfloat16)

    def block(x, w1, w2):
        return _dot(jnp.tanh(_dot(x, w1)), w2).astype(jnp.float32).sum()

    kept = residuals(jax.checkpoint(block, policy=saved_activations_policy()), x, w1, w2)
    assert (E4M3, (8, 64)) in kept and (E4M3, (8, 32)) in kept
    assert (BF16, (8, 64)) not in kept
    default = residuals(jax.checkpoint(block), x, w1, w2)
    assert all(d != E4M3 for d, _ in default)
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    both = residuals(jax.checkpoint(block, policy=saved_activations_policy(dots)), x, w1, w2)
    assert (E4M3, (8, 64)) in both and (BF16, (8, 64)) in both  # + the GEMM output


def test_policy_field_and_spec():
    p = mpjax.get_policy("p=f32,c=bf16,o=f32,saved=e4m3")
    assert p.saved_activations == E4M3
    assert mpjax.get_policy(str(p)) == p
    assert mpjax.Policy().saved_activations is None
    assert p.with_saved_activations(None) == mpjax.get_policy("p=f32,c=bf16,o=f32")
    with pytest.raises(ValueError, match="saved_activations.*bfloat16.*float8_e4m3fn"):
        mpjax.Policy(saved_activations="bfloat16")
    with pytest.raises(ValueError, match="saved_activations"):
        mpjax.get_policy("c=bf16,saved=int8")


@pytest.mark.parametrize(
    "base, culprit",
    [
        ("x", "base='x' (str) is not a checkpoint policy"),
        ("dots_saveable", "did you mean base=jax.checkpoint_policies.dots_saveable"),
        (3, "base=3 (int) is not a checkpoint policy"),
        # uncalled, it would be called as the policy and return a (truthy) function
        (jax.checkpoint_policies.save_only_these_names, "save_only_these_names is a factory"),
    ],
)
def test_bad_base_raises_at_the_call_naming_base(base, culprit):
    """Issue 34 (11): `base="x"` was accepted and failed later inside `jax.checkpoint`
    with "'str' object is not callable"; it is refused when the policy is made."""
    with pytest.raises(TypeError, match="saved_activations_policy: ") as e:
        saved_activations_policy(base)
    assert culprit in str(e.value)
    assert "base takes None or a checkpoint policy function" in str(e.value)


def test_callable_base_still_accepted():
    policy = saved_activations_policy(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    f = jax.checkpoint(lambda x, w: jnp.sin(x @ w), policy=policy)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    g = jax.grad(lambda w: f(x, w).sum())(w)
    np.testing.assert_allclose(g, np.full((3, 4), 2 * np.cos(3.0)), rtol=1e-6)
