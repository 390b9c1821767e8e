"""Loss-scale API on real use: Python numbers, scalar `adjust`, loggable `get_loss_scale`,
the dead-run check (host-side by default), one config-driven step for fp32/bf16/fp16,
Flax `DynamicScale`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import mpjax
from mpjax import DynamicLossScale, NoOpLossScale, StaticLossScale

# --- Python numbers are scaled (jmp and torch GradScaler scale them too) ---


@pytest.mark.parametrize(
    "ls, s",
    [(StaticLossScale(2.0**10), 2.0**10), (DynamicLossScale(), 2.0**15), (NoOpLossScale(), 1.0)],
    ids=["static", "dynamic", "noop"],
)
def test_python_numbers_and_lists_are_scaled(ls, s):
    rng = np.random.default_rng(0)
    x = float(rng.lognormal(0, 3))
    scaled = ls.scale(x)
    assert isinstance(scaled, jax.Array) and scaled.dtype == jnp.float32
    np.testing.assert_allclose(float(scaled), np.float32(x) * s, rtol=1e-7)
    tree = ls.scale({"a": [x, 2], "b": (jnp.float16(3.0),)})
    np.testing.assert_allclose(float(tree["a"][0]), np.float32(x) * s, rtol=1e-7)
    assert float(tree["a"][1]) == 2 * s and float(tree["b"][0]) == 3 * s
    back = ls.unscale(tree)
    np.testing.assert_allclose(float(back["a"][0]), np.float32(x), rtol=1e-7)
    assert float(ls.unscale(3 * s)) == 3.0


def test_scale_loss_scales_a_python_float():
    state = mpjax.loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2, jnp.float16)})
    out = mpjax.scale_loss(1.5, state)
    assert float(out) == 1.5 * 2.0**15


def test_int_and_bool_arrays_pass_through_scale():
    ls = StaticLossScale(4.0)
    tree = ls.scale({"n": jnp.arange(3), "m": jnp.array([True]), "flag": True})
    assert tree["n"].dtype == jnp.int32 and np.array_equal(tree["n"], np.arange(3))
    assert tree["flag"] is True and bool(tree["m"][0])


@pytest.mark.parametrize("method", ["scale", "unscale"])
@pytest.mark.parametrize(
    "leaf, culprit",
    [("loss", "is a str"), (jnp.ones(2, jnp.complex64), "is a complex64 array")],
    ids=["string", "complex"],
)
def test_scale_rejects_unsupported_leaves_by_path(method, leaf, culprit):
    with pytest.raises(TypeError, match=rf"{method}: leaf \['x'\]\[1\] {culprit}"):
        getattr(DynamicLossScale(), method)({"x": [1.0, leaf]})


# --- adjust takes one scalar flag (jmp: test_dynamic_loss_scale_adjust_requires_scalar_input) ---


@pytest.mark.parametrize("ls", [DynamicLossScale(), StaticLossScale(8.0), NoOpLossScale()])
@pytest.mark.parametrize("flags", [jnp.array([True, False]), jnp.ones((1,), bool)])
def test_adjust_rejects_non_scalar_flags_naming_the_shape(ls, flags):
    with pytest.raises(ValueError, match=rf"scalar bool, got shape \({flags.shape[0]},\)"):
        ls.adjust(flags)


def test_adjust_rejects_float_flag():
    with pytest.raises(TypeError, match="float32"):
        DynamicLossScale().adjust(jnp.float32(0.5))


def test_adjust_under_jit_keeps_scalar_state():
    ls = DynamicLossScale(initial_scale=2.0**4, growth_interval=1)
    new = jax.jit(lambda ls, f: ls.adjust(f))(ls, jnp.array(False))
    assert new.loss_scale.shape == () and float(new.loss_scale) == 8.0


# --- get_loss_scale is loggable ---


def test_get_loss_scale_is_a_float32_scalar_inside_and_outside_jit():
    tx = mpjax.loss_scaled(optax.adam(1e-3), DynamicLossScale(initial_scale=2.0**7))
    state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    assert float(mpjax.get_loss_scale(state)) == 128.0
    logged = jax.jit(mpjax.get_loss_scale)(state)
    assert logged.shape == () and logged.dtype == jnp.float32 and float(logged) == 128.0


# --- a dead run stops: raise_if_diverged on the host, or opt-in inside the step ---


def test_default_threshold_covers_the_backoff_to_min_scale():
    assert mpjax.default_max_consecutive_skips(DynamicLossScale()) == 24 + 25  # 2^24 -> 1
    uncapped = DynamicLossScale(max_scale=None, min_scale=2.0**-4)
    assert mpjax.default_max_consecutive_skips(uncapped) == 128 + 4 + 25
    assert mpjax.default_max_consecutive_skips(StaticLossScale(1.0)) == 25
    quarter = DynamicLossScale(initial_scale=2.0**8, backoff_factor=0.25, max_scale=2.0**8)
    assert mpjax.default_max_consecutive_skips(quarter) == 4 + 25


def _dead_run(loss_scale, steps, **kwargs):
    """`steps` all-NaN steps of a `loss_scaled` SGD on a float16 param; returns the state."""
    tx = mpjax.loss_scaled(optax.sgd(0.1), loss_scale, **kwargs)
    params = {"w": jnp.ones(4, jnp.float16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    bad = {"w": jnp.full(4, jnp.nan, jnp.float16)}
    for _ in range(steps):
        _, state = update(bad, state, params)
    return tx, state


def test_all_skipped_run_raises_at_the_default_limit_on_the_host():
    ls = DynamicLossScale(initial_scale=2.0**4, max_scale=2.0**4)  # 4 backoffs to 1
    limit = mpjax.default_max_consecutive_skips(ls)
    assert limit == 29
    _, state = _dead_run(ls, limit - 1)  # nothing in the step
    assert int(state.consecutive_skips) == limit - 1
    assert float(mpjax.get_loss_scale(state)) == 1.0
    mpjax.raise_if_diverged(state)  # one short of the limit: no error
    _, state = _dead_run(ls, limit)
    with pytest.raises(mpjax.TrainingDivergedError, match=f"{limit} non-finite steps in a row"):
        mpjax.raise_if_diverged(state)
    with pytest.raises(mpjax.TrainingDivergedError, match="raise_if_diverged.*=5"):
        mpjax.raise_if_diverged({"opt": state}, max_consecutive_skips=5)  # found in a tree
    mpjax.raise_if_diverged(state, max_consecutive_skips=None)  # None: no check


def test_raise_if_diverged_through_train_state_and_skips_a_noop_scale():
    from flax.training import train_state

    _, dead = _dead_run(StaticLossScale(2.0), 25)
    ts = train_state.TrainState(
        step=0, apply_fn=None, params={}, tx=optax.identity(), opt_state=(dead, optax.EmptyState())
    )
    with pytest.raises(mpjax.TrainingDivergedError, match="25 non-finite"):
        mpjax.raise_if_diverged(ts)
    # NoOpLossScale scales nothing: "auto" does not call its skips a dead run; an int does.
    _, noop = _dead_run(NoOpLossScale(), 30, check_new_values=True)
    noop = noop._replace(consecutive_skips=jnp.int32(30))
    mpjax.raise_if_diverged(noop)
    with pytest.raises(mpjax.TrainingDivergedError):
        mpjax.raise_if_diverged(noop, max_consecutive_skips=30)


def test_raise_if_diverged_checks_every_replica_and_rejects_traced_state():
    _, state = _dead_run(StaticLossScale(2.0), 3)
    replicated = jax.tree.map(lambda x: jnp.stack([x * 0, x]), state)  # pmap-style, one dead
    with pytest.raises(mpjax.TrainingDivergedError, match="3 non-finite steps"):
        mpjax.raise_if_diverged(replicated, max_consecutive_skips=3)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(mpjax.raise_if_diverged)(state)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        mpjax.raise_if_diverged(state, max_consecutive_skips=0)


def test_default_step_has_no_host_callback():
    # A host callback takes every call off JAX's C++ dispatch path (milliseconds per step
    # for a few hundred state leaves): the default step must not contain one.
    def lowered(**kwargs):
        tx = mpjax.loss_scaled(optax.adam(1e-3), **kwargs)
        params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
        grads = jax.tree.map(lambda p: p.astype(jnp.float16), params)
        return jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()

    assert "callback" in lowered(max_consecutive_skips=7)  # the opt-in in-step raise
    assert "callback" in lowered(max_consecutive_skips="auto")
    assert "callback" not in lowered()
    assert "callback" not in lowered(max_consecutive_skips=None)


def test_auto_raises_inside_the_step_at_the_default_limit():
    ls = DynamicLossScale(initial_scale=2.0**4, max_scale=2.0**4)
    tx, state = _dead_run(ls, 28, max_consecutive_skips="auto")  # limit 29
    bad = {"w": jnp.full(4, jnp.nan, jnp.float16)}
    with pytest.raises(RuntimeError, match="TrainingDivergedError.*loss_scaled saw 29"):
        _, state = jax.jit(tx.update)(bad, state, {"w": jnp.ones(4, jnp.float16)})
        jax.block_until_ready(state)


def test_threshold_off_with_none():
    tx = mpjax.loss_scaled(optax.sgd(0.1), StaticLossScale(2.0), max_consecutive_skips=None)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for _ in range(30):
        _, state = jax.jit(tx.update)({"w": jnp.full(2, jnp.inf)}, state, params)
    assert int(state.consecutive_skips) == 30


# --- one train step for fp32, bf16 and fp16 ---


def test_loss_scale_for_names_and_policies():
    assert isinstance(mpjax.loss_scale_for("fp32"), NoOpLossScale)
    assert isinstance(mpjax.loss_scale_for("bf16"), NoOpLossScale)
    assert isinstance(mpjax.loss_scale_for("mixed_bfloat16"), NoOpLossScale)
    fp16 = mpjax.loss_scale_for("fp16", growth_interval=10)
    assert isinstance(fp16, DynamicLossScale) and fp16.growth_interval == 10
    assert isinstance(mpjax.loss_scale_for("mixed_float16"), DynamicLossScale)
    policy = mpjax.get_policy("params=float32,compute=float16,output=float32")
    assert isinstance(mpjax.loss_scale_for(policy), DynamicLossScale)
    assert isinstance(mpjax.loss_scale_for("params=float16,compute=float16"), DynamicLossScale)
    with pytest.raises(ValueError, match="loss_scale_for: unknown precision 'fp12'"):
        mpjax.loss_scale_for("fp12")
    with pytest.raises(TypeError, match="got int"):
        mpjax.loss_scale_for(16)


def _train(precision, steps=4):
    policy = mpjax.get_policy(
        {"fp32": "float32", "bf16": "compute=bfloat16", "fp16": "compute=float16"}[precision]
    )
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    tx = mpjax.loss_scaled(optax.adam(1e-2), mpjax.loss_scale_for(precision))
    state = tx.init(params)

    @jax.jit
    def step(params, state):  # the same step for every precision
        def loss_fn(p):
            p, xx = policy.cast_to_compute((p, x))
            out = policy.cast_to_output(xx @ p["w"] + p["b"])
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(lambda p: mpjax.scale_loss(loss_fn(p), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, mpjax.scaling_metrics(state)

    losses = []
    for _ in range(steps):
        params, state, metrics = step(params, state)
        losses.append(float(metrics["loss_scale"]))
    return params, metrics


@pytest.mark.parametrize("precision, scale", [("fp32", 1.0), ("bf16", 1.0), ("fp16", 2.0**15)])
def test_one_step_serves_every_precision(precision, scale):
    params, metrics = _train(precision)
    ref, _ = _train("fp32")
    assert float(metrics["loss_scale"]) == scale
    assert int(metrics["skipped_steps"]) == 0 and bool(metrics["grads_finite"])
    tol = {"fp32": 1e-6, "bf16": 5e-2, "fp16": 5e-3}[precision]
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(ref["w"]), atol=tol)


def _step_cost(tx, n):
    params = {"w": jnp.ones((n, n)), "b": jnp.ones((n,))}
    state = tx.init(params)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(1, 2)).lower(params, state, params).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return cost["bytes accessed"], text.count(" fusion("), text.count(" reduce(")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cost analysis compared on XLA:CPU")
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-3)], ids=["sgd", "adam"])
def test_noop_loss_scaled_fp32_step_adds_no_bytes(inner):
    """The fp32 step through `loss_scaled(inner, NoOpLossScale())` is `inner`'s: the same
    fusions, no reduction, and bytes that differ only by the state's four scalars (three
    counters and the layout version: a constant, whatever the model's size)."""
    extra = []
    for n in (64, 256):
        bare = _step_cost(inner, n)
        wrapped = _step_cost(mpjax.loss_scaled(inner, NoOpLossScale()), n)
        assert wrapped[1:] == bare[1:], (wrapped, bare)  # fusions and reductions
        extra.append(wrapped[0] - bare[0])
    assert extra[0] == extra[1] and 0 <= extra[0] <= 4 * (1 + 4 + 4), extra


def test_noop_does_not_check_and_static_one_skips():
    params = {"w": jnp.ones(2)}
    nan = {"w": jnp.array([1.0, jnp.nan])}
    noop = mpjax.loss_scaled(optax.sgd(0.1), NoOpLossScale())
    updates, state = noop.update(nan, noop.init(params), params)
    assert np.isnan(np.asarray(updates["w"])).any()  # no check: the inner step as is
    assert int(state.skipped_steps) == 0
    static = mpjax.loss_scaled(optax.sgd(0.1), StaticLossScale(1.0))
    updates, state = static.update(nan, static.init(params), params)
    assert not np.any(np.asarray(updates["w"])) and int(state.skipped_steps) == 1


# --- from Flax DynamicScale ---


def _flax_step(ds, finite):
    x = jnp.where(finite, 1.0, jnp.inf)
    ds, is_fin, _, _ = ds.value_and_grad(lambda p: p * x)(jnp.float32(2.0))
    assert bool(is_fin) == finite
    return ds


@pytest.mark.parametrize("convert_at", [0, 3, 5])
def test_loss_scale_from_flax_continues_the_same_sequence(convert_at):
    pattern = [True, True, True, False, True, True, True, True, True, False, True, True, True]
    ds = DynamicScale(growth_interval=2, scale=2.0**10)
    for finite in pattern[:convert_at]:
        ds = _flax_step(ds, finite)
    ls = mpjax.loss_scale_from_flax(ds)
    assert float(ls.loss_scale) == float(ds.scale) and int(ls.counter) == int(ds.fin_steps)
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    for finite in pattern[convert_at:]:
        ds = _flax_step(ds, finite)
        ls = adjust(ls, jnp.array(finite))
        assert float(ls.loss_scale) == float(ds.scale), (finite, ls, ds)
        assert int(ls.counter) == int(ds.fin_steps)


def test_with_loss_scale_moves_flax_state_into_loss_scaled():
    params = {"w": jnp.ones(3, jnp.float16)}
    ds = DynamicScale(growth_interval=1, scale=2.0**6)
    ds = _flax_step(ds, True)  # fin_steps 1
    tx = optax.chain(optax.identity(), mpjax.loss_scaled(optax.sgd(0.1)))
    opt_state = mpjax.with_loss_scale(tx.init(params), mpjax.loss_scale_from_flax(ds))
    assert float(mpjax.get_loss_scale(opt_state)) == 64.0
    grads = {"w": jnp.ones(3, jnp.float16)}
    for finite in (True, False, True, True):
        ds = _flax_step(ds, finite)
        g = grads if finite else {"w": jnp.full(3, jnp.inf, jnp.float16)}
        _, opt_state = jax.jit(tx.update)(g, opt_state, params)
        assert float(mpjax.get_loss_scale(opt_state)) == float(ds.scale)


def test_migration_helpers_reject_wrong_input():
    with pytest.raises(TypeError, match="DynamicScale, got dict"):
        mpjax.loss_scale_from_flax({"scale": 1.0})
    with pytest.raises(ValueError, match="no mpjax.loss_scaled state"):
        mpjax.with_loss_scale(optax.adam(1e-3).init({"w": jnp.ones(2)}), DynamicLossScale())
    state = mpjax.loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="got DynamicScale"):
        mpjax.with_loss_scale(state, DynamicScale())


def test_migrated_state_survives_a_checkpoint_round_trip():
    import flax.serialization

    ds = _flax_step(_flax_step(DynamicScale(growth_interval=3, scale=2.0**9), True), True)
    tx = mpjax.loss_scaled(optax.adam(1e-3), mpjax.loss_scale_from_flax(ds))
    state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    restored = flax.serialization.from_bytes(
        tx.init({"w": jnp.zeros(2, jnp.bfloat16)}), flax.serialization.to_bytes(state)
    )
    ls = mpjax.find_loss_scaled_state(restored).loss_scale
    assert float(ls.loss_scale) == 512.0 and int(ls.counter) == 2
    assert ls.config == (4, 2.0, 0.5, float(np.finfo(np.float32).tiny), None)


def test_replaced_scale_decides_the_check():
    """The state's scale, not the one given to loss_scaled, decides whether steps are checked."""
    params = {"w": jnp.ones(2, jnp.float16)}
    nan = {"w": jnp.array([jnp.nan, 1.0], jnp.float16)}
    noop_tx = mpjax.loss_scaled(optax.sgd(0.1), NoOpLossScale())
    state = mpjax.with_loss_scale(noop_tx.init(params), DynamicLossScale(initial_scale=8.0))
    updates, state = jax.jit(noop_tx.update)(nan, state, params)
    assert int(state.skipped_steps) == 1 and float(mpjax.get_loss_scale(state)) == 4.0
    assert not np.any(np.asarray(updates["w"], np.float32))
    dyn_tx = mpjax.loss_scaled(optax.sgd(0.1))
    params32, nan32 = {"w": jnp.ones(2)}, {"w": jnp.array([jnp.nan, 1.0])}
    state = mpjax.with_loss_scale(dyn_tx.init(params32), NoOpLossScale())
    updates, state = jax.jit(dyn_tx.update)(nan32, state, params32)
    assert int(state.skipped_steps) == 0 and np.isnan(np.asarray(updates["w"], np.float32)).any()
