"""Shared test helpers: fp8_nnx."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mpjax
from mpjax.fp8 import Fp8Meta, update_nnx_fp8_meta
from tests.helpers.fp8 import BF16, _nan_grad

DIFF = nnx.DiffState(0, (nnx.Param, Fp8Meta))  # differentiate params and the fp8 state


class MLP(nnx.Module):
    def __init__(self, rngs, nan_at=None):
        self.l0 = nnx.Linear(64, 128, rngs=rngs)
        self.l1 = nnx.Linear(128, 128, rngs=rngs)
        self.head = nnx.Linear(128, 64, rngs=rngs)
        self.nan_at = nan_at  # static: where the backward pass puts a NaN (None: nowhere)

    def __call__(self, x):
        h = _nan_grad(self.nan_at)(nnx.gelu(self.l0(x)))
        return self.head(nnx.gelu(self.l1(h)))


def make(recipe, policy=BF16, seed=0, **kw):
    return mpjax.apply_policy(MLP(nnx.Rngs(seed)), policy, fp8=recipe, **kw)


def mse(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def pure(model, filt=Fp8Meta):
    """Copies of the values of `model`'s variables matching `filt`, as numpy."""
    return jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, filt)))


def same_bits(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def make_step(recipe):
    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(mse, argnums=DIFF)(model, x)
        optimizer.update(model, grads)  # takes the nnx.Param entries only
        update_nnx_fp8_meta(model, grads, recipe)

    return step
