"""Misuse of the loss-scaling API gets the right result or an error naming the culprit and fix.

Each test is a case of issue #27 found at 6a474e7: complex and Python-float gradients, params
changed or promoted after `init`, the JAX training cookbook's `dot_dict` params, and arguments
accepted at construction that failed later (or never).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import mpjax


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):  # noqa: N801 (the JAX training cookbook's name)
    """The JAX training cookbook's params container: attribute access is item access."""

    __setattr__ = dict.__setitem__
    __getattr__ = dict.__getitem__

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values, strict=True))


# --- gradients the finite check could not see -------------------------------------------------


def test_complex_gradient_of_a_real_param_is_refused_eagerly():
    """Eagerly the imaginary part was dropped, and an inf there wrote NaN with grads_finite."""
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    tx = mpjax.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    grads = {"w": jnp.array([1 + 0j, 1j * np.inf], jnp.complex64)}
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(TypeError, match=r"gradient \['w'\] is complex64 .* imaginary part"):
            update(grads, state, params)


def test_python_float_leaves_are_checked():
    assert not bool(mpjax.all_finite({"g": float("inf")}))
    assert not bool(mpjax.all_finite([1.0, float("nan")]))
    assert bool(mpjax.all_finite({"g": 1.0, "n": 3}))


def test_python_float_inf_gradient_is_skipped_eagerly():
    """It used to be applied: the param became -inf and the step counted as finite."""
    params = {"w": jnp.asarray(2.0, jnp.float32)}
    tx = mpjax.loss_scaled(optax.sgd(0.1), mpjax.StaticLossScale(1.0))
    state = tx.init(params)
    updates, state = tx.update({"w": float("inf")}, state, params)
    assert not bool(state.grads_finite) and bool(state.skipped)
    assert float(optax.apply_updates(params, updates)["w"]) == 2.0


# --- params changed after init ------------------------------------------------------------------


def test_state_built_for_float32_params_refuses_float16_params():
    """No master was kept and small updates were lost, silently."""
    tx = mpjax.loss_scaled(optax.adam(1e-3))
    state = tx.init({"w": jnp.ones((4,), jnp.float32)})
    p16 = {"w": jnp.ones((4,), jnp.float16)}
    with pytest.raises(
        ValueError, match=r"built for float32 params: call tx.init again with the float16 params"
    ):
        tx.update(p16, state, p16)


@pytest.mark.parametrize("change", ["renamed", "added", "reshaped"])
def test_params_changed_after_init_say_call_init_again(change):
    params = {"w": jnp.ones((4,), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    tx = mpjax.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)
    new = {
        "renamed": {"w": params["w"], "c": params["b"]},
        "added": {**params, "extra": jnp.ones((3,))},
        "reshaped": {"w": jnp.ones((5,)), "b": params["b"]},
    }[change]
    with pytest.raises(ValueError, match=r"changed after tx.init.*call tx.init again"):
        jax.jit(tx.update)(new, state, new)


def test_master_params_with_wrong_params_names_them():
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    state = mpjax.loss_scaled(optax.sgd(0.1), master_weights="remainder").init(params)
    with pytest.raises(ValueError, match=r"master_params: the params do not match.*\['v'\]"):
        mpjax.master_params(state, {"v": params["w"]})
    with pytest.raises(ValueError, match=r"master_params: param \['w'\] is float32"):
        mpjax.master_params(state, {"w": jnp.ones((2,), jnp.float32)})


# --- `p + u`: loss_scaled's updates are float32; the spelling that keeps dtypes is enforced ----


def _bf16_step_error(mode):
    params = {"w": jnp.full((3,), 1.5, jnp.bfloat16)}
    tx = mpjax.loss_scaled(optax.sgd(1e-2), master_weights=mode)
    state = tx.init(params)
    grads = {"w": jnp.ones((3,), jnp.bfloat16)}
    updates, state = tx.update(grads, state, params)
    promoted = jax.tree.map(lambda p, u: p + u, params, updates)  # the `p + u` spelling
    assert promoted["w"].dtype == jnp.float32
    with pytest.raises(ValueError) as err:
        jax.jit(tx.update)(grads, state, promoted)
    return str(err.value)


@pytest.mark.parametrize("mode", ["auto", "remainder", False])
def test_params_promoted_by_p_plus_u_are_refused_naming_apply_updates(mode):
    """Default mode used to train on at twice the memory; remainder mode: a bare TypeError."""
    msg = _bf16_step_error(mode)
    assert "`p + u`" in msg and "optax.apply_updates(params, updates)" in msg


def test_bf16_updates_cannot_land_exactly_on_the_rounded_master():
    """Why the updates stay float32: for bf16 p and target t, bf16(t - p) often misses t.

    Over every p in [1, 2) and every t in [2**-8, 4), `p + bf16(t - p)` (as bf16 adds) is not
    t for a large share of pairs, so no bf16 update can be exact; float32 `t - p` is.
    """
    bf16 = ml_dtypes.bfloat16
    all_bf16 = np.arange(2**16, dtype=np.uint16).view(bf16).astype(np.float32)
    p = all_bf16[(all_bf16 >= 1) & (all_bf16 < 2)][:, None]
    t = all_bf16[(all_bf16 >= 2**-8) & (all_bf16 < 4)][None, :]
    u_bf16 = (t - p).astype(bf16).astype(np.float32)
    misses = (p + u_bf16).astype(bf16).astype(np.float32) != t
    u_f32 = t - p
    assert np.all((p + u_f32).astype(bf16).astype(np.float32) == t)  # float32: exact
    assert misses.mean() > 0.5  # measured: 0.66 of these pairs


# --- the cookbook's dot_dict --------------------------------------------------------------------


def test_dot_dict_params_work_with_every_state_helper():
    """`__getattr__ = __getitem__` made every helper raise KeyError: 'get_value'."""
    params = dot_dict(w=jnp.ones((2,), jnp.bfloat16), b=jnp.zeros((2,), jnp.float32))
    tx = mpjax.loss_scaled(optax.adam(1e-2))
    state = tx.init(params)

    @jax.jit
    def train_step(params, state, batch_stats):
        def loss(p):
            return mpjax.scale_loss(jnp.sum(p.w.astype(jnp.float32) ** 2) + jnp.sum(p.b), state)

        grads = jax.grad(loss)(params)
        updates, new_state = tx.update(grads, state, params)
        stats = mpjax.keep_if_skipped(dot_dict(mean=batch_stats.mean + 1), batch_stats, new_state)
        return optax.apply_updates(params, updates), new_state, stats

    new_params, state, stats = train_step(params, state, dot_dict(mean=jnp.zeros(2)))
    assert isinstance(new_params, dot_dict) and new_params.w.dtype == jnp.bfloat16
    assert float(new_params.w[0]) < 1.0
    assert float(stats.mean[0]) == 1.0
    assert float(mpjax.get_loss_scale(state)) == 2.0**15
    assert int(mpjax.scaling_metrics(state)["skipped_steps"]) == 0
    assert mpjax.master_params(state, new_params).w.dtype == jnp.float32


# --- construction errors that name the culprit --------------------------------------------------


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: mpjax.DynamicLossScale(growth_interval=2**40), ValueError, r"2\*\*31 - 1"),
        (lambda: mpjax.loss_scaled(optax.sgd(0.1), axis_name=5), TypeError, "axis_name"),
        (
            lambda: mpjax.loss_scaled(optax.sgd(0.1), unscale_and_check=5),
            TypeError,
            "unscale_and_check must be None or a function",
        ),
        (lambda: mpjax.low_precision_state(optax.adam(1e-3), seed=-1), ValueError, r"seed .*-1"),
    ],
    ids=["growth_interval", "axis_name", "unscale_and_check", "seed"],
)
def test_bad_arguments_fail_at_construction(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_low_precision_state_accepts_dtype_names():
    params = {"w": jnp.ones((3,))}
    state = mpjax.low_precision_state(optax.adam(1e-3), dtype="bf16").init(params)
    assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16


def test_float16_optimizer_state_warns_naming_bfloat16():
    """Adam's second moment underflows in float16 (updates grew 1.0e-3 to 1.7e-3 in 3 steps)."""
    with pytest.warns(UserWarning, match=r"float16.*bfloat16"):
        mpjax.low_precision_state(optax.adam(1e-3), jnp.float16, rounding="nearest")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpjax.low_precision_state(optax.adam(1e-3), jnp.bfloat16)


@pytest.mark.parametrize(("dtype", "third"), [(jnp.float16, 1.73e-3), (jnp.bfloat16, 1.0e-3)])
def test_float16_state_lets_adam_updates_grow(dtype, third):
    """Why it warns: with gradients of 1e-4, nu (1e-11) flushes to zero in float16."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tx = mpjax.low_precision_state(optax.adam(1e-3), dtype, rounding="nearest")
    params = {"w": jnp.ones((1,))}
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update({"w": jnp.full((1,), 1e-4)}, state, params)
    np.testing.assert_allclose(-float(updates["w"][0]), third, rtol=0.01)


def test_skips_at_min_scale_diverge_with_a_message_naming_the_fix():
    """fp16 gradients overflowing at scale 1 used to skip forever; the message now says why."""
    params = {"w": jnp.ones((2,), jnp.float16)}
    tx = mpjax.loss_scaled(optax.sgd(0.1), mpjax.DynamicLossScale(initial_scale=4.0))
    state = tx.init(params)
    update = jax.jit(tx.update)
    grads = {"w": jnp.full((2,), jnp.inf, jnp.float16)}
    for _ in range(mpjax.default_max_consecutive_skips(state.loss_scale)):
        _, state = update(grads, state, params)
    assert float(mpjax.get_loss_scale(state)) == 1.0
    with pytest.raises(
        mpjax.TrainingDivergedError, match=r"min_scale=1.*DynamicLossScale\(min_scale="
    ):
        mpjax.raise_if_diverged(state)


def test_loss_scaled_inside_multisteps_is_refused_naming_the_right_order():
    """`MultiSteps(loss_scaled(inner))` accumulates scaled micro-batch gradients unchecked and
    resets its accumulator by multiplying with 0, so one overflow (0 * NaN) skipped every
    later window, silently; every helper that reads the scale now refuses the nesting."""
    params = {"w": jnp.ones(2)}
    wrong = optax.MultiSteps(mpjax.loss_scaled(optax.sgd(0.1)), every_k_schedule=2)
    state = wrong.init(params)
    right_order = r"mpjax\.loss_scaled\(optax\.MultiSteps\(inner, k\)\)"
    for helper in (
        mpjax.get_loss_scale,
        lambda s: mpjax.scale_loss(1.0, s),
        mpjax.scaling_metrics,
        mpjax.raise_if_diverged,
    ):
        with pytest.raises(ValueError, match=right_order):
            helper(state)
    # unchecked (NoOpLossScale: nothing to skip) it is refused by nothing
    noop = optax.MultiSteps(mpjax.loss_scaled(optax.sgd(0.1), mpjax.NoOpLossScale()), 2)
    assert float(mpjax.get_loss_scale(noop.init(params))) == 1.0
    # the right order: an overflowing micro-batch is dropped and the next window steps
    tx = mpjax.loss_scaled(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    state, p = tx.init(params), params
    for g in (jnp.full(2, jnp.inf), jnp.ones(2), jnp.ones(2)):
        updates, state = tx.update({"w": g * mpjax.get_loss_scale(state)}, state, p)
        p = optax.apply_updates(p, updates)
    np.testing.assert_allclose(np.asarray(p["w"]), 1.0 - 0.1, rtol=1e-6)
