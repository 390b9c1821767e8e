"""Half the training-state memory: exact masters in int16 remainders, bf16 optimizer state.

`loss_scaled(master_weights="remainder")` must rebuild the very float32 master that the
default mode keeps, bit for bit, step after step (random updates over many binades,
denormals, signed zeros, inf/NaN skip steps first, middle and last), jitted and not,
sharded; `low_precision_state` must round without bias, deterministically, and resume
bitwise.
"""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.scaling.low_precision import stochastic_round
from mpjax._src.scaling.master import rounded
from mpjax._src.scaling.remainder import join_master, split_master
from tests.helpers.optim import LP_INNERS
from tests.helpers.optim import apply_update as _apply
from tests.helpers.optim import assert_bits_equal as _assert_bits_equal
from tests.helpers.optim import bits as _bits
from tests.helpers.optim import quadratic_run as _quadratic_run

STEPS = 120
SKIPS = {0: np.inf, STEPS // 2: np.nan, STEPS - 1: -np.inf}  # first, middle, last


# ------------------------------------------------------------------- the split and its rounding
def _all_kinds_f32(n: int, seed: int) -> np.ndarray:
    """Random bit patterns (every binade, denormals, NaN, inf) plus the special values."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4028235e38, -3.4028235e38],
        np.float32,
    )
    ties = (np.arange(16, dtype=np.uint32) << 16) | 0x8000  # exact ties, hi even and odd
    return np.concatenate([bits.view(np.float32), special, ties.view(np.float32)])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_split_join_is_exact_on_every_bit_pattern(jit):
    x = _all_kinds_f32(200_000, 0)
    split = jax.jit(split_master) if jit else split_master
    join = jax.jit(join_master) if jit else join_master
    param, rem = split(jnp.asarray(x))
    assert param.dtype == jnp.bfloat16 and rem.dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(join(param, rem)).view(np.uint32), x.view(np.uint32))


def test_param_is_master_rounded_to_nearest_ties_away():
    """The bf16 param is the nearest bf16 (float64 check); on an exact tie, the larger magnitude."""
    x = _all_kinds_f32(200_000, 1)
    x = x[np.isfinite(x)]
    param = np.asarray(split_master(jnp.asarray(x))[0]).astype(np.float64)
    bits = x.view(np.uint32)
    down = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)  # truncation (toward zero)
    up = ((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    err = np.abs(param - x64)
    nearest = np.minimum(np.abs(down - x64), np.abs(up - x64))
    ok = np.isinf(up) | (err == nearest)  # rounding up from the top binade overflows to inf
    assert ok.all(), x[~ok][:5]
    tie = (bits & 0xFFFF) == 0x8000
    assert tie.sum() >= 16
    np.testing.assert_array_equal(np.abs(param[tie]), np.abs(up[tie]))
    # and it differs from round-to-nearest-even only on ties
    rne = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).astype(np.float64)
    assert ((param == rne) | tie | np.isinf(up)).all()


# ------------------------------------------------------------- remainder == float32 master, bits
def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Normal bf16 values over 60 binades, and signed zeros. Not denormal params: XLA:CPU
    # flushes them in `optax.apply_updates`' add (see docs/guides/memory.md); denormal
    # masters are covered bit for bit by the split/join test above.
    w = rng.standard_normal((16, 9)) * 10.0 ** rng.uniform(-30, 30, (16, 9))
    w[0, :2] = [0.0, -0.0]
    b = rng.standard_normal(9) * 10.0 ** rng.uniform(-5, 5, 9)
    return {
        "w": jnp.asarray(w, jnp.bfloat16),
        "b": jnp.asarray(b, jnp.bfloat16),
        "f32": jnp.asarray(rng.standard_normal(5), jnp.float32),  # no master in either mode
        "step": jnp.zeros((), jnp.int32),
    }


def _grads(params, step: int, scale: float):
    rng = np.random.default_rng(1000 + step)

    def one(p):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            return jnp.zeros_like(p)
        g = rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-30, 3, p.shape) * scale
        g.flat[: min(2, g.size)] = [0.0, -0.0][: min(2, g.size)]
        if step in SKIPS:
            g.flat[g.size // 2] = SKIPS[step]
        return jnp.asarray(g, p.dtype)

    return jax.tree.map(one, params)


INNERS = {
    "sgd": lambda: optax.sgd(1.0),  # the updates are the gradients: every binade
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}


def _run(mode, inner, jit, params, shard=None):
    # Eager: a select instead of lax.cond (whose closures recompile every call).
    kw = {} if jit else {"skip_impl": "select", "impl": "xla"}
    tx = mpjax.loss_scaled(
        INNERS[inner](), mpjax.DynamicLossScale(2.0**4), master_weights=mode, **kw
    )

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step) if jit else step
    opt_state = tx.init(params)
    masters, all_params = [], []
    for i in range(STEPS):
        scale = float(mpjax.get_loss_scale(opt_state))
        grads = _grads(params, i, scale)
        if shard is not None:
            grads = shard(grads)
        params, opt_state = step(params, opt_state, grads)
        masters.append(jax.tree.map(np.asarray, mpjax.master_params(opt_state, params)))
        all_params.append(jax.tree.map(np.asarray, params))
    return masters, all_params, opt_state, params


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_remainder_master_is_bit_identical_to_float32_master(inner, jit):
    m32, p32, s32, _ = _run("auto", inner, jit, _params(0))
    mrem, prem, srem, _ = _run("remainder", inner, jit, _params(0))
    assert int(s32.skipped_steps) == int(srem.skipped_steps) >= len(SKIPS)
    for i in range(STEPS):
        _assert_bits_equal(mrem[i], m32[i])
        # the bf16 param the model computes with is the master rounded by the stated rule
        np.testing.assert_array_equal(
            _bits(prem[i]["w"]), _bits(split_master(jnp.asarray(mrem[i]["w"]))[0])
        )
    # the float32 master is stored in 2 bytes per bf16 param instead of 4
    rem = mpjax.find_loss_scaled_state(srem).master
    assert rem["w"].remainder.dtype == jnp.int16 and rem["b"].remainder.dtype == jnp.int16
    assert not jax.tree.leaves(rem["f32"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float32_master_rounds_bf16_params_like_the_remainder_on_exact_ties(jit):
    """Both modes give the same bf16 params on ties, so they train bit for bit alike."""
    # sgd(1.0) moves each master by 2^-8, half a bf16 ulp at 1: exact ties, top half even
    # (+1 and -1: ties away from zero, where nearest-even would keep +-1) and odd.
    params = {"w": jnp.asarray([1.0, -1.0, 1.0078125], jnp.bfloat16)}
    grads = {"w": jnp.asarray([-(2.0**-8), 2.0**-8, -(2.0**-8)], jnp.bfloat16)}
    got = {}
    for mode in ("auto", "remainder"):
        tx = mpjax.loss_scaled(optax.sgd(1.0), mpjax.NoOpLossScale(), master_weights=mode)
        step = jax.jit(_apply, static_argnums=0) if jit else _apply
        new, state = step(tx, params, tx.init(params), grads)
        got[mode] = (new, mpjax.master_params(state, new))
    masters = np.array([1 + 2.0**-8, -(1 + 2.0**-8), 1.0078125 + 2.0**-8], np.float32)
    np.testing.assert_array_equal(np.asarray(got["auto"][1]["w"]), masters)
    want = np.array([1.0078125, -1.0078125, 1.015625], np.float32)
    np.testing.assert_array_equal(np.asarray(got["auto"][0]["w"], np.float32), want)
    _assert_bits_equal(got["auto"], got["remainder"])


def test_float32_master_keeps_a_nan_master_a_nan_param():
    # Top half 0x7FFF with a low half >= 0x8000: rounding up by bits would carry into -0.0.
    nan = jnp.asarray(np.array([0x7FFFFFFF], np.uint32).view(np.float32))
    master = jnp.zeros((1,), jnp.float32)
    param = rounded(jnp.zeros((1,), jnp.bfloat16), master, nan)
    assert param.dtype == jnp.bfloat16 and bool(jnp.isnan(param).all())


def test_remainder_skips_keep_params_and_remainders_bit_identical():
    tx = mpjax.loss_scaled(optax.sgd(1.0), master_weights="remainder")
    params = _params(3)
    state = tx.init(params)
    params, state = jax.jit(lambda p, s, g: _apply(tx, p, s, g))(
        params, state, _grads(params, 5, 1.0)
    )
    before = (params, mpjax.find_loss_scaled_state(state).master)
    bad = _grads(params, 0, 1.0)  # holds an inf
    params2, state2 = _apply(tx, params, state, bad)
    assert bool(mpjax.scaling_metrics(state2)["skipped"])
    _assert_bits_equal((params2, mpjax.find_loss_scaled_state(state2).master), before)


def test_remainder_sharded_over_8_devices_matches_and_keeps_sharding():
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8
    mesh = Mesh(devices, ("data",))
    spec = {"w": P("data", None), "b": P(), "f32": P(), "step": P()}

    def shard(tree):
        return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, spec)

    want, _, _, _ = _run("auto", "adamw", True, _params(0))
    got, _, state, params = _run("remainder", "adamw", True, shard(_params(0)), shard)
    for a, b in zip(got, want, strict=True):
        _assert_bits_equal(a, b)
    rem = mpjax.find_loss_scaled_state(state).master["w"].remainder
    assert rem.sharding.is_equivalent_to(NamedSharding(mesh, spec["w"]), rem.ndim)
    assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, spec["w"]), 2)


def test_remainder_checkpoint_round_trip_resumes_bitwise():
    tx = mpjax.loss_scaled(optax.adamw(1e-2), master_weights="remainder")
    step = jax.jit(lambda p, s, g: _apply(tx, p, s, g))
    params = _params(4)
    state = tx.init(params)
    for i in range(1, 6):
        params, state = step(params, state, _grads(params, i, float(mpjax.get_loss_scale(state))))
    blob = flax.serialization.to_bytes((params, state))
    restored = flax.serialization.from_bytes((params, tx.init(params)), blob)
    runs = []
    for p, s in ((params, state), restored):
        for i in range(6, 11):
            p, s = step(p, s, _grads(p, i, float(mpjax.get_loss_scale(s))))
        runs.append((p, mpjax.master_params(s, p)))
    _assert_bits_equal(runs[0], runs[1])


def test_master_params_in_every_mode():
    params = {"h": jnp.asarray([1.5, -2.0], jnp.bfloat16), "f": jnp.ones(2), "i": jnp.ones(2, int)}
    for mode in ("auto", True, False, "remainder"):
        m = mpjax.master_params(
            mpjax.loss_scaled(optax.sgd(0.1), master_weights=mode).init(params), params
        )
        assert m["h"].dtype == jnp.float32 and m["f"].dtype == jnp.float32
        assert m["i"].dtype == params["i"].dtype
        np.testing.assert_array_equal(np.asarray(m["h"]), [1.5, -2.0])


def test_bad_master_weights_names_the_choices():
    with pytest.raises(ValueError, match="remainder"):
        mpjax.loss_scaled(optax.sgd(0.1), master_weights="half")


# -------------------------------------------------------------------------- low precision state
def test_stochastic_round_is_unbiased():
    """Mean of many roundings matches the float32 value within 5 standard errors (float64)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(64) * 10.0 ** rng.uniform(-20, 20, 64)).astype(np.float32)
    draws = np.stack(
        [
            np.asarray(stochastic_round(jnp.asarray(x), jnp.uint32(s))).astype(np.float64)
            for s in range(2000)
        ]
    )
    bits = x.view(np.uint32)
    down = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)
    ulp = np.abs(((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64) - down)
    assert np.isin(draws, np.stack([down, down + np.sign(x) * ulp])).all()  # a neighbour only
    p = np.abs(x.astype(np.float64) - down) / ulp
    se = ulp * np.sqrt(np.maximum(p * (1 - p), 1e-12) / len(draws))
    err = np.abs(draws.mean(0) - x.astype(np.float64))
    assert (err <= 5 * se + 1e-30).all(), (err / se).max()


def test_stochastic_round_is_deterministic_given_seed():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(4096), jnp.float32)
    a, b = stochastic_round(x, jnp.uint32(7)), jax.jit(stochastic_round)(x, jnp.uint32(7))
    _assert_bits_equal(a, b)
    assert (np.asarray(a) != np.asarray(stochastic_round(x, jnp.uint32(8)))).any()


@pytest.mark.parametrize("name", sorted(LP_INNERS))
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_low_precision_state_stores_bf16_and_trains(name, rounding):
    f32_loss, _ = _quadratic_run(LP_INNERS[name]())
    loss, state = _quadratic_run(mpjax.low_precision_state(LP_INNERS[name](), rounding=rounding))
    floats = [
        x for x in jax.tree.leaves(state.inner_state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    start, _ = _quadratic_run(LP_INNERS[name](), steps=0)
    assert loss < 0.5 * start and abs(loss - f32_loss) <= 0.1 * start


RESUMED_STATES = {
    "bfloat16": lambda: mpjax.low_precision_state(optax.adamw(1e-2), seed=3),
    "int8": lambda: mpjax.low_precision_state(
        optax.adamw(1e-2), jnp.int8, "stochastic", seed=3, block_size=32
    ),
}


@pytest.mark.parametrize("dtype", sorted(RESUMED_STATES))
def test_low_precision_state_resume_is_bitwise_identical(dtype):
    tx = RESUMED_STATES[dtype]()
    _, state20 = _quadratic_run(tx, steps=20)
    params = {"w": jnp.zeros((16, 8))}
    # run 10, checkpoint, restore into a fresh state, run 10 more
    target = jnp.asarray(np.random.default_rng(2).standard_normal((16, 8)), jnp.float32)

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda q: jnp.mean((q["w"] - target) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for _ in range(10):
        params, state = step(params, state)
    params, state = flax.serialization.from_bytes(
        (params, tx.init(params)), flax.serialization.to_bytes((params, state))
    )
    for _ in range(10):
        params, state = step(params, state)
    _assert_bits_equal(state, state20)


def test_low_precision_state_inside_loss_scaled_skip_is_bit_identical():
    tx = mpjax.loss_scaled(mpjax.low_precision_state(optax.adamw(1e-2)), master_weights="remainder")
    params = {"w": jnp.asarray(np.random.default_rng(4).standard_normal((8, 8)), jnp.bfloat16)}
    state = tx.init(params)
    good = {"w": jnp.full((8, 8), 100.0, jnp.bfloat16)}
    params, state = _apply(tx, params, state, good)
    before = (params, state.inner_state, state.master)
    params2, state2 = _apply(tx, params, state, {"w": good["w"].at[3, 3].set(jnp.nan)})
    assert bool(state2.skipped)
    _assert_bits_equal((params2, state2.inner_state, state2.master), before)


def test_adamw_state_is_8_bytes_per_param_with_exact_master():
    """bf16 params + int16 remainders + bf16 mu and nu: 8 bytes per param (a structural fact)."""
    params = {"w": jnp.zeros((256, 128), jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
    tx = mpjax.loss_scaled(mpjax.low_precision_state(optax.adamw(1e-3)), master_weights="remainder")
    state = tx.init(params)
    n = sum(x.size for x in jax.tree.leaves(params))
    big = lambda t: sum(x.nbytes for x in jax.tree.leaves(t) if x.size > 1)  # noqa: E731
    assert (big(params) + big(state)) / n == 8.0


def test_low_precision_state_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match="rounding"):
        mpjax.low_precision_state(optax.adam(1e-3), rounding="up")
    with pytest.raises(ValueError, match="bfloat16"):
        mpjax.low_precision_state(optax.adam(1e-3), dtype=jnp.float16)
    with pytest.raises(TypeError, match="floating"):
        mpjax.low_precision_state(optax.adam(1e-3), dtype=jnp.int16, rounding="nearest")
