"""Shared optimizer-test helpers: bitwise comparison, one update, a small quadratic run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Inner optimizers the low-precision (bf16, int8) state is checked with.
LP_INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(3e-2),
    "adafactor": lambda: optax.adafactor(1e-1, multiply_by_parameter_scale=False),
}


def bits(x) -> np.ndarray:
    """The bytes of `x` (a scalar as a 1-element array), for bitwise comparison."""
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def assert_bits_equal(a, b) -> None:
    """Asserts two pytrees have the same leaves, bit for bit."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


def apply_update(tx, params, state, grads):
    """One `tx.update` and `optax.apply_updates`: (new params, new state)."""
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def quadratic_run(tx, steps=60, params=None):
    """(final loss, state) of `steps` jitted steps of `tx` on a 16 x 8 quadratic."""
    target = jnp.asarray(np.random.default_rng(2).standard_normal((16, 8)), jnp.float32)
    params = {"w": jnp.zeros((16, 8))} if params is None else params
    loss = lambda p: jnp.mean((p["w"] - target) ** 2)  # noqa: E731

    @jax.jit
    def step(p, s):
        updates, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return float(loss(params)), state
