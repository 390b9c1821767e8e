"""Levanter/haliax-style Equinox training with `loss_scaled` and bfloat16 params.

Levanter's train step (like haliax's examples) filters the model with `eqx.is_array`, runs the
optax update and applies it with `eqx.apply_updates(model, updates)`, which is `p + u`.
`loss_scaled` returns float32 updates (a bf16 update cannot land exactly on the rounded float32
master, see tests/scaling/test_misuse.py), so `p + u` promotes the params to float32: at
6a474e7 training went on silently at twice the memory. Now the next update refuses the promoted
params, naming the spelling that keeps dtypes: `optax.apply_updates`, which trains bf16 params
that are exactly their float32 masters rounded.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.scaling.remainder import split_master


class Mlp(eqx.Module):
    w1: jax.Array
    w2: jax.Array
    depth: int  # a non-array field: eqx.filter makes it None in the params tree

    def __call__(self, x):
        h = jnp.tanh(x @ self.w1.astype(x.dtype))
        return h @ self.w2.astype(x.dtype)


def _setup():
    rng = np.random.default_rng(0)
    model = Mlp(
        w1=jnp.asarray(rng.normal(size=(4, 8)) * 0.5, jnp.bfloat16),
        w2=jnp.asarray(rng.normal(size=(8, 1)) * 0.5, jnp.bfloat16),
        depth=2,
    )
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.bfloat16)
    y = jnp.asarray(np.sin(rng.normal(size=(16, 1))), jnp.float32)
    tx = mpjax.loss_scaled(optax.adamw(3e-2))
    return model, tx, tx.init(eqx.filter(model, eqx.is_array)), x, y


def _loss(model, x, y):
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _make_step(tx, apply):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(lambda m: mpjax.scale_loss(_loss(m, x, y), opt_state))(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply(model, params, updates), opt_state

    return step


def test_eqx_apply_updates_promotion_is_refused_naming_the_fix():
    model, tx, opt_state, x, y = _setup()
    step = _make_step(tx, lambda model, params, updates: eqx.apply_updates(model, updates))
    model, opt_state = step(model, opt_state, x, y)
    assert model.w1.dtype == jnp.float32  # what `p + u` does to bf16 params
    with pytest.raises(ValueError, match=r"eqx.apply_updates.*optax.apply_updates\(params"):
        step(model, opt_state, x, y)


def test_optax_apply_updates_with_eqx_combine_trains_bf16_on_exact_masters():
    model, tx, opt_state, x, y = _setup()

    def apply(model, params, updates):
        return eqx.combine(optax.apply_updates(params, updates), model)

    step = _make_step(tx, apply)
    first = float(_loss(model, x, y))
    for _ in range(4):
        model, opt_state = step(model, opt_state, x, y)
    assert model.w1.dtype == model.w2.dtype == jnp.bfloat16 and model.depth == 2
    assert float(_loss(model, x, y)) < 0.9 * first
    master = mpjax.master_params(opt_state, eqx.filter(model, eqx.is_array))
    for p, m in ((model.w1, master.w1), (model.w2, master.w2)):
        assert m.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(split_master(m)[0]))
