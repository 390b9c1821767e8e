"""Delayed fp8 for NNX in training: devices, jit forms, checkpoint resume, skipped steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpjax
from mpjax.fp8 import Fp8Meta, update_nnx_fp8_meta
from tests.helpers.fp8 import _per_device_inputs, bf16_amax, delayed, wide
from tests.helpers.fp8_nnx import DIFF, make, make_step, mse, pure, same_bits

# ----------------------------------------------------------------------------- devices


def _split_step(graphdef, recipe):
    """One step on `nnx.split` state, for jax.jit / pmap: returns the new state."""

    def step(state, x):
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(mse, argnums=DIFF)(model, x)
        update_nnx_fp8_meta(model, grads, recipe)
        return nnx.state(model)

    return step


@pytest.mark.parametrize("axis_name", ["batch", None])
def test_pmap_every_device_gets_the_same_scale(axis_name):
    n = jax.local_device_count()
    assert n == 8, "conftest sets 8 host devices"
    recipe = delayed(amax_history_len=4)
    model = make(recipe, fp8_axis_name=axis_name)
    x = _per_device_inputs(np.random.default_rng(2), n)
    graphdef, state = nnx.split(model)
    rep = jax.tree.map(lambda a: np.stack([a] * n), state)
    new = jax.pmap(_split_step(graphdef, recipe), axis_name="batch")(rep, x)
    meta = nnx.to_pure_dict(new)["l0"]["fp8_meta"]
    scales = np.asarray(meta["scale"])  # [devices, 3]
    if axis_name is None:  # the negative control: local amaxes, different scales
        assert len({s.tobytes() for s in scales}) == n
        return
    assert all(s.tobytes() == scales[0].tobytes() for s in scales)
    assert np.asarray(meta["amax_history"])[0, 0, 0] == bf16_amax(x)  # the global input amax


def test_jit_named_sharding_amax_is_global():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    recipe = delayed(amax_history_len=4)
    graphdef, state = nnx.split(make(recipe))
    x = _per_device_inputs(np.random.default_rng(4), 8).reshape(128, 64)
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    new = jax.jit(_split_step(graphdef, recipe))(state, xs)
    meta = nnx.to_pure_dict(new)["l0"]["fp8_meta"]
    shards = [np.asarray(s.data) for s in meta["scale"].addressable_shards]
    assert len(shards) == 8 and all(s.tobytes() == shards[0].tobytes() for s in shards)
    assert np.asarray(meta["amax_history"])[0, 0] == bf16_amax(x)
    np.testing.assert_allclose(shards[0][0], 448.0 / bf16_amax(x), rtol=1e-6)


def test_nnx_jit_jax_jit_split_merge_and_jax_grad_agree_bitwise():
    recipe = delayed(amax_history_len=4)
    rng = np.random.default_rng(6)
    xs = [wide(rng, (64, 64), 2.0) * 10.0**k for k in (0, 2, -1)]
    a = make(recipe)
    for x in xs:  # nnx.jit, in place
        nnx.jit(lambda m, x: update_nnx_fp8_meta(m, nnx.grad(mse, argnums=DIFF)(m, x), recipe))(
            a, x
        )
    graphdef, state = nnx.split(make(recipe))
    step = jax.jit(_split_step(graphdef, recipe))
    for x in xs:  # jax.jit over nnx.split state
        state = step(state, x)
    graphdef, params, meta = nnx.split(make(recipe), nnx.Param, Fp8Meta)

    @jax.jit
    def pure_step(meta, x):  # jax.grad over the split states, the Fp8Meta part to update
        def loss(p, m):
            return mse(nnx.merge(graphdef, p, m), x)

        _, meta_grads = jax.grad(loss, (0, 1))(params, meta)
        model = nnx.merge(graphdef, params, meta)
        update_nnx_fp8_meta(model, meta_grads, recipe)
        return nnx.state(model, Fp8Meta)

    for x in xs:
        meta = pure_step(meta, x)
    assert np.asarray(pure(a)["l1"]["fp8_meta"]["amax_history"])[:, :3].all()
    assert same_bits(pure(a), nnx.to_pure_dict(nnx.state(state, Fp8Meta)))
    assert same_bits(pure(a), nnx.to_pure_dict(meta))


# ----------------------------------------------------------------------------- training state


def _save(path, *nodes):
    np.savez(path, *[np.asarray(a) for a in jax.tree.leaves(nnx.state(nodes))])


def _load(path, *nodes):
    state = nnx.state(nodes)
    with np.load(path) as f:
        arrays = [jnp.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
    nnx.update(nodes, jax.tree.unflatten(jax.tree.structure(state), arrays))


def test_checkpoint_round_trip_resumes_bitwise(tmp_path):
    recipe = delayed(amax_history_len=3)
    rng = np.random.default_rng(9)
    xs = [wide(rng, (64, 64), 3.0) * 10.0**k for k in (0, 2, -1, 1, 0, 3)]
    step = make_step(recipe)

    def run(seed=0):
        model = make(recipe, seed=seed)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    straight = run()
    for x in xs:
        step(*straight, x)
    half = run()
    for x in xs[:3]:
        step(*half, x)
    _save(tmp_path / "ckpt.npz", *half)
    resumed, no_meta = run(seed=5), run(seed=5)  # fresh models, other weights
    _load(tmp_path / "ckpt.npz", *resumed)
    _load(tmp_path / "ckpt.npz", *no_meta)
    nnx.update(no_meta[0], nnx.state(run(seed=5)[0], Fp8Meta))  # the control: meta not restored
    for x in xs[3:]:
        step(*resumed, x)
        step(*no_meta, x)
    assert (np.asarray(pure(straight[0])["l0"]["fp8_meta"]["amax_history"]) > 0).all()
    assert same_bits(nnx.state(straight), nnx.state(resumed))
    assert not same_bits(pure(straight[0], nnx.Param), pure(no_meta[0], nnx.Param))


@pytest.mark.parametrize("where", [0, 64 * 128 // 2, 64 * 128 - 1])
def test_nan_activation_gradient_skips_and_keeps_the_fp8_state(where):
    recipe = delayed(amax_history_len=4)
    x = wide(np.random.default_rng(5), (64, 64), 2.0)
    model = make(recipe)
    optimizer = nnx.Optimizer(model, mpjax.loss_scaled(optax.adam(1e-3)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        saved = mpjax.snapshot_state(model, Fp8Meta)

        def loss(m):
            return mpjax.scale_loss(mse(m, x), optimizer.opt_state)

        grads = nnx.grad(loss, argnums=DIFF)(model)
        optimizer.update(model, grads)
        update_nnx_fp8_meta(model, grads, recipe)
        updated = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
        mpjax.restore_if_skipped(model, saved, optimizer.opt_state)
        return updated

    def inner():
        return jax.tree.map(np.array, mpjax.find_loss_scaled_state(optimizer.opt_state).inner_state)

    step(model, optimizer, x)  # a clean warm-up step
    before = (pure(model), pure(model, nnx.Param), inner())
    model.nan_at = where
    updated = step(model, optimizer, x)
    state = mpjax.find_loss_scaled_state(optimizer.opt_state)
    assert not bool(state.grads_finite) and int(state.skipped_steps) == 1
    assert same_bits(before, (pure(model), pure(model, nnx.Param), inner()))
    # update_nnx_fp8_meta alone rolled the histories but never recorded the NaN: l0's output
    # gradient (the NaN's) keeps its history; l1's rolled (restore_if_skipped undid it)
    first, second = updated["l0"]["fp8_meta"], updated["l1"]["fp8_meta"]
    assert np.isfinite(np.asarray(first["amax_history"])).all()
    assert np.isfinite(np.asarray(first["scale"])).all()
    old = before[0]
    np.testing.assert_array_equal(
        first["amax_history"][2], old["l0"]["fp8_meta"]["amax_history"][2]
    )
    assert not same_bits(second, old["l1"]["fp8_meta"])
