"""`autocast` with `Policy.saved_activations`: GEMM inputs kept in fp8 for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpjax
from mpjax.fp8 import saved_activations_policy
from tests.helpers.saved import (
    BF16,
    E4M3,
    PLAIN,
    SAVED,
    bf16_exact,
    residuals,
    weight_grad_bound,
)

M, K, D, H = 8, 16, 32, 64


def _mlp(x, w1, b1, w2, w3):
    h = jax.nn.gelu(x @ w1 + b1)  # GEMM input behind a GELU
    return jnp.sum((h @ w2) @ w3)  # GEMM input straight from a GEMM


def _args():
    rng = np.random.default_rng(0)
    shapes = [(M, K), (K, H), (H,), (H, D), (D, D)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) * 0.1 for s in shapes]


def test_gemm_inputs_saved_in_fp8_and_not_in_bf16_too():
    """Every activation input of a GEMM is an e4m3 residual, and no bf16 copy of it is kept:
    the [M, D] GEMM-to-GEMM value is saved only in fp8; of the [M, H] GELU hidden, only the
    GELU's input survives in bf16 (the GELU is recomputed from it), against five bf16
    [M, H] values without the option."""
    args = _args()
    plain = residuals(mpjax.autocast(_mlp, PLAIN), *args)
    saved = residuals(mpjax.autocast(_mlp, SAVED), *args)
    assert (BF16, (M, D)) in plain and plain.count((BF16, (M, H))) >= 2
    assert (E4M3, (M, D)) in saved and (E4M3, (M, H)) in saved
    assert (BF16, (M, D)) not in saved
    assert saved.count((BF16, (M, H))) == 1
    # the arguments (x, the weights) are not quantised
    assert (E4M3, (M, K)) not in saved and (E4M3, (H, D)) not in saved


def test_transposed_weight_is_not_quantised():
    """`h @ emb.T` (a tied head): the weight is an argument moved by a transpose, not an
    activation; only `h` is kept in fp8."""
    x, emb = jnp.ones((M, D)), jnp.ones((H, D))
    kept = residuals(mpjax.autocast(lambda x, e: jnp.sum((2 * x) @ e.T), SAVED), x, emb)
    assert (E4M3, (M, D)) in kept
    assert all(d != E4M3 for d, s in kept if s in ((H, D), (D, H)))


def test_under_checkpoint_and_scan():
    """A scanned stack of layers under `jax.checkpoint` with `saved_activations_policy`:
    the per-layer GEMM inputs are kept stacked, in e4m3, and not in bf16."""
    layers = 3
    ws = jnp.ones((layers, D, D)) * 0.01

    def body(h, w):
        return jnp.tanh(h @ w) + h, None

    def f(x, ws):
        step = jax.checkpoint(body, policy=saved_activations_policy())
        return jnp.sum(lax.scan(step, x, ws)[0])

    kept = residuals(mpjax.autocast(f, SAVED), jnp.ones((M, D)), ws)
    assert (E4M3, (layers, M, D)) in kept
    assert (BF16, (layers, M, D)) not in kept
    plain = residuals(mpjax.autocast(f, PLAIN), jnp.ones((M, D)), ws)
    assert all(d != E4M3 for d, _ in plain)


def test_weight_gradient_within_e4m3_bound():
    rng = np.random.default_rng(3)
    x, w, c = bf16_exact(rng, (M, D)), bf16_exact(rng, (D, H)), bf16_exact(rng, (M, H))
    f = mpjax.autocast(lambda x, w, c: jnp.sum(((2 * x) @ w) * c), SAVED)
    dw = np.asarray(jax.jit(jax.grad(f, 1))(x, w, c), np.float64)
    ref = (2 * x.astype(np.float64)).T @ c.astype(np.float64)
    assert np.all(np.abs(dw - ref) <= weight_grad_bound(2 * x, c))
    plain = jax.jit(jax.grad(mpjax.autocast(lambda x, w, c: jnp.sum(((2 * x) @ w) * c), PLAIN), 1))
    assert np.abs(dw - np.asarray(plain(x, w, c), np.float64)).max() > 0


def _e4m3_casts(fun, *args) -> int:
    """The float32/bf16 -> e4m3 conversions in the jaxpr of `fun`'s gradient."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: fun(*a), range(len(args))))(*args)
    return str(jaxpr).count("new_dtype=float8_e4m3fn")


def test_with_an_fp8_recipe_the_saved_input_is_the_fp8_gemms_own_operand():
    """Under `fp8=Fp8Recipe()` every GEMM input is already quantised for the GEMM: the option
    keeps that copy (one e4m3 residual per activation input, no bf16 copy) and adds no
    second quantisation of the same tensor (as many e4m3 casts as without the option)."""
    m, k, h, d = 32, 16, 64, 48  # fp8 GEMM sizes: multiples of 16, all different
    rng = np.random.default_rng(1)
    shapes = [(m, k), (k, h), (h,), (h, d), (d, d)]
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) * 0.1 for s in shapes]
    recipe = mpjax.Fp8Recipe(min_dim=16)
    plain = mpjax.autocast(_mlp, PLAIN, fp8=recipe)
    saved = mpjax.autocast(_mlp, SAVED, fp8=recipe)
    assert _e4m3_casts(saved, *args) == _e4m3_casts(plain, *args) == 6  # x, h, h @ w2, 3 w
    kept = residuals(saved, *args)
    for shape in ((m, k), (m, h), (m, d)):
        assert kept.count((E4M3, shape)) == 1, (shape, kept)
    assert (BF16, (m, k)) not in kept and (BF16, (m, d)) not in kept, kept
    assert kept.count((BF16, (m, h))) == 1  # only the GELU's input, for its own backward
