"""Delayed fp8 scaling: `apply_policy(model, policy, fp8=Fp8Recipe(scaling="delayed"))`."""

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import errors as flax_errors
from flax import serialization
from jax.sharding import NamedSharding, PartitionSpec

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import update_fp8_meta
from tests.helpers.fp8 import (
    BF16,
    E4,
    E5,
    F32,
    TOL_E4M3,
    TOL_E5M2,
    _nan_grad,
    _numpy_reference,
    _per_device_inputs,
    bf16_amax,
    delayed,
    f64_grads,
    gemm_operand_dtypes,
    rel_err,
    wide,
)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(128)(x))
        return nn.Dense(64, name="head")(nn.gelu(nn.Dense(128)(h)))


def setup(recipe, policy=BF16, seed=0, module=None):
    model = mpjax.apply_policy(module or MLP(), policy, fp8=recipe)
    x = wide(np.random.default_rng(seed), (64, 64), 2.0)
    variables = model.init(jax.random.key(seed), x)
    return model, x, variables


def make_loss(model):
    def loss(params, meta, x):
        out = model.apply({"params": params, "fp8_meta": meta}, x)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    return loss


# ----------------------------------------------------------------------------- state and update


def test_state_lives_in_fp8_meta_and_gemms_are_fp8():
    recipe = delayed(amax_history_len=16, exclude=("*/head",))
    model, x, v = setup(recipe)
    assert set(v) == {"params", "fp8_meta"}
    assert set(v["fp8_meta"]) == {"Dense_0", "Dense_1"}  # the excluded head has none
    assert jax.tree.map(jnp.shape, v["fp8_meta"]["Dense_0"]) == {
        "amax_history": (3, 16),
        "scale": (3,),
    }
    assert "amax_history" not in str(jax.tree.structure(v["params"]))
    grad = jax.grad(make_loss(model), (0, 1))
    dtypes = gemm_operand_dtypes(grad, v["params"], v["fp8_meta"], x)
    # two fp8 Dense: forward e4m3 x e4m3, input grad e5m2 x e4m3, weight grad e4m3 x e5m2
    fp8 = Counter(tuple(t.name for t in d) for d in dtypes if E4 in d or E5 in d)
    assert fp8 == Counter({(a.name, b.name): 2 for a, b in [(E4, E4), (E5, E4), (E4, E5)]})


@pytest.mark.parametrize("compute", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.5])
def test_history_rolls_and_amax_compute_against_numpy(compute, margin):
    length, steps = 4, 9
    rng = np.random.default_rng(7)
    amaxes = 10.0 ** rng.uniform(-6, 6, (steps, 3))  # decades apart
    amaxes[3, 1] = 0.0  # an all-zero kernel: keeps its previous scale
    amaxes[5, 2] = np.nan  # a NaN output gradient: not recorded
    amaxes[6, 0] = np.inf
    recipe = delayed(amax_history_len=length, amax_compute=compute, margin=margin)
    meta = {"layer": {"amax_history": jnp.zeros((3, length)), "scale": jnp.ones(3)}}
    update = jax.jit(lambda m, s: update_fp8_meta(m, {"layer": {"scale": s, **s_hist}}, recipe))
    s_hist = {"amax_history": jnp.zeros((3, length))}
    for step, (ref_hist, ref_scale) in enumerate(_numpy_reference(amaxes, length, compute, margin)):
        meta = update(meta, jnp.asarray(amaxes[step], jnp.float32))
        hist, scale = (np.asarray(meta["layer"][k], np.float64) for k in ("amax_history", "scale"))
        np.testing.assert_allclose(hist, ref_hist.astype(np.float32), rtol=0, atol=0)
        np.testing.assert_allclose(scale, ref_scale, rtol=2e-7)
        assert np.isfinite(scale).all() and (scale > 0).all()
    # after 9 steps of a length-4 history, the kernel's oldest 5 amaxes have rolled out; the
    # input's history skipped its inf step (6), so its oldest entry is step 4's
    hist = np.asarray(meta["layer"]["amax_history"])
    assert hist[1, -1] == np.float32(amaxes[5, 1]) and hist[0, -1] == np.float32(amaxes[4, 0])


def test_margin_divides_the_scale_by_a_power_of_two():
    seen = {"amax_history": jnp.zeros((3, 2)), "scale": jnp.asarray([3.0, 1e-3, 250.0])}
    meta = {"amax_history": jnp.zeros((3, 2)), "scale": jnp.ones(3)}
    s0 = update_fp8_meta(meta, seen, delayed(amax_history_len=2))["scale"]
    s2 = update_fp8_meta(meta, seen, delayed(amax_history_len=2, margin=2))["scale"]
    np.testing.assert_array_equal(np.asarray(s2) * 4, np.asarray(s0))
    np.testing.assert_allclose(s0, [448 / 3, 448 / 1e-3, 57344 / 250], rtol=1e-6)


def test_all_zero_input_gets_a_finite_scale():
    recipe = delayed(amax_history_len=4)
    model, x, v = setup(recipe)
    zeros = jnp.zeros_like(x)
    loss = make_loss(model)
    _, meta_grads = jax.grad(loss, (0, 1))(v["params"], v["fp8_meta"], zeros)
    meta = update_fp8_meta(v["fp8_meta"], meta_grads, recipe)
    scale = np.asarray(meta["Dense_0"]["scale"])
    assert scale[0] == 1.0 and np.isfinite(scale).all()  # x's amax 0: scale stays 1
    out = model.apply({"params": v["params"], "fp8_meta": meta}, zeros)
    assert np.isfinite(np.asarray(out)).all()


# ----------------------------------------------------------------------------- numerics


def test_gradients_vs_float64_after_a_warm_up_step():
    recipe = delayed(amax_history_len=8)
    model = mpjax.apply_policy(nn.Dense(96), F32, fp8=recipe)
    rng = np.random.default_rng(3)
    x, r = 50 * wide(rng, (64, 128)), wide(rng, (64, 96))  # |x| up to ~1000: beyond e4m3's 448
    v = model.init(jax.random.key(0), x)

    def loss(params, meta):
        return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x) * r)

    grad = jax.jit(jax.grad(loss, (0, 1)))
    _, meta_grads = grad(v["params"], v["fp8_meta"])  # warm-up: scales 1, amaxes recorded
    meta = update_fp8_meta(v["fp8_meta"], meta_grads, recipe)
    g, _ = grad(v["params"], meta)
    w = v["params"]["kernel"]
    _, (rx, rw) = f64_grads(lambda a, b: jnp.sum((a @ b) * r), x, w)
    warm = {"params": v["params"], "fp8_meta": meta}
    gx = jax.grad(lambda xx: jnp.sum(model.apply(warm, xx) * r))(x)
    # stated tolerance: relative L2 error of e5m2-gradient GEMMs, as for current scaling
    assert rel_err(gx, rx) < TOL_E5M2 and rel_err(g["kernel"], rw) < TOL_E5M2
    ref = x.astype(np.float64) @ np.asarray(w, np.float64)
    assert rel_err(model.apply(warm, x), ref) < TOL_E4M3
    # before the warm-up (scale 1) the inputs beyond 448 saturated: far off
    cold = model.apply({"params": v["params"], "fp8_meta": v["fp8_meta"]}, x)
    assert rel_err(cold, ref) > 2 * TOL_E4M3


class Heads(nn.Module):
    """Attention-style projections: DenseGeneral to (heads, dim) and back over two axes."""

    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((4, 32), axis=-1)(x)  # [b, 4, 32]
        return nn.DenseGeneral(96, axis=(-2, -1))(nn.gelu(h))


def test_dense_general_multi_axis_gradients_vs_float64():
    recipe = delayed(amax_history_len=2)
    model = mpjax.apply_policy(Heads(), F32, fp8=recipe)
    rng = np.random.default_rng(11)
    x, r = wide(rng, (64, 128)), wide(rng, (64, 96))
    v = model.init(jax.random.key(1), x)
    assert set(v["fp8_meta"]) == {"DenseGeneral_0", "DenseGeneral_1"}

    def loss(params, meta):
        return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x) * r)

    grad = jax.jit(jax.grad(loss, (0, 1)))
    meta = update_fp8_meta(v["fp8_meta"], grad(v["params"], v["fp8_meta"])[1], recipe)
    g = grad(v["params"], meta)[0]
    plain = Heads()
    ref = f64_grads(lambda p: jnp.sum(plain.apply({"params": p}, x) * r), v["params"])[1][0]
    # the last layer: one e5m2 GEMM; the first: two fp8 layers back to back (as for autocast)
    assert rel_err(g["DenseGeneral_1"]["kernel"], ref["DenseGeneral_1"]["kernel"]) < TOL_E5M2
    assert rel_err(g["DenseGeneral_0"]["kernel"], ref["DenseGeneral_0"]["kernel"]) < 2 * TOL_E5M2


def test_activation_sizes_off_16_fall_back_to_the_compute_dtype():
    recipe = delayed(amax_history_len=2)
    model, x, v = setup(recipe)
    small = x[:3]  # 3 rows: not a multiple of 16
    dtypes = gemm_operand_dtypes(
        lambda p, m: model.apply({"params": p, "fp8_meta": m}, small), v["params"], v["fp8_meta"]
    )
    assert not any(E4 in d or E5 in d for d in dtypes)
    _, meta_grads = jax.grad(make_loss(model), (0, 1))(v["params"], v["fp8_meta"], small)
    meta = update_fp8_meta(v["fp8_meta"], meta_grads, recipe)
    np.testing.assert_array_equal(meta["Dense_0"]["scale"], v["fp8_meta"]["Dense_0"]["scale"])


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("axis_name", ["batch", None])
def test_pmap_every_device_gets_the_same_scale(axis_name):
    n = jax.local_device_count()
    assert n == 8, "conftest sets 8 host devices"
    recipe = delayed(amax_history_len=4)
    model = mpjax.apply_policy(MLP(), BF16, fp8=recipe, fp8_axis_name=axis_name)
    x = _per_device_inputs(np.random.default_rng(2), n)
    v = model.init(jax.random.key(0), x[0])
    loss = make_loss(model)

    def step(params, meta, xs):
        _, meta_grads = jax.grad(loss, (0, 1))(params, meta, xs)
        return update_fp8_meta(meta, meta_grads, recipe)

    rep = jax.tree.map(lambda a: np.stack([a] * n), (v["params"], v["fp8_meta"]))
    meta = jax.pmap(step, axis_name="batch")(*rep, x)
    scales = np.asarray(meta["Dense_0"]["scale"])  # [devices, 3]
    hist = np.asarray(meta["Dense_0"]["amax_history"])[:, :, 0]
    if axis_name is None:  # the negative control: local amaxes, different scales
        assert len({s.tobytes() for s in scales}) == n
        return
    assert all(s.tobytes() == scales[0].tobytes() for s in scales)
    assert hist[0, 0] == bf16_amax(x)  # the global amax of the (bfloat16) input


def test_jit_named_sharding_amax_is_global():
    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices, ("data",))
    recipe = delayed(amax_history_len=4)
    model = mpjax.apply_policy(MLP(), BF16, fp8=recipe)
    x = _per_device_inputs(np.random.default_rng(4), 8).reshape(128, 64)
    v = model.init(jax.random.key(0), x[:16])
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    params, meta = jax.device_put(
        (v["params"], v["fp8_meta"]), NamedSharding(mesh, PartitionSpec())
    )
    loss = make_loss(model)

    @jax.jit
    def step(params, meta, xs):
        _, meta_grads = jax.grad(loss, (0, 1))(params, meta, xs)
        return update_fp8_meta(meta, meta_grads, recipe)

    new = step(params, meta, xs)
    scale = new["Dense_0"]["scale"]
    shards = [np.asarray(s.data) for s in scale.addressable_shards]
    assert len(shards) == 8 and all(s.tobytes() == shards[0].tobytes() for s in shards)
    assert np.asarray(new["Dense_0"]["amax_history"])[0, 0] == bf16_amax(x)
    np.testing.assert_allclose(shards[0][0], 448.0 / bf16_amax(x), rtol=1e-6)


# ----------------------------------------------------------------------------- training state


def _train(model, recipe, tx, state, xs):
    loss = make_loss(model)

    @jax.jit
    def step(state, x):
        params, meta, opt_state = state
        grads, meta_grads = jax.grad(loss, (0, 1))(params, meta, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        meta = update_fp8_meta(meta, meta_grads, recipe)
        return optax.apply_updates(params, updates), meta, opt_state

    for x in xs:
        state = step(state, x)
    return state


def test_checkpoint_round_trip_resumes_bitwise():
    recipe = delayed(amax_history_len=3)
    model, _, v = setup(recipe)
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(9)
    xs = [wide(rng, (64, 64), 3.0) * 10.0**k for k in (0, 2, -1, 1, 0, 3)]
    state = (v["params"], v["fp8_meta"], tx.init(v["params"]))
    straight = _train(model, recipe, tx, state, xs)
    half = _train(model, recipe, tx, state, xs[:3])
    blob = serialization.to_bytes(half)
    template = jax.tree.map(jnp.zeros_like, state)
    resumed = _train(model, recipe, tx, serialization.from_bytes(template, blob), xs[3:])
    hist = np.asarray(straight[1]["Dense_0"]["amax_history"])
    assert (hist > 0).all()  # the history holds the last three steps' amaxes
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


class NanMLP(nn.Module):
    where: int | None

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(128)(x))
        h = _nan_grad(self.where)(h)
        return nn.Dense(64)(nn.gelu(nn.Dense(128)(h)))


@pytest.mark.parametrize("where", [0, 64 * 128 // 2, 64 * 128 - 1])
def test_nan_activation_gradient_skips_and_keeps_the_fp8_meta(where):
    recipe = delayed(amax_history_len=4)
    x = wide(np.random.default_rng(5), (64, 64), 2.0)
    tx = mpjax.loss_scaled(optax.adam(1e-3))

    def make_step(where):
        model = mpjax.apply_policy(NanMLP(where), BF16, fp8=recipe)
        loss = make_loss(model)

        @jax.jit
        def step(params, meta, opt_state):
            def scaled(p, m):
                return mpjax.scale_loss(loss(p, m, x), opt_state)

            grads, meta_grads = jax.grad(scaled, (0, 1))(params, meta)
            updates, new_opt = tx.update(grads, opt_state, params)
            updated = update_fp8_meta(meta, meta_grads, recipe)
            new_meta = mpjax.keep_if_skipped(updated, meta, new_opt)
            return optax.apply_updates(params, updates), new_meta, new_opt, updated

        return model, step

    model, clean = make_step(None)
    v = model.init(jax.random.key(0), x)
    params, meta, opt = clean(v["params"], v["fp8_meta"], tx.init(v["params"]))[:3]  # warm-up
    new_params, new_meta, new_opt, updated = make_step(where)[1](params, meta, opt)
    assert not bool(new_opt.grads_finite) and int(new_opt.skipped_steps) == 1
    for a, b in zip(
        jax.tree.leaves((params, opt.inner_state, meta)),
        jax.tree.leaves((new_params, new_opt.inner_state, new_meta)),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # update_fp8_meta alone never records the NaN: the first layer's g history is unchanged
    first = updated["Dense_0"]
    assert np.isfinite(np.asarray(first["amax_history"])).all()
    assert np.isfinite(np.asarray(first["scale"])).all()
    np.testing.assert_array_equal(first["amax_history"][2], meta["Dense_0"]["amax_history"][2])


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fp8_axis_name='batch'.*tensorwise.*no state"):
        mpjax.apply_policy(MLP(), BF16, fp8=Fp8Recipe(), fp8_axis_name="batch")
    with pytest.raises(TypeError, match="Fp8Recipe"):
        mpjax.apply_policy(MLP(), BF16, fp8="e4m3")
    with pytest.raises(ValueError, match="fp8_axis_name"):
        mpjax.apply_policy(MLP(), BF16, fp8_axis_name="batch")
    custom = nn.Dense(128, dot_general=jax.lax.dot_general, name="mine")
    model = mpjax.apply_policy(custom, BF16, fp8=delayed())
    with pytest.raises(ValueError, match="Dense/mine|dot_general"):
        model.init(jax.random.key(0), jnp.ones((16, 64)))
    recipe = delayed(amax_history_len=4)
    model, x, v = setup(recipe)
    grads, meta_grads = jax.grad(make_loss(model), (0, 1))(v["params"], v["fp8_meta"], x)
    with pytest.raises(flax_errors.ScopeCollectionNotFound, match="fp8_meta"):
        model.apply({"params": v["params"]}, x)  # the meta left out of apply
    with pytest.raises(ValueError, match="same tree|structure"):
        update_fp8_meta(v["fp8_meta"], grads, recipe)  # the params' gradient by mistake
    with pytest.raises(ValueError, match="delayed"):
        update_fp8_meta(v["fp8_meta"], meta_grads, Fp8Recipe())
    with pytest.raises(ValueError, match="unexpected leaf"):
        update_fp8_meta({"a": jnp.ones(2)}, {"a": jnp.ones(2)}, recipe)
    with pytest.raises(ValueError, match="no fp8 site"):
        update_fp8_meta({"a": {}}, {"a": {}}, recipe)
    with pytest.raises(ValueError, match="scaling='delayed'"):
        mpjax.fp8.fp8_dot_general(x, x.T, (((1,), (0,)), ((), ())), recipe, jnp.bfloat16)


class OwnDot(nn.Module):
    """A Dense with its own dot_general (doubling the product) after a plain one."""

    @nn.compact
    def __call__(self, x):
        def doubled(*args, **kwargs):
            return 2 * jax.lax.dot_general(*args, **kwargs)

        h = nn.Dense(128)(x)
        return nn.Dense(64, use_bias=False, dot_general=doubled, name="mine")(h)


def test_a_dense_with_its_own_dot_general_excluded_by_pattern_keeps_it():
    """The error for a custom dot_general says "exclude it": excluding it must then work."""
    recipe = delayed(amax_history_len=2, exclude=("*/mine",))
    model = mpjax.apply_policy(OwnDot(), F32, fp8=recipe)
    x = wide(np.random.default_rng(12), (16, 64), 1.0)
    v = model.init(jax.random.key(0), x)
    assert set(v["fp8_meta"]) == {"Dense_0"}
    out = model.apply(v, x)
    ref = OwnDot().apply({"params": v["params"]}, x)  # no policy, no fp8: the doubled product
    first = x @ np.asarray(v["params"]["Dense_0"]["kernel"]) + v["params"]["Dense_0"]["bias"]
    assert rel_err(ref, 2 * first @ np.asarray(v["params"]["mine"]["kernel"])) < 1e-5
    assert rel_err(out, ref) < TOL_E4M3  # Dense_0 in fp8, "mine" its own doubled product


@pytest.mark.parametrize("where", [0, 64 * 64, 64 * 128 - 1])
@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_an_inf_gradient_is_not_saturated_away(where, bad):
    # The stored scale would clip an inf output gradient to +-57344 and leave the weight
    # gradients finite; it must turn them non-finite, so that loss_scaled skips the step.
    # (A forward operand saturates to +-448 as specified; its amax is not recorded.)
    model, x, variables = setup(delayed(), module=nn.Dense(128))  # one fp8 GEMM, nothing else
    params, meta = variables["params"], variables["fp8_meta"]

    def loss_with_bad_grad(params, meta):
        out = model.apply({"params": params, "fp8_meta": meta}, x)
        return jnp.sum(_inf_grad(where, bad)(out.astype(jnp.float32)))

    g_params = jax.grad(loss_with_bad_grad)(params, meta)
    assert not np.all(np.isfinite(np.asarray(g_params["kernel"])))  # the fp8 wgrad GEMM
    x_bad = jnp.asarray(x).reshape(-1).at[where].set(bad).reshape(x.shape)
    value = make_loss(model)(params, meta, x_bad)
    assert np.isfinite(float(value))  # forward: saturated, as fp8 GEMMs are specified


def _inf_grad(where, bad):
    """Identity whose backward puts `bad` into the cotangent at flat index `where`."""

    @jax.custom_vjp
    def ident(h):
        return h

    def bwd(_, g):
        return (g.reshape(-1).at[where].set(bad).reshape(g.shape),)

    ident.defvjp(lambda h: (h, None), bwd)
    return ident
