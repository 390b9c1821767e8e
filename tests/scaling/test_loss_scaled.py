"""Tests for the `mpjax.loss_scaled` optax wrapper."""

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax import DynamicLossScale, StaticLossScale, loss_scaled


def _params(rng, dtype=jnp.bfloat16):
    return {
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(4, 3)), dtype),
            "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        },
        "step": jnp.asarray(3, jnp.int32),
    }


def _loss(params, x):
    y = x.astype(params["dense"]["kernel"].dtype) @ params["dense"]["kernel"]
    return jnp.mean(jnp.square(y.astype(jnp.float32) + params["dense"]["bias"]))


def _grads(params, opt_state, x):
    return jax.grad(lambda p: mpjax.scale_loss(_loss(p, x), opt_state), allow_int=True)(params)


def _inject(grads, value, where):
    k = grads["dense"]["kernel"]
    flat = k.reshape(-1)
    idx = {"first": 0, "middle": flat.size // 2, "last": flat.size - 1}[where]
    grads = jax.tree.map(lambda x: x, grads)
    grads["dense"]["kernel"] = flat.at[idx].set(value).reshape(k.shape)
    return grads


@pytest.mark.parametrize("skip_impl", ["auto", "cond", "select"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_skipped_step_leaves_everything_bit_identical(jit, bad, where, skip_impl):
    rng = np.random.default_rng(0)
    params = _params(rng)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    tx = loss_scaled(optax.adam(1e-2), skip_impl=skip_impl)
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    # one finite step first, so Adam's count/mu/nu are non-trivial
    updates, state = update(_grads(params, state, x), state, params)
    params = optax.apply_updates(params, updates)
    before_state, before_params = state, params

    grads = _inject(_grads(params, state, x), bad, where)
    updates, state = update(grads, state, params)
    new_params = optax.apply_updates(params, updates)

    chex.assert_trees_all_equal(new_params, before_params)
    chex.assert_trees_all_equal(state.master, before_state.master)
    chex.assert_trees_all_equal(state.inner_state, before_state.inner_state)
    adam = state.inner_state[0]
    assert int(adam.count) == 1
    assert float(state.loss_scale.loss_scale) == 2.0**14  # backed off once
    assert not bool(state.grads_finite)
    assert int(state.skipped_steps) == 1 and int(state.consecutive_skips) == 1
    for leaf in jax.tree.leaves(updates):
        assert not np.any(np.asarray(leaf, np.float64))


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_finite_step_updates_land_exactly_on_master(param_dtype):
    rng = np.random.default_rng(1)
    params = _params(rng, param_dtype)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    tx = loss_scaled(optax.adam(3e-2))
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(5):
        updates, state = update(_grads(params, state, x), state, params)
        params = optax.apply_updates(params, updates)
        assert bool(state.grads_finite)
        if param_dtype == jnp.float32:
            assert not jax.tree.leaves(state.master["dense"]["kernel"])  # no master kept
        else:
            master = state.master["dense"]["kernel"]
            assert master.dtype == jnp.float32
            chex.assert_trees_all_equal(params["dense"]["kernel"], master.astype(param_dtype))
        assert params["dense"]["kernel"].dtype == param_dtype
        assert params["step"].dtype == jnp.int32 and int(params["step"]) == 3


def test_inner_update_matches_plain_optax_on_unscaled_float32_grads():
    """The wrapper's step equals optax's step on fp32 master weights and unscaled grads."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.bfloat16)}
    x = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)

    def loss(p):
        return jnp.sum(jnp.sin(x @ p["w"].astype(jnp.float32)))

    tx = loss_scaled(optax.adam(1e-2), StaticLossScale(1024.0))
    state = tx.init(params)
    ref_tx = optax.adam(1e-2)
    master = {"w": params["w"].astype(jnp.float32)}
    ref_state = ref_tx.init(master)
    for _ in range(3):
        grads = jax.grad(lambda p, s=state: mpjax.scale_loss(loss(p), s))(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32) / 1024.0, grads)
        ref_updates, ref_state = ref_tx.update(g32, ref_state, master)
        master = optax.apply_updates(master, ref_updates)
        # equal up to FMA contraction, which XLA decides per fusion
        np.testing.assert_allclose(
            np.asarray(state.master["w"]), np.asarray(master["w"]), rtol=1e-6
        )


def test_master_weights_accumulate_what_bf16_rounds_away():
    p0 = {"w": jnp.ones((4,), jnp.bfloat16)}

    def loss(p):  # d loss / d w = 1
        return jnp.sum(p["w"].astype(jnp.float32))

    plain = optax.sgd(1e-4)
    plain_state, plain_params = plain.init(p0), p0
    tx = loss_scaled(optax.sgd(1e-4))
    state, params = tx.init(p0), p0

    @jax.jit
    def plain_step(params, opt_state):
        g = jax.grad(loss)(params)
        u, opt_state = plain.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state

    @jax.jit
    def mp_step(params, opt_state):
        g = jax.grad(lambda p: mpjax.scale_loss(loss(p), opt_state))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state

    for _ in range(1000):
        plain_params, plain_state = plain_step(plain_params, plain_state)
        params, state = mp_step(params, state)
    assert np.all(np.asarray(plain_params["w"], np.float32) == 1.0)
    master = np.asarray(state.master["w"], np.float64)
    np.testing.assert_allclose(master, 0.9, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(params["w"], np.float64), 0.9, rtol=1e-2)
    assert np.all(np.asarray(params["w"]) == np.asarray(state.master["w"].astype(jnp.bfloat16)))


def test_master_weights_policy():
    rng = np.random.default_rng(3)
    params = {
        "h": jnp.asarray(rng.normal(size=(3,)), jnp.float16),
        "f": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        "i": jnp.arange(3),
    }

    def n_master(state):
        return len(jax.tree.leaves(state.master))

    assert n_master(loss_scaled(optax.sgd(1.0)).init(params)) == 1
    assert n_master(loss_scaled(optax.sgd(1.0), master_weights=True).init(params)) == 2
    assert n_master(loss_scaled(optax.sgd(1.0), master_weights=False).init(params)) == 0
    fp32 = {"a": params["f"], "b": params["f"] * 2}
    assert n_master(loss_scaled(optax.sgd(1.0)).init(fp32)) == 0  # no extra memory
    with pytest.raises(ValueError, match="master_weights"):
        loss_scaled(optax.sgd(1.0), master_weights="yes")


def test_inner_state_initialised_on_float32_view():
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    state = loss_scaled(optax.adam(1e-3)).init(params)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.float32 and adam.nu["w"].dtype == jnp.float32


def test_clipping_inside_inner_sees_unscaled_grads():
    params = {"w": jnp.zeros((2,), jnp.float32)}
    g = jnp.asarray([0.3, -0.4])  # norm 0.5 < 1: not clipped when unscaled
    tx = loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)))
    state = tx.init(params)
    scaled = {"w": g * state.loss_scale.loss_scale}
    updates, _ = tx.update(scaled, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -np.asarray(g), rtol=1e-6)


def test_extra_args_pass_through():
    seen = {}

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, value=None, **extra):
        seen["value"] = value
        return jax.tree.map(lambda u: -u * value, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = optax.chain(loss_scaled(inner, StaticLossScale(4.0)))
    params = {"w": jnp.asarray([1.0, 2.0])}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.asarray([4.0, 8.0])}, state, params, value=3.0)
    assert seen["value"] == 3.0
    np.testing.assert_allclose(np.asarray(updates["w"]), [-3.0, -6.0])


def test_works_nested_in_chain():
    rng = np.random.default_rng(4)
    params = _params(rng)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    tx = optax.chain(
        optax.identity(),
        loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))),
    )
    state = tx.init(params)
    grads = _grads(params, state, x)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert float(mpjax.scaling_metrics(state)["loss_scale"]) == 2.0**15
    bad = _inject(grads, jnp.nan, "middle")
    updates, state2 = jax.jit(tx.update)(bad, state, params)
    assert int(mpjax.scaling_metrics(state2)["skipped_steps"]) == 1
    chex.assert_trees_all_equal(
        mpjax.find_loss_scaled_state(state2).inner_state,
        mpjax.find_loss_scaled_state(state).inner_state,
    )


@pytest.mark.parametrize("wrap", ["object", "transformation"])
def test_multisteps_inside_drops_bad_micro_batch_and_recovers(wrap):
    params = {"w": jnp.asarray([1.0, -1.0], jnp.bfloat16)}
    ms = optax.MultiSteps(optax.sgd(0.5), every_k_schedule=2)
    tx = loss_scaled(ms if wrap == "object" else ms.gradient_transformation(), StaticLossScale(8.0))
    state = tx.init(params)
    g = {"w": jnp.asarray([8.0, 16.0], jnp.bfloat16)}  # scaled grads of [1, 2]
    u1, state = tx.update(g, state, params)
    assert not np.any(np.asarray(u1["w"], np.float32))
    params = optax.apply_updates(params, u1)
    u2, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u2)
    np.testing.assert_allclose(np.asarray(params["w"], np.float32), [0.5, -2.0])
    # an overflowing micro-batch is dropped before accumulation, and training goes on
    bad = {"w": jnp.asarray([jnp.inf, 16.0], jnp.bfloat16)}
    u3, state = tx.update(bad, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, u3), params)
    assert int(mpjax.scaling_metrics(state)["skipped_steps"]) == 1
    for _ in range(4):  # two more full windows of good micro-batches
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    np.testing.assert_allclose(np.asarray(params["w"], np.float32), [-0.5, -4.0])
    assert int(mpjax.scaling_metrics(state)["skipped_steps"]) == 1


def test_flax_train_state():
    from flax.training import train_state

    rng = np.random.default_rng(5)
    params = _params(rng)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    ts = train_state.TrainState.create(
        apply_fn=None, params=params, tx=loss_scaled(optax.adam(1e-2))
    )

    @jax.jit
    def step(ts):
        grads = _grads(ts.params, ts.opt_state, x)
        return ts.apply_gradients(grads=grads)

    losses = []
    for _ in range(20):
        ts = step(ts)
        losses.append(float(_loss(ts.params, x)))
    assert losses[-1] < losses[0]
    state = mpjax.find_loss_scaled_state(ts.opt_state)
    chex.assert_trees_all_equal(
        ts.params["dense"]["kernel"], state.master["dense"]["kernel"].astype(jnp.bfloat16)
    )


def test_flax_nnx_optimizer():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 2, rngs=rngs, param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.linear(x.astype(jnp.bfloat16)).astype(jnp.float32)

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, loss_scaled(optax.adam(1e-2)), wrt=nnx.Param)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        def scaled(model):
            return mpjax.scale_loss(loss_fn(model), opt.opt_state)

        grads = nnx.grad(scaled)(model)
        opt.update(model, grads)
        return loss_fn(model)

    first = float(step(model, opt))
    for _ in range(30):
        last = float(step(model, opt))
    assert last < first
    metrics = mpjax.scaling_metrics(opt.opt_state)
    assert int(metrics["skipped_steps"]) == 0
    assert model.linear.kernel[...].dtype == jnp.bfloat16


def test_jit_lower_tree_map_and_serialization_round_trip():
    rng = np.random.default_rng(7)
    params = _params(rng)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    ls = DynamicLossScale(initial_scale=2.0**10, growth_interval=3, min_scale=4.0)
    tx = loss_scaled(optax.adam(1e-2), ls)
    state = tx.init(params)
    for _ in range(4):
        updates, state = jax.jit(tx.update)(_grads(params, state, x), state, params)
        params = optax.apply_updates(params, updates)
    # jax.tree.map round trip keeps structure and config
    mapped = jax.tree.map(lambda a: a, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)
    assert mapped.loss_scale.config == ls.config
    # .lower() and compile with the state as an argument
    grads = _grads(params, state, x)
    compiled = jax.jit(tx.update).lower(grads, state, params).compile()
    u_c, s_c = compiled(grads, state, params)
    u_j, s_j = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal((u_c, s_c), (u_j, s_j))
    # flax.serialization bytes round trip of the whole opt_state
    target = tx.init(params)
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    assert restored.loss_scale.config == ls.config
    assert float(restored.loss_scale.loss_scale) == float(state.loss_scale.loss_scale)


def test_scale_trajectory_through_the_wrapper():
    params = {"w": jnp.ones((3,), jnp.float16)}
    ls = DynamicLossScale(initial_scale=16.0, growth_interval=2, min_scale=2.0, max_scale=64.0)
    tx = loss_scaled(optax.sgd(1e-3), ls)
    state = tx.init(params)
    seq = [True, True, True, True, True, True, False, False, False, False, True]
    expected = [16, 32, 32, 64, 64, 64, 32, 16, 8, 4, 4]
    got = []
    for f in seq:
        g = {"w": jnp.full((3,), 1.0 if f else jnp.inf, jnp.float16)}
        _, state = jax.jit(tx.update)(g, state, params)
        got.append(float(state.loss_scale.loss_scale))
    assert got == expected
    assert int(state.skipped_steps) == 4 and int(state.consecutive_skips) == 0


def test_pmap_axis_name_inf_on_one_device_makes_all_skip():
    n = jax.local_device_count()
    assert n >= 2, "conftest sets 8 CPU devices"
    rng = np.random.default_rng(8)
    params = {"w": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)}
    tx = loss_scaled(optax.adam(1e-2), axis_name="batch")
    state = tx.init(params)
    rep = jax.tree.map(lambda a: jnp.stack([a] * n), (params, state))
    grads = np.asarray(rng.normal(size=(n, 4)), np.float32) * 100
    grads[n // 2, 1] = np.inf  # one device only, no pmean

    def step(params, state, g):
        updates, state = tx.update({"w": g.astype(jnp.bfloat16)}, state, params)
        return optax.apply_updates(params, updates), state

    new_params, new_state = jax.pmap(step, axis_name="batch")(*rep, jnp.asarray(grads))
    for d in range(n):
        chex.assert_trees_all_equal(jax.tree.map(lambda a, d=d: a[d], new_params), params)
        chex.assert_trees_all_equal(
            jax.tree.map(lambda a, d=d: a[d], new_state.inner_state), state.inner_state
        )
        assert float(new_state.loss_scale.loss_scale[d]) == 2.0**14
        assert not bool(new_state.grads_finite[d])
    # without axis_name, only the faulty device would skip: the flag is per device
    tx_local = loss_scaled(optax.adam(1e-2))

    def local(params, state, g):
        _, state = tx_local.update({"w": g.astype(jnp.bfloat16)}, state, params)
        return state.grads_finite

    flags = jax.pmap(local, axis_name="batch")(*rep, jnp.asarray(grads))
    assert int(np.sum(~np.asarray(flags))) == 1


def test_helpers_find_state_and_errors():
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    state = optax.chain(optax.identity(), loss_scaled(optax.sgd(0.1))).init(params)
    scaled = mpjax.scale_loss(jnp.asarray(1.5, jnp.bfloat16), state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 1.5 * 2.0**15
    metrics = mpjax.scaling_metrics(state)
    assert set(metrics) >= {"loss_scale", "grads_finite", "skipped_steps"}
    scale = mpjax.get_loss_scale(state)  # loggable: a float32 scalar array
    assert isinstance(scale, jax.Array) and scale.shape == () and scale.dtype == jnp.float32
    assert float(scale) == 2.0**15
    assert isinstance(mpjax.find_loss_scaled_state(state).loss_scale, DynamicLossScale)

    plain = optax.adam(1e-3).init(params)
    for helper in (mpjax.get_loss_scale, mpjax.scaling_metrics):
        with pytest.raises(ValueError, match="loss_scaled"):
            helper(plain)
    with pytest.raises(ValueError, match="loss_scaled"):
        mpjax.scale_loss(jnp.float32(1.0), plain)
    two = (loss_scaled(optax.sgd(1.0)).init(params), loss_scaled(optax.sgd(1.0)).init(params))
    with pytest.raises(ValueError, match="2 mpjax.loss_scaled states"):
        mpjax.get_loss_scale(two)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="GradientTransformation"):
        loss_scaled(lambda g: g)
    with pytest.raises(TypeError, match="LossScale"):
        loss_scaled(optax.sgd(1.0), 128.0)
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    tx = loss_scaled(optax.sgd(1.0))
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"in params only: \[\"\['b'\]\"\]"):
        tx.update({"a": jnp.ones(2)}, state, params)
    with pytest.raises(ValueError, match="in grads only"):
        tx.update({"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}, state, params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"a": jnp.ones(2), "b": jnp.ones(3)}, state)


def test_int_and_bool_params_pass_through():
    params = {"w": jnp.ones((2,), jnp.bfloat16), "n": jnp.asarray([1, 2]), "m": jnp.array(True)}
    tx = loss_scaled(optax.adam(1e-1))
    state = tx.init(params)
    grads = {
        "w": jnp.full((2,), 2.0**15, jnp.bfloat16),
        "n": np.zeros((2,), jax.dtypes.float0),
        "m": np.zeros((), jax.dtypes.float0),
    }
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new["n"].dtype == jnp.int32 and list(np.asarray(new["n"])) == [1, 2]
    assert new["m"].dtype == jnp.bool_ and bool(new["m"])
    assert np.all(np.asarray(new["w"], np.float32) < 1.0)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_skip_impls_agree(param_dtype):
    """ "cond" and "select" take the same steps and skips (values equal up to FMA contraction)."""
    rng = np.random.default_rng(9)
    params0 = _params(rng, param_dtype)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    results = {}
    for impl in ("cond", "select"):
        tx = loss_scaled(optax.adam(1e-2), skip_impl=impl)
        params, state = params0, tx.init(params0)
        update = jax.jit(tx.update)
        for t in range(6):
            grads = _grads(params, state, x)
            if t in (2, 3):
                grads = _inject(grads, jnp.nan if t == 2 else jnp.inf, "middle")
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
        results[impl] = (params, state)
    (p_c, s_c), (p_s, s_s) = results["cond"], results["select"]
    chex.assert_trees_all_close(p_c, p_s, rtol=1e-6)
    chex.assert_trees_all_close(s_c.inner_state, s_s.inner_state, rtol=1e-6)
    for a, b in [
        (s_c.loss_scale.loss_scale, s_s.loss_scale.loss_scale),
        (s_c.skipped_steps, s_s.skipped_steps),
    ]:
        assert int(a) == int(b)
    assert int(s_c.skipped_steps) == 2


def test_finite_step_that_overflows_a_float16_param_is_skipped():
    params = {"w": jnp.asarray([60000.0, 1.0], jnp.float16)}
    tx = loss_scaled(optax.sgd(1.0), StaticLossScale(1.0), master_weights=False)
    state = tx.init(params)
    grads = {"w": jnp.asarray([-30000.0, 0.5], jnp.float16)}  # finite; 60000 + 30000 overflows
    updates, state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
    assert bool(state.grads_finite) and int(state.skipped_steps) == 1
    # with the check off, the overflow goes through (documented trade-off)
    tx_off = loss_scaled(
        optax.sgd(1.0), StaticLossScale(1.0), master_weights=False, check_new_values=False
    )
    updates, _ = jax.jit(tx_off.update)(grads, tx_off.init(params), params)
    assert np.isinf(np.asarray(optax.apply_updates(params, updates)["w"][0], np.float32))


@pytest.mark.parametrize("kwarg", [dict(skip_impl="fast"), dict(check_new_values="fp16")])
def test_bad_options_named(kwarg):
    with pytest.raises(ValueError, match=next(iter(kwarg))):
        loss_scaled(optax.sgd(1.0), **kwarg)


def test_float32_params_with_forced_master_land_exactly():
    rng = np.random.default_rng(10)
    params = {"w": jnp.asarray(rng.normal(size=(7,)), jnp.float32)}
    tx = loss_scaled(optax.adam(0.1), StaticLossScale(1.0), master_weights=True)
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(25):
        g = {"w": jnp.asarray(rng.normal(size=(7,)), jnp.float32)}
        params, state = step(params, state, g)
        np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(state.master["w"]))


def test_vmapped_ensemble_with_max_consecutive_skips():
    """Under vmap lax.cond runs both branches: finite steps must not raise."""
    n = 4
    params = {"w": jnp.ones((n, 3), jnp.float16)}
    tx = loss_scaled(optax.sgd(1e-3), max_consecutive_skips=2)
    state = jax.vmap(tx.init)(params)
    update = jax.jit(jax.vmap(tx.update))
    good = {"w": jnp.ones((n, 3), jnp.float16)}
    for _ in range(3):
        _, state = update(good, state, params)
        jax.block_until_ready(state)
    assert not np.any(np.asarray(state.skipped_steps))
    bad = {"w": good["w"].at[1, 0].set(jnp.inf)}
    _, state = update(bad, state, params)
    with pytest.raises(RuntimeError, match="TrainingDivergedError.*2 non-finite steps"):
        _, state = update(bad, state, params)
        jax.block_until_ready(state)


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.float8_e4m3fn])
def test_unsupported_param_dtypes_refused_naming_the_leaf(dtype):
    params = {"ok": jnp.ones(2), "layer": {"z": jnp.ones(2, dtype)}}
    with pytest.raises(TypeError, match=r"\['layer'\]\['z'\].*supported"):
        loss_scaled(optax.sgd(1.0)).init(params)
