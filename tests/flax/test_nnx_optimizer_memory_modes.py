"""`master_weights="remainder"` and int8 `low_precision_state` inside `nnx.Optimizer`.

`nnx.Optimizer` writes the new optimizer state back through `nnx.state(...)`, which turns the
`Remainder` masters and `Blockwise8` moments (pytree nodes inside its Variables) into
`nnx.State`s: the second update used to fail ("restored into a target of another
master_weights mode", or an AttributeError). Now each update reads them back as the nodes,
and training matches the optax path on the same params bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpjax

STEPS = 3


class _Model(nnx.Module):
    """A bfloat16 matrix (a remainder master) and a float32 bias (no master)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.w = nnx.Param(jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16))
        self.b = nnx.Param(jnp.asarray(rng.normal(size=(3,)), jnp.float32))

    def __call__(self, x):
        return x @ self.w[...].astype(jnp.float32) + self.b[...]


def _loss(w, b, x, opt_state):
    y = x @ w.astype(jnp.float32) + b
    return mpjax.scale_loss(jnp.mean((y - 1.0) ** 2), opt_state)


def _tx(case):
    """ "remainder": remainder masters, float32 Adam; "int8": float32 masters, int8 Adam."""
    if case == "int8":
        return mpjax.loss_scaled(mpjax.low_precision_state(optax.adam(1e-2), jnp.int8))
    return mpjax.loss_scaled(optax.adam(1e-2), master_weights="remainder")


def _x(i):
    return jnp.asarray(np.random.default_rng(10 + i).normal(size=(5, 4)), jnp.float32)


@nnx.jit
def _nnx_step(model, opt, x):
    grads = nnx.grad(lambda m: _loss(m.w[...], m.b[...], x, opt.opt_state))(model)
    opt.update(model, grads)


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(case, params, opt_state, x):
    grads = jax.grad(lambda p: _loss(p["w"], p["b"], x, opt_state))(params)
    updates, opt_state = _tx(case).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("case", ["remainder", "int8"])
def test_nnx_optimizer_trains_as_optax(case):
    model = _Model()
    opt = nnx.Optimizer(model, _tx(case), wrt=nnx.Param)
    params = {"b": model.b[...], "w": model.w[...]}
    opt_state = _tx(case).init(params)
    for i in range(STEPS):
        _nnx_step(model, opt, _x(i))
        params, opt_state = _optax_step(case, params, opt_state, _x(i))
    np.testing.assert_array_equal(model.w[...], params["w"])
    np.testing.assert_array_equal(model.b[...], params["b"])
    nnx_params = nnx.as_pure(nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(
        mpjax.master_params(opt.opt_state, nnx_params)["w"],
        mpjax.master_params(opt_state, params)["w"],
    )
    assert int(mpjax.find_loss_scaled_state(opt.opt_state).skipped_steps) == 0
