"""Tests for `nonfinite_report` and the loss-scale collapse protection."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax import DynamicLossScale, loss_scaled


def _tree(rng, dtype):
    return {
        "enc": {"w": jnp.asarray(rng.normal(size=(4, 5)), dtype)},
        "dec": {"w": jnp.asarray(rng.normal(size=(7,)), dtype), "tiny": jnp.asarray([1.5], dtype)},
        "steps": jnp.arange(3),
    }


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_nonfinite_report_names_leaves_and_counts(dtype, jit):
    rng = np.random.default_rng(0)
    tree = _tree(rng, dtype)
    report_fn = jax.jit(mpjax.nonfinite_report) if jit else mpjax.nonfinite_report
    clean = report_fn(tree)
    assert clean.offenders() == {} and not bool(clean.any_nonfinite)
    assert len(clean.paths) == 3  # the int leaf is not reported
    w = np.array(tree["enc"]["w"], np.float32).reshape(-1)
    w[0], w[10], w[-1] = np.nan, np.inf, -np.inf  # first, middle, last
    tree["enc"]["w"] = jnp.asarray(w.reshape(4, 5), dtype)
    tree["dec"]["tiny"] = jnp.asarray([np.nan], dtype)
    report = report_fn(tree)
    assert report.offenders() == {"['enc']['w']": (1, 2), "['dec']['tiny']": (1, 0)}
    assert bool(report.any_nonfinite)
    text = str(report)
    assert "['enc']['w']: 1 NaN, 2 inf" in text and "2 of 3 leaves" in text


def test_persistently_nonfinite_model_stops_at_min_scale_and_is_visible():
    params = {"w": jnp.ones((3,), jnp.float16)}
    tx = loss_scaled(optax.adam(1e-3), DynamicLossScale(initial_scale=2.0**10, min_scale=2.0))
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(40):
        updates, state = update({"w": jnp.full((3,), jnp.nan, jnp.float16)}, state, params)
        params = optax.apply_updates(params, updates)
        scale = float(state.loss_scale.loss_scale)
        assert np.isfinite(scale) and scale >= 2.0
    assert float(state.loss_scale.loss_scale) == 2.0
    assert np.all(np.asarray(params["w"], np.float32) == 1.0)
    metrics = mpjax.scaling_metrics(state)
    assert int(metrics["skipped_steps"]) == 40 and int(metrics["consecutive_skips"]) == 40
    assert not bool(metrics["grads_finite"])


def test_max_consecutive_skips_raises_clear_catchable_error():
    params = {"w": jnp.ones((3,), jnp.float16)}
    tx = loss_scaled(optax.sgd(1e-3), max_consecutive_skips=3)
    state = tx.init(params)
    update = jax.jit(tx.update)
    bad = {"w": jnp.asarray([1.0, jnp.inf, 2.0], jnp.float16)}
    good = {"w": jnp.asarray([1.0, 3.0, 2.0], jnp.float16)}
    # two skips, a finite step (resets the run), two more skips: fine
    for g in (bad, bad, good, bad, bad):
        _, state = update(g, state, params)
        jax.block_until_ready(state)
    assert int(state.consecutive_skips) == 2
    with pytest.raises(RuntimeError, match="TrainingDivergedError.*3 non-finite steps in a row"):
        _, state = update(bad, state, params)
        jax.block_until_ready(state)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_consecutive_skips_validated(bad):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        loss_scaled(optax.sgd(1.0), max_consecutive_skips=bad)
