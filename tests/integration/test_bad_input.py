"""Bad input, one test per item of issue 8's list: each error names its culprit.

Already covered elsewhere (not repeated here): unknown keys, unknown and empty entries of a policy
spec (test_policy.test_bad_spec_names_culprit); grads with extra or missing keys
(test_loss_scaled.test_bad_input_errors); int and bool params in a finite step
(test_loss_scaled.test_int_and_bool_params_pass_through); the DynamicLossScale values 0, < 0, inf
and NaN for initial_scale, growth_factor <= 1, backoff_factor in {0, 1, 1.5}, growth_interval 0
(test_loss_scale.test_bad_config_raises_at_construction); helpers on a plain optax state
(test_loss_scaled.test_helpers_find_state_and_errors). The tests below add what those leave open.
"""

import re

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax import DynamicLossScale, Policy, StaticLossScale, get_policy, loss_scaled

INF, NAN = float("inf"), float("nan")


# --- bad policy spec ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, culprit",
    [
        ("p=f32,c=int8", "'int8' in key 'c'"),
        ("params=float32,compute=float8", "'float8' in key 'compute'"),
        ("o=bfloat16x", "'bfloat16x' in key 'o'"),
        ("q=f32", "unknown key 'q'"),
        ("p=f32,c=bf16,", "empty entry"),
    ],
)
def test_bad_policy_spec_names_the_entry(spec, culprit):
    with pytest.raises(ValueError, match=re.escape(culprit)) as err:
        get_policy(spec)
    assert repr(spec) in str(err.value)  # the whole spec is quoted too


# --- non-floating dtype in a policy -------------------------------------------------------------


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize(
    "dtype, name", [(jnp.int32, "int32"), (jnp.bool_, "bool"), ("uint8", "uint8")]
)
def test_non_floating_policy_dtype_names_field_and_dtype(field, dtype, name):
    with pytest.raises(ValueError, match=rf"Policy\.{field}: {name} is not a floating dtype"):
        Policy(**{field: dtype})


def test_policy_dtype_that_is_no_dtype_names_value():
    with pytest.raises(ValueError, match=r"Policy\.compute_dtype: 'float33' is not a dtype"):
        Policy(compute_dtype="float33")


# --- grads tree != params tree ------------------------------------------------------------------


def _tx_state_params():
    params = {"enc": {"w": jnp.ones((2, 3), jnp.bfloat16)}, "dec": jnp.ones((3,), jnp.float32)}
    tx = loss_scaled(optax.adam(1e-2))
    return tx, tx.init(params), params


def test_grads_in_another_container_names_both_sides():
    tx, state, params = _tx_state_params()
    grads = [params["dec"], params["enc"]["w"]]  # a list instead of the dict
    with pytest.raises(ValueError, match="does not match the parameter tree") as err:
        tx.update(grads, state, params)
    assert "in grads only: ['[0]', '[1]']" in str(err.value)
    assert "['enc']['w']" in str(err.value)


def test_grads_with_none_leaf_names_both_structures():
    tx, state, params = _tx_state_params()
    grads = {"enc": {"w": None}, "dec": params["dec"]}
    with pytest.raises(ValueError, match=r"grads PyTreeDef\(.*None.*\) vs params PyTreeDef"):
        tx.update(grads, state, params)


def test_renamed_leaf_names_both_paths_under_jit():
    tx, state, params = _tx_state_params()
    grads = {"enc": {"v": params["enc"]["w"]}, "dec": params["dec"]}
    with pytest.raises(ValueError, match=r"in grads only: \[\"\['enc'\]\['v'\]\"\]") as err:
        jax.jit(tx.update)(grads, state, params)
    assert "in params only: [\"['enc']['w']\"]" in str(err.value)


# --- int or bool leaves in params pass through untouched ---------------------------------------


@pytest.mark.parametrize("master_weights", ["auto", True, False])
@pytest.mark.parametrize("finite", [True, False])
def test_int_and_bool_params_untouched_and_keep_no_master(master_weights, finite):
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4,)), jnp.float16),
        "n": jnp.asarray([3, -1, 7], jnp.int32),
        "flag": jnp.asarray([True, False]),
        "u8": jnp.asarray([255], jnp.uint8),
    }
    tx = loss_scaled(optax.adam(1e-1), master_weights=master_weights)
    state = tx.init(params)
    for leaf in ("n", "flag", "u8"):  # no master copy and no optimizer state for them
        assert not jax.tree.leaves(state.master[leaf])
        assert isinstance(state.inner_state[0].mu[leaf], optax.MaskedNode)
    w_grad = jnp.asarray(rng.normal(size=(4,)) * 100, jnp.float16)
    if not finite:
        w_grad = w_grad.at[-1].set(jnp.nan)
    grads = {k: np.zeros(params[k].shape, jax.dtypes.float0) for k in ("n", "flag", "u8")}
    grads["w"] = w_grad
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    for leaf in ("n", "flag", "u8"):
        assert updates[leaf].dtype == params[leaf].dtype
        chex.assert_trees_all_equal(new[leaf], params[leaf])
    assert bool(state.grads_finite) == finite
    # and the loss-scale helpers leave them as they are
    scaled = mpjax.find_loss_scaled_state(state).loss_scale.scale(params)
    chex.assert_trees_all_equal(
        {k: scaled[k] for k in ("n", "flag", "u8")}, {k: params[k] for k in ("n", "flag", "u8")}
    )


# --- a scale <= 0 or non-finite in a config: ValueError at construction --------------------------


# (test_loss_scale covers initial_scale 0, -1, inf, NaN, 2**30; min_scale 0, 1e-45; max_scale 0.5)
@pytest.mark.parametrize(
    "name, bad",
    [("initial_scale", v) for v in (-INF, 1e-46, 1e39)]
    + [("min_scale", v) for v in (-1.0, -INF, INF, NAN, 1e39)]
    + [("max_scale", v) for v in (0.0, -1.0, -INF, INF, NAN, 1e-46, 1e39)],
)
def test_dynamic_scale_values_refused_at_construction(name, bad):
    kwargs = {name: bad}
    if name == "initial_scale" and bad == 1e39:
        kwargs["max_scale"] = None  # so that only the float32 range refuses it
    with pytest.raises(ValueError, match=rf"DynamicLossScale: {name}"):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize("bad", [0.0, -3.0, INF, -INF, NAN, 1e-46, 1e39])
def test_static_scale_values_refused_at_construction(bad):
    with pytest.raises(ValueError, match=r"StaticLossScale: scale"):
        StaticLossScale(bad)


@pytest.mark.parametrize("bad", ["8", None, [2.0], True, jnp.float32(8.0)])
def test_scale_of_wrong_type_names_the_type(bad):
    with pytest.raises(
        TypeError,
        match=rf"StaticLossScale: scale must be a Python number, got {type(bad).__name__}",
    ):
        StaticLossScale(bad)
    with pytest.raises(
        TypeError, match=rf"initial_scale must be a Python number, got {type(bad).__name__}"
    ):
        DynamicLossScale(initial_scale=bad)


def test_never_validated_inside_jit_unflatten_or_restore():
    """Configuration errors surface at construction only: tracing, unflattening and restoring a
    checkpoint do not validate (leaves may be tracers or placeholders there)."""
    ls = DynamicLossScale(initial_scale=8.0, growth_interval=3, min_scale=2.0)
    treedef = jax.tree.structure(ls)
    odd = jax.tree.unflatten(treedef, [jnp.float32(-1.0), jnp.int32(-5)])  # not validated
    assert float(odd.loss_scale) == -1.0
    out = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert float(out.loss_scale) == 4.0 and out.config == ls.config
    restored = flax.serialization.from_state_dict(ls, {"loss_scale": 0.0, "counter": 1})
    assert float(restored.loss_scale) == 0.0 and restored.config == ls.config


# --- growth_factor <= 1, backoff_factor outside (0, 1), growth_interval < 1 ----------------------


@pytest.mark.parametrize("bad", [0.999, 0.0, -2.0, INF, NAN])  # 1.0, 0.5: test_loss_scale
def test_growth_factor_not_above_one_refused(bad):
    with pytest.raises(ValueError, match="DynamicLossScale: growth_factor"):
        DynamicLossScale(growth_factor=bad)


@pytest.mark.parametrize("bad", [-0.5, 1.0001, 2.0, INF, NAN])  # 0, 1, 1.5: test_loss_scale
def test_backoff_factor_outside_unit_interval_refused(bad):
    with pytest.raises(ValueError, match="DynamicLossScale: backoff_factor"):
        DynamicLossScale(backoff_factor=bad)


@pytest.mark.parametrize(
    "bad, error",
    [
        # 0 and 2.5: test_loss_scale
        (-3, ValueError),
        (np.int64(0), ValueError),
        (2**31, ValueError),
        (True, TypeError),
        (2.0, TypeError),
        ("3", TypeError),
    ],
)
def test_growth_interval_below_one_or_not_int_refused(bad, error):
    with pytest.raises(error, match="DynamicLossScale: growth_interval"):
        DynamicLossScale(growth_interval=bad)


# --- an opt_state without the wrapper given to the helpers --------------------------------------


@pytest.mark.parametrize(
    "helper",
    [
        mpjax.find_loss_scaled_state,
        mpjax.get_loss_scale,
        mpjax.scaling_metrics,
        lambda s: mpjax.scale_loss(jnp.float32(1.0), s),
    ],
)
@pytest.mark.parametrize("kind", ["chain", "train_state", "none"])
def test_helpers_on_state_without_wrapper_name_the_state(helper, kind):
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    tx = optax.chain(optax.clip(1.0), optax.adam(1e-3))
    if kind == "chain":
        state, type_name = tx.init(params), "tuple"
    elif kind == "train_state":
        from flax.training import train_state

        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        type_name = "TrainState"
    else:
        state, type_name = None, "NoneType"
    with pytest.raises(ValueError, match=rf"no mpjax.loss_scaled state found .*\({type_name}\)"):
        helper(state)


def test_update_with_state_of_another_optimizer_names_the_type():
    tx, _, params = _tx_state_params()
    other = optax.adam(1e-2).init(params)
    with pytest.raises(TypeError, match="state must be a LossScaledState, got tuple"):
        tx.update(params, other, params)


# --- Cases the current implementation lets through (see the commit message) -------------------


@pytest.mark.parametrize(
    "name, value",
    [("backoff_factor", 1 - 1e-9), ("growth_factor", 1 + 1e-9)],
)
def test_factor_that_is_one_in_float32_refused(name, value):
    """The scale is computed in float32: a factor that rounds to 1.0 there would never back off
    (or never grow), however valid it looks as a Python float."""
    assert np.float32(value) == 1.0
    with pytest.raises(ValueError, match=f"DynamicLossScale: {name}"):
        DynamicLossScale(**{name: value})


@pytest.mark.parametrize("grad_shape", [(1,), (3, 1), (2,), ()])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_grad_leaf_of_another_shape_names_the_leaf(grad_shape, inner):
    """Same tree structure, one gradient of the wrong shape: an error naming the leaf, not a
    silent broadcast into the master weights and optimizer state."""
    params = {"w": jnp.ones((3,), jnp.bfloat16), "b": jnp.ones((2,), jnp.float32)}
    tx = loss_scaled(optax.sgd(0.1) if inner == "sgd" else optax.adam(0.1))
    state = tx.init(params)
    grads = {"w": jnp.ones(grad_shape, jnp.bfloat16), "b": jnp.ones((2,), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        tx.update(grads, state, params)
