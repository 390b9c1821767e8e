"""`loss_scaled` on sharded params (Explicit and Auto mesh axes, `shard_map(check_vma=True)`).

Three steps on 8 simulated CPU devices: finite gradients, an inf in one shard (skipped), finite
again; the params, float32 masters and loss scale equal the unsharded run's (up to the last
float32 bit: the sharded program is compiled apart), for every skip implementation, master
mode, narrow optimizer state and the Pallas finite check (interpret mode). Explicit axes make
a sharding part of a value's type: the skip path must build updates typed like the params
(`lax.cond`'s branches, `select`'s cases must agree).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import mpjax
from tests.helpers.sharding import (
    AXIS,
    SHARD_MAP_SPECS,
    SPECS,
    assert_trees_close,
    mlp_params,
    on_mesh,
)

SCALE = mpjax.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
# master mode -> param dtype
PARAM_DTYPES = {"auto": jnp.bfloat16, "remainder": jnp.bfloat16, False: jnp.float32}


def _grads(params, step: int):
    """Scaled gradients of step `step`; step 1 has an inf in one device's shard of w1."""
    rng = np.random.default_rng(10 + step)
    grads = {
        k: jnp.asarray(rng.standard_normal(p.shape) * 2.0**8, p.dtype) for k, p in params.items()
    }
    if step == 1:
        grads["w1"] = grads["w1"].at[3, 5].set(jnp.inf)
    return grads


def _train(opt):
    """init, then three updates applied with `optax.apply_updates`: (params, float32 masters,
    loss scale, skipped steps)."""

    def train(params, g0, g1, g2):
        state = opt.init(params)
        for g in (g0, g1, g2):
            updates, state = opt.update(g, state, params)
            params = optax.apply_updates(params, updates)
        masters = mpjax.master_params(state, params)
        return params, masters, state.loss_scale.loss_scale, state.skipped_steps

    return train


def _opt(master, skip_impl="auto", state_dtype=None, impl="auto", axis_name=None, block=None):
    inner = optax.adam(1e-2)
    if state_dtype is not None:
        inner = mpjax.low_precision_state(inner, state_dtype, block_size=block)
    return mpjax.loss_scaled(
        inner, SCALE, master_weights=master, skip_impl=skip_impl, impl=impl, axis_name=axis_name
    )


def _args(master):
    params = mlp_params(PARAM_DTYPES[master])
    return (params, *(_grads(params, s) for s in range(3)))


@functools.cache
def _unsharded(master, state_dtype=None, block=None):
    # skip_impl and impl change how, not what: one reference for all of them
    opt = _opt(master, state_dtype=state_dtype, block=block)
    return on_mesh(_train(opt), None, _args(master), None)


def _assert_matches(got, want, what):
    """Masters to float32 rounding, params to one bf16 rounding flip, the rest exactly."""
    (params, masters, scale, skipped), (w_params, w_masters, w_scale, w_skipped) = got, want
    assert_trees_close(masters, w_masters, 1e-6, what=f"{what} masters")
    assert_trees_close(params, w_params, 1e-3, what=f"{what} params")
    assert (
        (float(scale), int(skipped)) == (float(w_scale), int(w_skipped)) == (2.0**9, 1)
    )  # backed off once


def _check(kind, master, state_dtype=None, **kw):
    got = on_mesh(
        _train(_opt(master, state_dtype=state_dtype, **kw)), kind, _args(master), (SPECS,) * 4
    )
    # int8 state: the default blocks follow the shapes alone, so the unsharded reference
    # quantises with the same blocks as the sharded run
    _assert_matches(got, _unsharded(master, state_dtype), f"{kind}/{master}/{kw}")


# skip_impl="auto" is "cond" on CPU.
@pytest.mark.parametrize("skip_impl", ["cond", "select"])
@pytest.mark.parametrize("master", list(PARAM_DTYPES), ids=lambda m: f"master={m}")
def test_explicit_axes_every_skip_impl_and_master_mode_matches_unsharded(master, skip_impl):
    _check("explicit", master, skip_impl=skip_impl)


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
def test_explicit_axes_low_precision_state_matches_unsharded(state_dtype):
    _check("explicit", "auto", state_dtype=state_dtype)


def test_explicit_axes_pallas_finite_check_interpret_matches_unsharded():
    _check("explicit", "remainder", impl="interpret")


def test_auto_axes_matches_unsharded():
    _check("auto", "remainder", skip_impl="select")


def test_shard_map_check_vma_every_device_skips_and_matches_unsharded():
    """Inside `jax.shard_map(check_vma=True)` with `axis_name`: the inf lives in one device's
    shard, every device skips that step, and the params equal the unsharded run's."""
    impl = "interpret"  # the Pallas finite check's dispatch, per device
    train = _train(_opt("auto", skip_impl="select", impl=impl, axis_name=AXIS))
    specs = (SHARD_MAP_SPECS,) * 4
    out_specs = (SHARD_MAP_SPECS, SHARD_MAP_SPECS, P(), P())
    mapped = jax.shard_map(train, in_specs=specs, out_specs=out_specs, check_vma=True)
    got = on_mesh(mapped, "explicit", _args("auto"), specs)
    _assert_matches(got, _unsharded("auto"), f"shard_map/{impl}")


def test_axis_name_outside_shard_map_names_the_argument_and_the_fix():
    """The misuse of docs/guides/errors.md: `axis_name` in a global (jit) step."""
    tx = mpjax.loss_scaled(optax.sgd(0.1), axis_name="data")
    params = {"w": jnp.ones(2)}
    with pytest.raises(NameError, match=r"axis_name='data' is not bound.*without axis_name"):
        tx.update(params, tx.init(params), params)
