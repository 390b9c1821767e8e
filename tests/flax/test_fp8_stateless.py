"""`apply_policy(model, policy, fp8=recipe)` with stateless recipes (current and block scaling)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import Fp8Meta

BF16 = "params=bfloat16,compute=bfloat16,output=float32"
RECIPES = [
    Fp8Recipe("mxfp8", min_dim=32),
    Fp8Recipe("blockwise", min_dim=32),
    Fp8Recipe("tensorwise", min_dim=32),
]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64)(x))
        return nn.Dense(32, name="head")(h)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


def _x():
    return (jax.random.normal(jax.random.key(1), (32, 64)) * 3.0).astype(jnp.bfloat16)


def _fp8_converts(fn, *args) -> int:
    """How many converts to float8_e4m3fn the traced (forward and backward) program has."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count("new_dtype=float8_e4m3fn")


@pytest.mark.parametrize("recipe", RECIPES[::2], ids=lambda r: r.scaling)
def test_linen_equals_autocast_forward_and_gradients(recipe):
    x = _x()
    params = jax.jit(Mlp().init)(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    wrapped = mpjax.apply_policy(Mlp(), BF16, fp8=recipe)
    cast = mpjax.autocast(Mlp().apply, BF16, fp8=recipe)

    def loss(apply, p):
        return jnp.sum(apply({"params": p}, x).astype(jnp.float32) ** 2)

    got = jax.jit(jax.value_and_grad(lambda p: loss(wrapped.apply, p)))(params)
    want = jax.jit(jax.value_and_grad(lambda p: loss(cast, p)))(params)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    plain = jax.jit(lambda p: loss(mpjax.apply_policy(Mlp(), BF16).apply, p))(params)
    assert float(got[0]) != float(plain)  # the fp8 numbers, not the compute dtype's
    # no state: the variables are the params only
    assert set(wrapped.init(jax.random.key(0), x)) == {"params"}


def test_linen_block_quantisation_in_the_program_respects_exclude():
    x = _x()
    recipe = Fp8Recipe("mxfp8", min_dim=32)
    params = Mlp().init(jax.random.key(0), x)["params"]

    def grad_fn(model):
        return jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x)))

    both = _fp8_converts(grad_fn(mpjax.apply_policy(Mlp(), BF16, fp8=recipe)), params)
    text = str(jax.make_jaxpr(grad_fn(mpjax.apply_policy(Mlp(), BF16, fp8=recipe)))(params))
    assert "float8_e8m0fnu" in text  # the E8M0 block scales
    no_head = Fp8Recipe("mxfp8", min_dim=32, exclude="*/head")
    one = _fp8_converts(grad_fn(mpjax.apply_policy(Mlp(), BF16, fp8=no_head)), params)
    small = _fp8_converts(
        grad_fn(mpjax.apply_policy(Mlp(), BF16, fp8=Fp8Recipe("mxfp8", min_dim=128))), params
    )
    assert both == 2 * one > 0 and small == 0
    # choose="roofline": these 32x64x64 GEMMs are memory bound on a B200, so they stay in bf16
    chooser = Fp8Recipe("mxfp8", min_dim=32, choose="roofline", target="b200")
    assert _fp8_converts(grad_fn(mpjax.apply_policy(Mlp(), BF16, fp8=chooser)), params) == 0
    assert _fp8_converts(grad_fn(mpjax.apply_policy(Mlp(), BF16)), params) == 0


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: r.scaling)
def test_nnx_equals_autocast_forward_and_gradients(recipe):
    x = _x()
    model = NnxMlp(nnx.Rngs(0))
    ref = NnxMlp(nnx.Rngs(0))
    mpjax.apply_policy(model, BF16, fp8=recipe)
    mpjax.apply_policy(ref, BF16)  # the same params in bf16, no fp8
    assert not jax.tree.leaves(nnx.state(model, Fp8Meta))  # stateless: no Fp8Meta
    graph, params = nnx.split(ref)

    def ref_loss(p):
        return jnp.sum(nnx.merge(graph, p)(x).astype(jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(mpjax.autocast(ref_loss, BF16, fp8=recipe)))(params)
    got = nnx.jit(nnx.value_and_grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2)))(model)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    plain = jax.jit(ref_loss)(params)
    assert float(got[0]) != float(plain)


def test_nnx_program_has_block_quantisation_and_exclusions():
    x = _x()

    def converts(recipe):
        model = mpjax.apply_policy(NnxMlp(nnx.Rngs(0)), BF16, fp8=recipe)
        graph, params = nnx.split(model)
        fn = jax.grad(lambda p: jnp.sum(nnx.merge(graph, p)(x)))
        return _fp8_converts(fn, params)

    both = converts(Fp8Recipe("mxfp8", min_dim=32))
    one = converts(Fp8Recipe("mxfp8", min_dim=32, exclude_if=lambda s: s.name.endswith("head")))
    assert both == 2 * one > 0
    assert converts(Fp8Recipe("mxfp8", min_dim=128)) == 0
