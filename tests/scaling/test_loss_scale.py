"""Tests for the loss scales, `all_finite` and `select_tree`."""

import pickle

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax import DynamicLossScale, NoOpLossScale, StaticLossScale


def reference_trajectory(finite_seq, *, init, interval, growth, backoff, lo, hi):
    """Plain-Python reference of the dynamic loss-scale algorithm (torch GradScaler + clamps)."""
    scale, counter, out = float(np.float32(init)), 0, []
    f32max = float(np.finfo(np.float32).max)
    for finite in finite_seq:
        if finite:
            counter += 1
            if counter >= interval:
                new = scale * growth
                if hi is not None:
                    new = min(new, hi)
                if new > f32max:  # growth never reaches inf
                    new = scale
                scale, counter = new, 0
        else:
            scale, counter = max(scale * backoff, lo), 0
        out.append((float(np.float32(scale)), counter))
    return out


SEQ = [True] * 5 + [False] + [True] * 7 + [False] * 7 + [True] * 9 + [False, True, True]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(init=2.0**4, interval=3, growth=2.0, backoff=0.5, lo=1.0, hi=2.0**5),
        dict(init=8.0, interval=2, growth=4.0, backoff=0.25, lo=2.0, hi=None),
        dict(init=1.0, interval=1, growth=2.0, backoff=0.5, lo=1.0, hi=2.0**3),
    ],
)
def test_trajectory_matches_reference(cfg, jit):
    ls = DynamicLossScale(
        initial_scale=cfg["init"],
        growth_interval=cfg["interval"],
        growth_factor=cfg["growth"],
        backoff_factor=cfg["backoff"],
        min_scale=cfg["lo"],
        max_scale=cfg["hi"],
    )
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    expected = reference_trajectory(SEQ, **cfg)
    for finite, (scale, counter) in zip(SEQ, expected, strict=True):
        ls = adjust(ls, jnp.array(finite))
        assert float(ls.loss_scale) == scale
        assert int(ls.counter) == counter
        assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
    # the hand-computed sequence really exercises both clamps
    if cfg["hi"] is not None:
        assert max(s for s, _ in expected) == cfg["hi"]
    assert min(s for s, _ in expected) == cfg["lo"]


def test_hand_computed_sequence():
    ls = DynamicLossScale(initial_scale=4.0, growth_interval=2, min_scale=1.0, max_scale=16.0)
    got = []
    for f in [True, True, True, True, True, True, False, False, False, True]:
        ls = ls.adjust(jnp.array(f))
        got.append(float(ls.loss_scale))
    assert got == [4.0, 8.0, 8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]


def test_growth_never_reaches_inf_without_cap():
    big = float(np.finfo(np.float32).max) / 1.5
    ls = DynamicLossScale(initial_scale=big, growth_interval=1, max_scale=None)
    for _ in range(3):
        ls = ls.adjust(jnp.array(True))
        assert np.isfinite(float(ls.loss_scale))
    assert float(ls.loss_scale) == np.float32(big)


def test_backoff_stops_at_min_scale_never_zero():
    ls = DynamicLossScale(initial_scale=4.0, min_scale=1.0)
    for _ in range(200):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == 1.0


def test_config_survives_flatten_unflatten_map_and_jit():
    ls = DynamicLossScale(
        initial_scale=64.0,
        growth_interval=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=1024.0,
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert len(leaves) == 2
    again = jax.tree.unflatten(treedef, leaves)
    mapped = jax.tree.map(lambda x: x, ls)
    jitted = jax.jit(lambda s: s)(ls)
    for other in (again, mapped, jitted):
        assert other.config == ls.config == (7, 3.0, 0.25, 2.0, 1024.0)
    # .lower() works with the loss scale as an argument
    lowered = jax.jit(lambda s: s.adjust(jnp.array(False))).lower(ls)
    out = lowered.compile()(ls)
    assert float(out.loss_scale) == 16.0 and out.min_scale == 2.0
    # unflatten with placeholder leaves (as jax does internally) does not validate or fail
    jax.tree.unflatten(treedef, [object(), object()])


def test_flax_serialization_round_trip_keeps_state_and_config():
    ls = DynamicLossScale(initial_scale=64.0, growth_interval=5, min_scale=4.0)
    ls = ls.adjust(jnp.array(False)).adjust(jnp.array(True))
    target = DynamicLossScale(initial_scale=64.0, growth_interval=5, min_scale=4.0)
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(ls))
    assert float(restored.loss_scale) == 32.0 and int(restored.counter) == 1
    assert restored.config == ls.config
    assert pickle.loads(pickle.dumps(ls)).config == ls.config


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        (dict(initial_scale=0.0), "initial_scale"),
        (dict(initial_scale=-1.0), "initial_scale"),
        (dict(initial_scale=float("inf")), "initial_scale"),
        (dict(initial_scale=float("nan")), "initial_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=1e-45), "min_scale"),
        (dict(max_scale=0.5), "max_scale"),
        (dict(initial_scale=2.0**30), "initial_scale"),
    ],
)
def test_bad_config_raises_at_construction(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        DynamicLossScale(**kwargs)


def test_bad_static_scale():
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            StaticLossScale(bad)
    with pytest.raises(TypeError, match="growth_interval"):
        DynamicLossScale(growth_interval=2.5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ls", [NoOpLossScale(), StaticLossScale(1000.0), DynamicLossScale()])
def test_scale_and_unscale(ls, dtype):
    rng = np.random.default_rng(2)
    x64 = rng.normal(size=(17,)) * 10
    x = jnp.asarray(x64, dtype)
    s = float(ls.loss_scale)
    scaled = ls.scale({"x": x, "i": jnp.arange(3)})
    assert scaled["x"].dtype == jnp.float32
    assert scaled["i"].dtype == jnp.int32
    ref = np.asarray(x, np.float64) * s
    np.testing.assert_allclose(np.asarray(scaled["x"], np.float64), ref, rtol=1e-6)
    unscaled = ls.unscale({"x": x})["x"]
    assert unscaled.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(unscaled, np.float64), np.asarray(x, np.float64) / s, rtol=1e-6
    )


def test_fp16_loss_times_default_scale_does_not_overflow():
    loss = jnp.asarray(60000.0, jnp.float16)
    scaled = DynamicLossScale().scale(loss)
    assert scaled.dtype == jnp.float32 and np.isfinite(float(scaled))
    assert float(scaled) == 60000.0 * 2.0**15


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("where", [0, 16, -1])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_detects_first_middle_last(bad, where, dtype):
    rng = np.random.default_rng(3)
    x = np.asarray(rng.normal(size=(33,)), np.float32)
    tree = {"a": jnp.asarray(rng.normal(size=(4, 5)), dtype), "b": jnp.asarray(x, dtype)}
    assert bool(mpjax.all_finite(tree))
    x[where] = bad
    tree["b"] = jnp.asarray(x, dtype)
    assert not bool(mpjax.all_finite(tree))
    assert not bool(jax.jit(mpjax.all_finite)(tree))


def test_all_finite_ignores_non_floating_and_empty():
    assert bool(mpjax.all_finite({}))
    assert bool(mpjax.all_finite({"i": jnp.arange(3), "z": np.zeros(2, jax.dtypes.float0)}))


def test_select_tree():
    rng = np.random.default_rng(4)
    a = {"x": jnp.asarray(rng.normal(size=3)), "n": jnp.arange(2)}
    b = {"x": jnp.asarray(rng.normal(size=3)), "n": jnp.arange(2) + 5}
    chex.assert_trees_all_equal(mpjax.select_tree(jnp.array(True), a, b), a)
    chex.assert_trees_all_equal(jax.jit(mpjax.select_tree)(jnp.array(False), a, b), b)
    with pytest.raises(ValueError, match="scalar bool"):
        mpjax.select_tree(jnp.array([True, False]), a, b)
    with pytest.raises(ValueError, match="structure"):
        mpjax.select_tree(jnp.array(True), a, {"x": a["x"]})
