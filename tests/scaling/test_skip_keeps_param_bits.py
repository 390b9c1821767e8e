"""A skipped step leaves every param bit-identical, negative zeros included.

Found while testing data-parallel skips: `loss_scaled` returns +0.0 updates on a skipped
step, and ``optax.apply_updates`` computes ``-0.0 + 0.0 = +0.0``, so a param that is exactly
-0.0 (e.g. a master value below fp16's smallest subnormal, rounded) comes back as +0.0.
Equal in value, but not the "params bit-identical to their pre-step values" a skip
promises. An update of -0.0 is the exact identity of IEEE addition (``p + -0.0 == p`` for
every p, signed zeros included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_skipped_step_keeps_negative_zero_params(dtype, use_jit):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(9).astype(np.float32)
    values[[0, 4, 8]] = -0.0  # first, middle, last
    params = {"w": jnp.asarray(values, dtype)}
    grads = {"w": jnp.asarray(rng.standard_normal(9), dtype).at[4].set(jnp.inf)}
    tx = mpjax.loss_scaled(optax.sgd(0.1))

    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if use_jit else step
    new_params, state = step(params, tx.init(params))
    assert not bool(state.grads_finite)
    before, after = np.asarray(params["w"]), np.asarray(new_params["w"])
    assert after.tobytes() == before.tobytes(), (
        f"sign bits before {np.signbit(before).astype(int)}, after {np.signbit(after).astype(int)}"
    )
