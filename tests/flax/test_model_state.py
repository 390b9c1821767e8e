"""A skipped step keeps model state (BatchNorm statistics) bit-identical: linen, NNX, functional.

Each model is float16 with `loss_scaled(DynamicLossScale)`; the skipped step is forced by an
input that overflows float16 in the forward pass, so the BatchNorm statistics the step returns
are inf/NaN. The naive step (commit what the forward pass returned) corrupts them; the step
with `mpjax.keep_if_skipped` / `mpjax.restore_if_skipped` keeps them bit for bit. After a good
step the running mean is checked against a float64 computation of the momentum update.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import mpjax

MOMENTUM = 0.9
FEATURES = 6


def _batch(seed: int, overflow: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # wide dynamic range: magnitudes from 1e-3 to 1e2
    x = rng.standard_normal((16, 5)) * 10.0 ** rng.uniform(-3, 2, (16, 5))
    if overflow:
        x[0, 0], x[7, 2], x[-1, -1] = 1e6, -1e6, 1e6  # first, middle, last: inf in float16
    y = rng.standard_normal((16, FEATURES))
    return x.astype(np.float32), y.astype(np.float32)


def _bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).copy() for x in jax.tree.leaves(tree)]


def _assert_bit_identical(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _expected_mean(old_mean, h):
    """float64 running-mean update: m * momentum + batch_mean * (1 - momentum)."""
    h = np.asarray(h, np.float64)
    return np.asarray(old_mean, np.float64) * MOMENTUM + h.mean(axis=0) * (1 - MOMENTUM)


def _assert_close(got, want, rtol=2e-3):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want) / np.maximum(np.abs(want), 1e-3)
    assert err.max() < rtol, f"relative error {err.max():.3g}"


# --------------------------------------------------------------------------------------- linen
class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(FEATURES, dtype=jnp.float16, param_dtype=jnp.float16, name="dense")(x)
        self.sow("intermediates", "h", h)
        return nn.BatchNorm(
            use_running_average=not train, momentum=MOMENTUM, dtype=jnp.float16, name="bn"
        )(h)


class TrainState(train_state.TrainState):
    batch_stats: dict


def _linen_step(keep: bool):
    model = LinenBN()

    @jax.jit
    def step(state, x, y):
        def loss_fn(p):
            out, upd = model.apply(
                {"params": p, "batch_stats": state.batch_stats},
                x,
                train=True,
                mutable=["batch_stats", "intermediates"],
            )
            loss = jnp.mean((out.astype(jnp.float32) - y) ** 2)
            return mpjax.scale_loss(loss, state.opt_state), upd

        grads, upd = jax.grad(loss_fn, has_aux=True)(state.params)
        new = state.apply_gradients(grads=grads)
        stats = upd["batch_stats"]
        if keep:
            stats = mpjax.keep_if_skipped(stats, state.batch_stats, new.opt_state)
        return new.replace(batch_stats=stats), upd["intermediates"]["h"][0]

    variables = model.init(jax.random.key(0), jnp.zeros((1, 5)), train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=mpjax.loss_scaled(optax.adam(1e-3), mpjax.DynamicLossScale(2.0**10)),
    )
    return step, state


@pytest.mark.parametrize("keep", [True, False], ids=["keep_if_skipped", "naive"])
def test_linen_trainstate_skipped_step_keeps_batch_stats(keep):
    step, state = _linen_step(keep)
    state, _ = step(state, *_batch(1))  # a good step first: stats are not the init values
    before = state.batch_stats
    state2, _ = step(state, *_batch(2, overflow=True))
    assert not bool(mpjax.scaling_metrics(state2.opt_state)["grads_finite"])
    if keep:
        _assert_bit_identical(state2.batch_stats, before)
        _assert_bit_identical(state2.params, state.params)
    else:  # the bug the helper fixes: naive code commits inf/NaN statistics
        assert not np.isfinite(np.asarray(state2.batch_stats["bn"]["mean"])).all()


def test_linen_good_step_updates_running_mean_like_float64():
    step, state = _linen_step(True)
    old = np.asarray(state.batch_stats["bn"]["mean"])
    state2, h = step(state, *_batch(3))
    assert bool(mpjax.scaling_metrics(state2.opt_state)["grads_finite"])
    _assert_close(state2.batch_stats["bn"]["mean"], _expected_mean(old, h))


# ----------------------------------------------------------------------------------------- NNX
class NnxBN(nnx.Module):
    def __init__(self, rngs):
        kw = {"dtype": jnp.float16, "param_dtype": jnp.float16}
        self.dense = nnx.Linear(5, FEATURES, rngs=rngs, **kw)
        self.bn = nnx.BatchNorm(FEATURES, momentum=MOMENTUM, rngs=rngs, **kw)

    def __call__(self, x):
        return self.bn(self.dense(x))


def _nnx_setup(keep: bool):
    model = NnxBN(nnx.Rngs(0))
    tx = mpjax.loss_scaled(optax.adam(1e-3), mpjax.DynamicLossScale(2.0**10))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        stats = mpjax.snapshot_state(model, nnx.BatchStat)

        def loss_fn(m):
            loss = jnp.mean((m(x).astype(jnp.float32) - y) ** 2)
            return mpjax.scale_loss(loss, optimizer.opt_state)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)
        if keep:
            mpjax.restore_if_skipped(model, stats, optimizer.opt_state)

    return model, optimizer, step


def _nnx_arrays(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


@pytest.mark.parametrize("keep", [True, False], ids=["restore_if_skipped", "naive"])
def test_nnx_optimizer_skipped_step_keeps_batchstat(keep):
    model, optimizer, step = _nnx_setup(keep)
    step(model, optimizer, *_batch(1))
    before = _nnx_arrays(model)
    params_before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    step(model, optimizer, *_batch(2, overflow=True))
    metrics = mpjax.scaling_metrics(optimizer.opt_state)
    assert not bool(metrics["grads_finite"])
    if keep:
        _assert_bit_identical(_nnx_arrays(model), before)
        _assert_bit_identical(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params_before)
    else:
        assert not np.isfinite(_nnx_arrays(model)["bn"]["mean"]).all()


def test_nnx_good_step_updates_running_mean_like_float64():
    model, optimizer, step = _nnx_setup(True)
    x, y = _batch(3)
    old = _nnx_arrays(model)["bn"]["mean"]
    h = model.dense(jnp.asarray(x))  # the BatchNorm input, before the step changes the params
    step(model, optimizer, x, y)
    assert bool(mpjax.scaling_metrics(optimizer.opt_state)["grads_finite"])
    _assert_close(_nnx_arrays(model)["bn"]["mean"], _expected_mean(old, h))


# ------------------------------------------------------------------ functional (Haiku/Equinox)
def _apply(params, state, x):
    """Haiku-style `apply(params, state, x) -> (out, new_state)` with a hand-written BatchNorm."""
    h = x.astype(jnp.float16) @ params["w"]
    mean = jnp.mean(h.astype(jnp.float32), axis=0)
    var = jnp.var(h.astype(jnp.float32), axis=0)
    out = (h.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + 1e-5)
    new_state = {
        "mean": state["mean"] * MOMENTUM + mean * (1 - MOMENTUM),
        "var": state["var"] * MOMENTUM + var * (1 - MOMENTUM),
        "count": state["count"] + 1,
    }
    return out, new_state, h


def _functional_setup(keep: bool):
    w = np.random.default_rng(0).standard_normal((5, FEATURES)) * 0.3
    params = {"w": jnp.asarray(w, jnp.float16)}
    state = {
        "mean": jnp.zeros(FEATURES, jnp.float32),
        "var": jnp.ones(FEATURES, jnp.float32),
        "count": jnp.zeros((), jnp.int32),
    }
    tx = mpjax.loss_scaled(optax.sgd(1e-2), mpjax.DynamicLossScale(2.0**10))

    @jax.jit
    def step(params, state, opt_state, x, y):
        def loss_fn(p):
            out, new_state, h = _apply(p, state, x)
            return mpjax.scale_loss(jnp.mean((out - y) ** 2), opt_state), (new_state, h)

        grads, (new_state, h) = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if keep:
            new_state = mpjax.keep_if_skipped(new_state, state, opt_state)
        return params, new_state, opt_state, h

    return params, state, tx.init(params), step


@pytest.mark.parametrize("keep", [True, False], ids=["keep_if_skipped", "naive"])
def test_functional_state_skipped_step_is_bit_identical(keep):
    params, state, opt_state, step = _functional_setup(keep)
    params, state, opt_state, _ = step(params, state, opt_state, *_batch(1))
    params2, state2, opt_state2, _ = step(params, state, opt_state, *_batch(2, overflow=True))
    assert not bool(mpjax.scaling_metrics(opt_state2)["grads_finite"])
    if keep:
        _assert_bit_identical(state2, state)
        _assert_bit_identical(params2, params)
    else:
        assert not np.isfinite(np.asarray(state2["mean"])).all()
        assert int(state2["count"]) == int(state["count"]) + 1


def test_functional_good_step_matches_float64_and_counts():
    params, state, opt_state, step = _functional_setup(True)
    _, state2, opt_state2, h = step(params, state, opt_state, *_batch(4))
    assert bool(mpjax.scaling_metrics(opt_state2)["grads_finite"])
    _assert_close(state2["mean"], _expected_mean(state["mean"], h))
    assert int(state2["count"]) == 1


def test_keep_if_skipped_with_donation_and_inf_loss():
    """An inf injected into the loss also skips; donated old state is still returned intact."""
    tx = mpjax.loss_scaled(optax.sgd(1e-2), mpjax.DynamicLossScale(2.0**4))
    params = {"w": jnp.asarray(np.random.default_rng(5).standard_normal(4), jnp.float16)}
    stats = {"m": jnp.asarray(np.random.default_rng(6).standard_normal(4), jnp.float32)}

    @jax.jit
    def bad(stats, opt_state, params):
        grads = jax.grad(lambda p: jnp.sum(p["w"].astype(jnp.float32)) * jnp.inf)(params)
        _, opt_state = tx.update(grads, opt_state, params)
        return mpjax.keep_if_skipped(jax.tree.map(lambda s: s * jnp.nan, stats), stats, opt_state)

    donated = jax.jit(bad.__wrapped__, donate_argnums=0)
    want = _bits(stats)
    got = donated(jax.tree.map(jnp.copy, stats), tx.init(params), params)
    for x, y in zip(_bits(got), want, strict=True):
        np.testing.assert_array_equal(x, y)


def test_keep_if_skipped_without_loss_scaled_state_names_the_problem():
    with pytest.raises(ValueError, match="loss_scaled"):
        mpjax.keep_if_skipped({"m": jnp.ones(2)}, {"m": jnp.ones(2)}, optax.sgd(0.1).init({}))


def test_restore_if_skipped_rejects_live_nnx_state():
    """`nnx.state(...)` references the live variables: restoring from it would do nothing."""
    model, optimizer, _ = _nnx_setup(True)
    with pytest.raises(ValueError, match="snapshot_state"):
        mpjax.restore_if_skipped(model, nnx.state(model, nnx.BatchStat), optimizer.opt_state)


def test_keep_if_skipped_under_shard_map_keeps_every_device():
    """One device's overflow skips the step on all (axis_name); each keeps its own statistics."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = mpjax.loss_scaled(optax.sgd(1e-2), mpjax.DynamicLossScale(2.0**4), axis_name="data")
    params = {"w": jnp.asarray(np.random.default_rng(7).standard_normal(3), jnp.float16)}
    stats = jnp.asarray(np.random.default_rng(8).standard_normal((n, 3)), jnp.float32)

    def per_device(stats, x):
        opt_state = tx.init(params)
        grads = jax.grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) * x[0]))(params)
        _, opt_state = tx.update(grads, opt_state, params)
        new_stats = stats * 0.9 + x * 0.1
        return mpjax.keep_if_skipped(new_stats, stats, opt_state)

    step = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    x = np.ones((n, 3), np.float32)
    good = np.asarray(step(stats, x))
    np.testing.assert_allclose(good, np.asarray(stats) * 0.9 + 0.1, rtol=1e-6)
    x[n // 2, 0] = np.inf  # a middle device overflows
    _assert_bit_identical(step(stats, x), stats)
