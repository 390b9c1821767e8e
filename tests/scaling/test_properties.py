"""Property tests (hypothesis) of the loss-scale algorithm and the `loss_scaled` wrapper.

Generated cases: random sequences of finite / inf / NaN gradients injected at random leaves and
positions, random param dtypes per leaf (fp16, bf16, fp32), random scale configurations and
states, random `master_weights`. Every trajectory is checked against a plain-numpy reference model
of the algorithm written here from its specification (float32 arithmetic emulated with numpy
float32), and against the invariants: params and master weights stay finite, a skipped step leaves
the inner state, master and params bit-identical, the scale stays in [min_scale, max_scale] and is
never 0, inf or NaN.

A `DynamicLossScale` configuration is static (it lives in the tree definition), so every distinct
configuration compiles the update again. The wrapper tests therefore draw the configuration from a
fixed pool of setups, each compiled once (a whole trajectory is one `lax.scan`), and randomise the
numeric state (initial scale, counter), data and faults; `test_adjust_random_config_*` draws fully
random configurations and runs `adjust` eagerly.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import mpjax
from mpjax import DynamicLossScale, StaticLossScale, loss_scaled

T = 12  # steps per generated trajectory
# A power of two: `lr * g` is then exact, so XLA contracting `master - lr * g` into an FMA (it
# does on CPU) rounds exactly like the reference's separate multiply and add.
LR = 0.125
F16, BF16, F32 = np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32)
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

# Three floating leaves (one nested) and an int leaf that must pass through untouched.
NAMES = ("a", "k", "c")
SHAPES = {"a": (3,), "k": (2, 3), "c": (1,)}
INT_LEAF = np.asarray([7, -2], np.int32)

# (growth_interval, growth_factor, backoff_factor, min_scale, max_scale)
DYNAMIC_CONFIGS = (
    (1, 2.0, 0.5, 1.0, 2.0**24),
    (2, 2.0, 0.5, 1.0, 2.0**10),
    (3, 4.0, 0.25, 2.0**-4, 2.0**16),
    (2, 1.5, 0.8, 3.0, None),  # factors that are not powers of two, no cap
    (5, 3.0, 0.125, 0.5, 2.0**30),
)
# "unscaled" is StaticLossScale(1.0): no scaling, non-finite steps skipped (NoOpLossScale does
# not check at all; tests/scaling/test_scaling_config.py covers it).
LS_KEYS = (("unscaled",), ("static",)) + tuple(("dynamic", *c) for c in DYNAMIC_CONFIGS)
DTYPE_SETS = (
    (F16, F16, F16),
    (BF16, BF16, BF16),
    (F32, F32, F32),
    (F16, BF16, F32),
    (BF16, F32, F16),
    (F32, F16, BF16),
)
MASTERS = ("auto", True, False)


@dataclasses.dataclass(frozen=True)
class Setup:
    """The static part of a case: one compiled trajectory function per setup."""

    dtypes: tuple
    master: bool | str
    ls: tuple
    inner: str
    skip_impl: str = "cond"  # loss_scaled(skip_impl=...): both must give the same results
    check_new_values: bool | str = "auto"


# Every loss-scale config (dynamic ones with two master settings), the dtype sets, both skip
# implementations and both new-value checks rotating through.
SGD_SETUPS = tuple(
    Setup(
        DTYPE_SETS[(2 * j + m) % len(DTYPE_SETS)],
        MASTERS[(j + m) % len(MASTERS)],
        ls,
        "sgd",
        skip_impl=("cond", "select")[(j + m) % 2],
        check_new_values=("auto", True)[j % 2],
    )
    for j, ls in enumerate(LS_KEYS)
    for m in range(2 if ls[0] == "dynamic" else 1)
)
STATEFUL_SETUPS = (
    Setup(DTYPE_SETS[0], "auto", LS_KEYS[2], "momentum", "select", True),
    Setup(DTYPE_SETS[4], False, LS_KEYS[1], "momentum", "cond", "auto"),
    Setup(DTYPE_SETS[3], True, LS_KEYS[3], "adam", "cond", True),
    Setup(DTYPE_SETS[1], "auto", LS_KEYS[5], "adam", "select", "auto"),
    Setup(DTYPE_SETS[5], True, LS_KEYS[4], "clip_adamw", "select", "auto"),
    Setup(DTYPE_SETS[2], False, LS_KEYS[0], "clip_adamw", "cond", True),
)


def _inner(name: str) -> optax.GradientTransformation:
    return {
        "sgd": lambda: optax.sgd(LR),
        "momentum": lambda: optax.sgd(LR, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
        "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    }[name]()


def _make_loss_scale(key: tuple, scale: float):
    if key[0] == "unscaled":
        return StaticLossScale(1.0)
    if key[0] == "static":
        return StaticLossScale(scale)
    interval, growth, backoff, lo, hi = key[1:]
    return DynamicLossScale(
        initial_scale=scale,
        growth_interval=interval,
        growth_factor=growth,
        backoff_factor=backoff,
        min_scale=lo,
        max_scale=hi,
    )


def _with_scale_state(loss_scale, scale, counter):
    """`loss_scale` with the given numeric state (traced), configuration unchanged."""
    if isinstance(loss_scale, DynamicLossScale):
        return loss_scale.replace(loss_scale=scale, counter=counter)
    if isinstance(loss_scale, StaticLossScale):
        return jax.tree.unflatten(jax.tree.structure(loss_scale), [scale])
    return loss_scale


def _nest(flat: dict, n=INT_LEAF) -> dict:
    return {"a": flat["a"], "b": {"k": flat["k"]}, "c": flat["c"], "n": n}


def _flat(tree: dict) -> dict:
    return {"a": tree["a"], "k": tree["b"]["k"], "c": tree["c"]}


@functools.cache
def _compiled(setup: Setup):
    """The whole T-step trajectory of a setup (init included), jitted once per setup."""
    # Any valid scale: each case brings its own numeric loss-scale state.
    loss_scale = _make_loss_scale(setup.ls, setup.ls[4] if setup.ls[0] == "dynamic" else 4.0)
    tx = loss_scaled(
        _inner(setup.inner),
        loss_scale,
        master_weights=setup.master,
        skip_impl=setup.skip_impl,
        check_new_values=setup.check_new_values,
    )
    float0 = np.zeros(INT_LEAF.shape, jax.dtypes.float0)

    def run(params, scale0, counter0, true_grads, masks, values):
        state = tx.init(params)
        state = state._replace(loss_scale=_with_scale_state(state.loss_scale, scale0, counter0))

        def step(carry, xs):
            params, state = carry
            tg, mask, value = xs
            scale = state.loss_scale.loss_scale
            flat = _flat(params)
            # the gradient of a scaled loss, in the param dtype, with faults injected
            grads = {
                k: jnp.where(
                    mask[k], value[k].astype(flat[k].dtype), (tg[k] * scale).astype(flat[k].dtype)
                )
                for k in NAMES
            }
            updates, state = tx.update(_nest(grads, float0), state, params)
            params = optax.apply_updates(params, updates)
            return (params, state), (params, state)

        trajectory = jax.lax.scan(step, (params, state), (true_grads, masks, values))[1]
        return state, trajectory

    return jax.jit(run)


@dataclasses.dataclass(frozen=True)
class Case:
    setup: Setup
    scale0: float
    counter0: int
    seed: int
    magnitudes: tuple  # per step: how large the true gradients are (0: all zero)
    faults: tuple  # per step: a tuple of (leaf, position, value)
    at_top: bool = False  # fp16 params start at +-65504, where a finite step can overflow


FAULT = st.tuples(
    st.sampled_from(NAMES),
    st.one_of(st.just(0), st.just(-1), st.integers(0, 6)),  # first, last, anywhere
    st.sampled_from((np.inf, -np.inf, np.nan)),
)


def _step_faults(draw, density: int) -> tuple:
    if draw(st.integers(0, 9)) >= density:
        return ()
    return tuple(draw(st.lists(FAULT, min_size=1, max_size=3)))


@st.composite
def cases(draw, setups):
    setup = draw(st.sampled_from(setups))
    counter0 = 0
    if setup.ls[0] == "unscaled":
        scale0 = 1.0
    elif setup.ls[0] == "static":
        scale0 = draw(st.one_of(st.sampled_from((1.0, 2.0**15)), st.floats(2.0**-6, 2.0**20)))
    else:
        interval, _, _, lo, hi = setup.ls[1:]
        top = F32_MAX if hi is None else hi
        scale0 = draw(st.one_of(st.sampled_from((lo, top)), st.floats(lo, top)))
        counter0 = draw(st.integers(0, interval - 1))
    density = draw(st.sampled_from((0, 1, 3, 7, 10)))  # in tenths: how many steps get faults
    return Case(
        setup=setup,
        scale0=scale0,
        counter0=counter0,
        seed=draw(st.integers(0, 2**32 - 1)),
        magnitudes=tuple(
            draw(st.lists(st.sampled_from((1e-2, 1.0, 1e2, 0.0)), min_size=T, max_size=T))
        ),
        faults=tuple(_step_faults(draw, density) for _ in range(T)),
        at_top=draw(st.booleans()),
    )


def _data(case: Case):
    """Initial params, true (unscaled, float32) gradients, fault masks and fault values."""
    rng = np.random.default_rng(case.seed)
    dtypes = dict(zip(NAMES, case.setup.dtypes, strict=True))
    params = {k: rng.normal(size=SHAPES[k]).astype(dtypes[k]) for k in NAMES}
    mags = np.asarray(case.magnitudes, np.float32)
    true_grads, masks, values = {}, {}, {}
    for k in NAMES:
        tg = rng.normal(size=(T, *SHAPES[k])).astype(np.float32)
        true_grads[k] = tg * mags.reshape((T,) + (1,) * len(SHAPES[k]))
        masks[k] = np.zeros((T, *SHAPES[k]), bool)
        values[k] = np.zeros((T, *SHAPES[k]), np.float32)
    if case.at_top:
        for k in NAMES:
            if dtypes[k] == F16:
                top = np.finfo(np.float16).max * rng.choice([-1, 1])
                params[k].reshape(-1)[0] = top
    for t, faults in enumerate(case.faults):
        for leaf, pos, value in faults:
            size = int(np.prod(SHAPES[leaf]))
            masks[leaf][t].reshape(-1)[pos % size] = True
            values[leaf][t].reshape(-1)[pos % size] = value
    return params, true_grads, masks, values


def _keeps_master(setup: Setup, dtype: np.dtype) -> bool:
    return setup.master is True or (setup.master == "auto" and dtype.itemsize < 4)


def _unscale(g: np.ndarray, scale: np.float32) -> np.ndarray:
    """GradScaler's unscale: a multiply by the float32 reciprocal, rounded once; a scale above
    2**126 (subnormal reciprocal) goes through a quarter first."""
    p = np.float32(0.25 if scale > 2.0**126 else 1.0)
    return (g * p) * (np.float32(1) / (scale * p))


def reference_model(case: Case, params, true_grads, masks, values):
    """The algorithm in plain numpy, float32 arithmetic, SGD inner; one record per step.

    Per step: gradients of the scaled loss are `true_grad * scale` rounded to the param dtype
    (faults overwrite them); they are unscaled in float32; the gradients are finite iff every
    unscaled value is. The candidate new master is `master - lr * g` (master: the float32 copy
    where one is kept, else the param widened; a float32 param with a float32 master lands on
    `p + ((master - lr * g) - p)`, the sum the caller forms); each param's new value is its
    candidate rounded to the param dtype. The step is taken iff the gradients and the checked
    new values (float16 ones for `check_new_values="auto"`, all for True) are finite; otherwise
    nothing changes but the counters. The loss scale adjusts on the
    gradients' finiteness: taken steps count up and grow the scale by `growth_factor` every
    `growth_interval` (capped at `max_scale`, and kept as is if it would become inf), non-finite
    steps multiply it by `backoff_factor` (not below `min_scale`) and reset the count; a step
    skipped only for an overflowing new value leaves the scale and its count as they were.
    """
    setup = case.setup
    dtypes = dict(zip(NAMES, setup.dtypes, strict=True))
    keep = {k: _keeps_master(setup, dtypes[k]) for k in NAMES}
    params = {k: v.copy() for k, v in params.items()}
    master = {k: params[k].astype(np.float32) for k in NAMES if keep[k]}
    scale, counter = np.float32(case.scale0), case.counter0
    skipped = consecutive = 0
    records = []
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(T):
            unscaled = {}
            for k in NAMES:
                g = (true_grads[k][t] * scale).astype(dtypes[k])
                g[masks[k][t]] = values[k][t][masks[k][t]].astype(dtypes[k])
                unscaled[k] = _unscale(g.astype(np.float32), scale)
            finite = all(bool(np.all(np.isfinite(u))) for u in unscaled.values())
            candidates = {}
            for k in NAMES:
                view = master[k] if keep[k] else params[k].astype(np.float32)
                new = view + np.float32(-LR) * unscaled[k]
                if keep[k] and dtypes[k] == F32:
                    new = params[k] + (new - params[k])
                candidates[k] = new
            checked = [
                c.astype(dtypes[k])
                for k, c in candidates.items()
                if setup.check_new_values is True or dtypes[k] == F16
            ]
            taken = finite and all(bool(np.all(np.isfinite(c))) for c in checked)
            if taken:
                for k in NAMES:
                    if keep[k]:
                        master[k] = candidates[k]
                    params[k] = candidates[k].astype(dtypes[k])
                consecutive = 0
            else:
                skipped += 1
                consecutive += 1
            if setup.ls[0] == "dynamic":
                interval, growth, backoff, lo, hi = setup.ls[1:]
                if finite and not taken:
                    pass  # a new-value skip: neither a good step nor a backoff (issue 20, item 9)
                elif finite:
                    counter += 1
                    if counter >= interval:
                        grown = scale * np.float32(growth)
                        if hi is not None:
                            grown = min(grown, np.float32(hi))
                        if np.isfinite(grown):
                            scale = grown
                        counter = 0
                else:
                    scale = max(scale * np.float32(backoff), np.float32(lo))
                    counter = 0
            records.append(
                dict(
                    finite=finite,
                    taken=taken,
                    scale=scale,
                    counter=counter,
                    skipped=skipped,
                    consecutive=consecutive,
                    params={k: v.copy() for k, v in params.items()},
                    master={k: v.copy() for k, v in master.items()},
                )
            )
    return records


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _assert_bits_equal(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype, what
        assert np.array_equal(_bits(x), _bits(y)), what


def _at(tree, t):
    return jax.tree.map(lambda x: x[t], tree)


def _run(case: Case):
    params, true_grads, masks, values = _data(case)
    scale0, counter0 = np.float32(case.scale0), np.int32(case.counter0)
    out = _compiled(case.setup)(_nest(params), scale0, counter0, true_grads, masks, values)
    state0, (out_params, out_state) = jax.device_get(out)
    return params, true_grads, masks, values, state0, out_params, out_state


def _check_invariants(case: Case, params0, state0, out_params, out_state):
    """The invariants every trajectory must hold, whatever the inner optimizer."""
    setup = case.setup
    dtypes = dict(zip(NAMES, setup.dtypes, strict=True))
    kind = setup.ls[0]
    scales = np.asarray(out_state.loss_scale.loss_scale, np.float32)
    scales = np.broadcast_to(scales, (T,))
    assert np.all(np.isfinite(scales)) and np.all(scales > 0), scales
    if kind == "dynamic":
        interval, _, _, lo, hi = setup.ls[1:]
        assert np.all(scales >= np.float32(lo)), (scales, lo)
        assert np.all(scales <= np.float32(F32_MAX if hi is None else hi)), (scales, hi)
        counters = np.asarray(out_state.loss_scale.counter)
        assert np.all((counters >= 0) & (counters < interval)), counters
    else:
        assert np.all(scales == np.float32(case.scale0))

    for k in NAMES:  # master kept exactly where the setting says, float32
        m = _flat(out_state.master)[k]
        if _keeps_master(setup, dtypes[k]):
            assert np.asarray(m).dtype == F32
        else:
            assert not jax.tree.leaves(m)

    prev_params, prev_inner, prev_master = _nest(params0), state0.inner_state, state0.master
    for t in range(T):
        params_t = _at(out_params, t)
        master_t = _at(out_state.master, t)
        inner_t = _at(out_state.inner_state, t)
        for leaf in jax.tree.leaves((_flat(params_t), master_t)):
            assert np.all(np.isfinite(np.asarray(leaf, np.float32))), f"non-finite at step {t}"
        assert np.array_equal(params_t["n"], INT_LEAF)
        assert np.asarray(params_t["a"]).dtype == dtypes["a"]
        skipped_before = int(out_state.skipped_steps[t - 1]) if t else 0
        if int(out_state.skipped_steps[t]) > skipped_before:
            _assert_bits_equal(inner_t, prev_inner, f"inner state changed on skipped step {t}")
            _assert_bits_equal(master_t, prev_master, f"master changed on skipped step {t}")
            _assert_bits_equal(params_t, prev_params, f"params changed on skipped step {t}")
        for k in NAMES:  # every param that keeps a master sits exactly on it
            if _keeps_master(setup, dtypes[k]):
                p, m = _flat(params_t)[k], _flat(master_t)[k]
                assert np.array_equal(_bits(p), _bits(np.asarray(m).astype(dtypes[k])))
        prev_params, prev_inner, prev_master = params_t, inner_t, master_t


def _coverage_events(case: Case, records) -> None:
    """Labels for `pytest --hypothesis-show-statistics`: what the generated cases exercised."""
    n_skipped = records[-1]["skipped"]
    if any(r["finite"] and not r["taken"] for r in records):
        event("a skip from overflow of the new params (finite gradients)")
    event(f"skipped steps: {'none' if n_skipped == 0 else 'all' if n_skipped == T else 'some'}")
    injected = [bool(f) for f in case.faults]
    if any(not r["finite"] and not inj for r, inj in zip(records, injected, strict=True)):
        event("a skip from overflow of the scaled gradient (no injected fault)")
    if case.setup.ls[0] == "dynamic":
        lo, hi = case.setup.ls[4], case.setup.ls[5]
        scales = [r["scale"] for r in records]
        if min(scales) == np.float32(lo):
            event("scale reached min_scale")
        if hi is not None and max(scales) == np.float32(hi):
            event("scale reached max_scale")
        with np.errstate(over="ignore"):
            if hi is None and not np.isfinite(max(scales) * np.float32(case.setup.ls[2])):
                event("growth would have overflowed float32")


def _check_counters_against_reference(case: Case, out_state, records):
    _coverage_events(case, records)
    scales = np.broadcast_to(np.asarray(out_state.loss_scale.loss_scale, np.float32), (T,))
    for t, rec in enumerate(records):
        assert bool(out_state.grads_finite[t]) == rec["finite"], t
        assert int(out_state.skipped_steps[t]) == rec["skipped"], t
        assert int(out_state.consecutive_skips[t]) == rec["consecutive"], t
        assert scales[t] == rec["scale"], (t, scales[t], rec["scale"])
        if case.setup.ls[0] == "dynamic":
            assert int(out_state.loss_scale.counter[t]) == rec["counter"], t


# A scale at the top of float32 and all-zero gradients: growth would overflow to inf.
GROWTH_OVERFLOW_CASE = Case(
    setup=next(s for s in SGD_SETUPS if s.ls[0] == "dynamic" and s.ls[5] is None),
    scale0=F32_MAX,
    counter0=0,
    seed=0,
    magnitudes=(0.0,) * T,
    faults=((),) * T,
)
# fp16 params at the top of their range, large finite gradients: some steps overflow the params.
PARAM_OVERFLOW_CASE = Case(
    setup=SGD_SETUPS[0],  # fp16 leaves, no loss scaling
    scale0=1.0,
    counter0=0,
    seed=1,
    magnitudes=(1e2,) * T,
    faults=((),) * T,
    at_top=True,
)


@settings(max_examples=400)
@given(case=cases(SGD_SETUPS))
@example(case=GROWTH_OVERFLOW_CASE)
@example(case=PARAM_OVERFLOW_CASE)
def test_sgd_trajectory_equals_reference_model_and_invariants_hold(case):
    params0, true_grads, masks, values, state0, out_params, out_state = _run(case)
    records = reference_model(case, params0, true_grads, masks, values)
    _check_counters_against_reference(case, out_state, records)
    for t, rec in enumerate(records):
        got = _flat(_at(out_params, t))
        got_master = _flat(_at(out_state.master, t))
        for k in NAMES:
            assert np.array_equal(_bits(got[k]), _bits(rec["params"][k])), (t, k)
            if k in rec["master"]:
                assert np.array_equal(_bits(got_master[k]), _bits(rec["master"][k])), (t, k)
    _check_invariants(case, params0, state0, out_params, out_state)


def _counts(inner_state) -> list[int]:
    """The `count` leaves of an optax state (Adam keeps one), as ints per step."""
    return [
        np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(inner_state)[0]
        if getattr(path[-1], "name", None) == "count"
    ]


@settings(max_examples=200)
@given(case=cases(STATEFUL_SETUPS))
def test_stateful_inner_untouched_on_skips_and_invariants_hold(case):
    params0, true_grads, masks, values, state0, out_params, out_state = _run(case)
    # the skip decisions and the scale trajectory do not depend on the inner optimizer
    records = reference_model(case, params0, true_grads, masks, values)
    _check_counters_against_reference(case, out_state, records)
    _check_invariants(case, params0, state0, out_params, out_state)
    finite_steps = np.arange(1, T + 1) - np.asarray(out_state.skipped_steps)
    counts = _counts(out_state.inner_state)
    if case.setup.inner != "momentum":
        assert counts, "adam keeps a step count"
    for count in counts:  # the inner optimizer saw exactly the finite steps
        assert np.array_equal(count, finite_steps)


@st.composite
def dynamic_configs(draw):
    lo = draw(st.one_of(st.just(F32_TINY), st.floats(F32_TINY, 1e4)))
    hi = draw(st.one_of(st.none(), st.just(F32_MAX), st.floats(lo, F32_MAX)))
    top = F32_MAX if hi is None else hi
    initial = draw(st.one_of(st.sampled_from((lo, top)), st.floats(lo, top)))
    return dict(
        initial_scale=initial,
        growth_interval=draw(st.integers(1, 6)),
        # valid in float32, where the scale is computed: growth > 1 and backoff < 1 there
        growth_factor=draw(st.floats(1.0 + 2.0**-23, 1e3)),
        backoff_factor=draw(st.floats(F32_TINY, 1.0 - 2.0**-24)),
        min_scale=lo,
        max_scale=hi,
    )


@settings(max_examples=260)
@given(
    cfg=dynamic_configs(),
    finite_seq=st.lists(st.booleans(), min_size=1, max_size=24),
)
@example(  # growth without a cap would overflow float32
    cfg=dict(
        initial_scale=F32_MAX / 3,
        growth_interval=2,
        growth_factor=4.0,
        backoff_factor=0.5,
        min_scale=1.0,
        max_scale=None,
    ),
    finite_seq=[True, True, False, True, True, True],
)
def test_adjust_random_config_matches_float32_reference_and_stays_in_bounds(cfg, finite_seq):
    ls = DynamicLossScale(**cfg)
    lo = np.float32(cfg["min_scale"])
    hi = np.float32(F32_MAX if cfg["max_scale"] is None else cfg["max_scale"])
    scale, counter = np.float32(cfg["initial_scale"]), 0
    with np.errstate(over="ignore"):
        for finite in finite_seq:
            ls = ls.adjust(jnp.asarray(finite))
            if finite:
                counter += 1
                if counter >= cfg["growth_interval"]:
                    grown = scale * np.float32(cfg["growth_factor"])
                    if cfg["max_scale"] is not None:
                        grown = min(grown, hi)
                    if not np.isfinite(grown):
                        event("growth would have overflowed float32")
                    scale = grown if np.isfinite(grown) else scale
                    counter = 0
            else:
                scale, counter = max(scale * np.float32(cfg["backoff_factor"]), lo), 0
            got = np.float32(ls.loss_scale)
            assert got == scale, (got, scale)
            assert int(ls.counter) == counter
            assert np.isfinite(got) and got > 0 and lo <= got <= hi
            assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
    assert ls.config == DynamicLossScale(**cfg).config


REPORT_DTYPES = DTYPE_SETS


@functools.cache
def _report_fn():
    return jax.jit(lambda tree: (mpjax.nonfinite_report(tree), mpjax.all_finite(tree)))


@settings(max_examples=160)
@given(
    dtypes=st.sampled_from(REPORT_DTYPES),
    seed=st.integers(0, 2**32 - 1),
    faults=st.lists(FAULT, max_size=6),
)
def test_nonfinite_report_counts_match_numpy(dtypes, seed, faults):
    rng = np.random.default_rng(seed)
    flat = {k: rng.normal(size=SHAPES[k]).astype(np.float32) for k in NAMES}
    for leaf, pos, value in faults:
        flat[leaf].reshape(-1)[pos % flat[leaf].size] = value
    flat = {k: v.astype(d) for (k, v), d in zip(flat.items(), dtypes, strict=True)}
    report, finite = _report_fn()(_nest(flat))
    expected = {}
    paths = {"a": "['a']", "k": "['b']['k']", "c": "['c']"}
    for k in NAMES:
        x = flat[k].astype(np.float32)
        n_nan, n_inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
        if n_nan or n_inf:
            expected[paths[k]] = (n_nan, n_inf)
    assert report.offenders() == expected
    assert bool(report.any_nonfinite) == bool(expected)
    assert bool(finite) == (not expected)


# --- Regression tests: deterministic cases of the invariants above (found by this suite) -------


@pytest.mark.parametrize(
    "dtype, check_new_values",
    # "auto" checks float16 params only: bf16/float32 overflow needs updates near 3e38
    [(jnp.float16, "auto"), (jnp.float16, True), (jnp.bfloat16, True), (jnp.float32, True)],
)
@pytest.mark.parametrize("master_weights", ["auto", True, False])
@pytest.mark.parametrize("skip_impl", ["cond", "select"])
def test_finite_gradients_never_make_params_or_master_non_finite(
    dtype, check_new_values, master_weights, skip_impl
):
    """A step whose gradients are finite may still overflow the new value (a param near the top
    of its dtype's range, a large step): such a step is skipped, params and master stay finite."""
    top = float(jnp.finfo(dtype).max)
    params = {"w": jnp.asarray([top * 0.99, 1.0, -top * 0.99], dtype)}
    grads = {"w": jnp.asarray([-top / 4, 0.5, top / 4], dtype)}  # finite, unscaled (scale 1)
    tx = loss_scaled(
        optax.sgd(1.0),
        StaticLossScale(1.0),
        master_weights=master_weights,
        check_new_values=check_new_values,
        skip_impl=skip_impl,
    )
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert np.all(np.isfinite(np.asarray(new["w"], np.float32))), new["w"]
    for leaf in jax.tree.leaves(state.master):
        assert np.all(np.isfinite(np.asarray(leaf))), leaf
    chex.assert_trees_all_equal(new, params)  # skipped as a whole
    assert bool(state.grads_finite) and int(state.skipped_steps) == 1


def test_float32_params_with_master_weights_land_exactly_on_the_master():
    """master_weights=True keeps a float32 master of float32 params too; the params the model
    uses must stay bit-identical to it (as they do for half-precision params)."""
    rng = np.random.default_rng(0)
    shapes = [(), (1,), (2,), (3,), (5,), (64,)]
    params = {f"w{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    grads_seq = [
        {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        for _ in range(40)
    ]
    tx = loss_scaled(optax.adam(0.1), StaticLossScale(1.0), master_weights=True)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_seq:
        params, state = step(params, state, grads)
    for k in params:
        assert np.array_equal(np.asarray(params[k]), np.asarray(state.master[k])), k
