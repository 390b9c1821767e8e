"""examples/data_parallel.py on 8 CPU devices: pmap, pjit (with and without ZeRO) and shard_map
train like one device on the same global batch, and a non-finite gradient on one device makes
every device skip the step together."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from examples import data_parallel as dpx
from examples.digits_cnn import load_data, make_model, make_optimizer, precision_policy
from mpjax._src.scaling.remainder import split_master
from mpjax.policy import cast_floating
from tests.helpers.data_parallel import (
    BATCH,
    INNER,
    STEPS,
    assert_bitwise_equal,
    assert_skipped,
    batch,
    build,
    initial_host_state,
    loss_scale,
    per_device,
    rel_change_error,
    run,
)

N_DEVICES = 8
# Norm-wise error of a data-parallel run against the single-device run, relative to the
# change single-device training made (see `rel_change_error`). In half precision the
# per-device gradients are rounded to fp16/bf16 before the cross-device mean, the single
# device rounds one global sum: measured 3e-7 (fp32), 3e-3 (fp16), 3e-2 (bf16, whose
# cancellation-heavy bias gradients keep only 8 bits). A data-parallel bug (gradients
# summed instead of averaged, a device's gradients dropped, replicas that diverge) is an
# error of order 1.
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 8e-2}


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert jax.device_count() == N_DEVICES, "tests/conftest.py should give 8 CPU devices"


@pytest.fixture(scope="module")
def data():
    return load_data()[0]


@pytest.fixture(scope="module")
def initial():
    """precision -> initial host state (computed once per precision)."""
    cache = {}

    def get(precision):
        if precision not in cache:
            cache[precision] = initial_host_state(precision)
        return cache[precision]

    return get


@pytest.fixture(scope="module")
def reference(initial, data):
    """precision -> host state after STEPS single-device steps."""
    cache = {}

    def get(precision):
        if precision not in cache:
            state = run(build("single", precision), initial(precision), data)
            cache[precision] = dpx.to_host(state)
        return cache[precision]

    return get


@pytest.mark.parametrize(
    "mode,precision",
    [(m, p) for m in ("pmap", "pjit") for p in ("fp32", "bf16", "fp16")] + [("shard_map", "fp16")],
)
def test_k_steps_on_8_devices_match_one_device(mode, precision, initial, reference, data):
    dp = build(mode, precision)
    copies = per_device(dp, run(dp, initial(precision), data))
    assert len(copies) == N_DEVICES
    for i, copy in enumerate(copies[1:], 1):
        assert_bitwise_equal(copy, copies[0], f"device {i} vs device 0: ")

    params, opt = copies[0]
    ref_params, ref_opt = reference(precision)
    init_params, init_opt = initial(precision)
    # The loss-scale bookkeeping is identical, not merely close.
    assert_bitwise_equal(opt.loss_scale, ref_opt.loss_scale, "loss_scale")
    for field in ("grads_finite", "skipped_steps", "consecutive_skips"):
        assert_bitwise_equal(getattr(opt, field), getattr(ref_opt, field), field)
    if precision == "fp16":  # 2**10 grew once after two finite steps
        assert float(opt.loss_scale.loss_scale) == 2.0**11
        assert int(opt.skipped_steps) == 0

    tol = TOLERANCE[precision]
    for what, got, want, start in (
        ("params", params, ref_params, init_params),
        ("master", opt.master, ref_opt.master, init_opt.master),
        ("inner_state", opt.inner_state, ref_opt.inner_state, init_opt.inner_state),
    ):
        err = rel_change_error(got, want, start)
        if what == "master" and precision == "fp32":
            assert np.isnan(err), "float32 params keep no master copy"
            continue
        assert err < tol, f"{mode}/{precision} {what}: relative error {err:.3g} >= {tol}"
    if precision != "fp32":
        # The half-precision params are the fp32 master rounded, on every device: float16
        # to nearest even, bfloat16 by the remainder's rule (nearest, ties away from zero).
        policy = precision_policy(precision)
        if policy.param_dtype == jnp.bfloat16:
            want = jax.tree.map(lambda m: split_master(m)[0], opt.master)
        else:
            want = cast_floating(opt.master, policy.param_dtype)
        assert_bitwise_equal(params, want, "params")


def _poison_hook(device: int, where: str, value: float):
    """A grad hook putting `value` into one gradient element on `device` only."""

    def hook(grads):
        leaves, treedef = jax.tree.flatten(grads)
        k = {"first": 0, "middle": len(leaves) // 2, "last": len(leaves) - 1}[where]
        leaf = leaves[k]
        i = {"first": 0, "middle": leaf.size // 2, "last": leaf.size - 1}[where]
        bad = leaf.reshape(-1).at[i].set(value).reshape(leaf.shape)
        leaves[k] = jnp.where(lax.axis_index(dpx.AXIS) == device, bad, leaf)
        return jax.tree.unflatten(treedef, leaves)

    return hook


POISON_CASES = [(0, "first", np.inf), (3, "middle", np.nan), (7, "last", -np.inf)]


@pytest.mark.parametrize("device,where,value", POISON_CASES)
def test_pmap_inf_in_one_device_grads_before_pmean_skips_everywhere(
    device, where, value, reference, data
):
    dp = build("pmap", "fp16", grad_hook=_poison_hook(device, where, value))
    before = reference("fp16")  # a trained state: momentum and master are not trivial
    params, opt, metrics = dp.step(*dp.place(before), *dp.put_batch(*batch(data, STEPS)))
    assert not np.asarray(metrics["grads_finite"]).any()
    for i, after in enumerate(per_device(dp, (params, opt))):
        assert_skipped(before, after, f"device {i}")


def _unsynced_pmap_step(axis_name, hook):
    """A pmap step that never averages the gradients: each device updates on its own."""
    model = make_model(precision_policy("fp16"))
    tx = make_optimizer("fp16", loss_scale=loss_scale("fp16"), inner=INNER, axis_name=axis_name)

    def body(params, opt_state, x, y):
        loss, grads = dpx.scaled_grads(model, params, opt_state, x, y)
        return dpx.apply_grads(tx, params, opt_state, hook(grads), loss)

    return jax.pmap(body, axis_name=dpx.AXIS)


def test_pmap_unsynced_grads_skip_together_through_axis_name(reference, data):
    dp = build("pmap", "fp16")  # placement only
    step = _unsynced_pmap_step(dpx.AXIS, _poison_hook(5, "middle", np.inf))
    before = reference("fp16")
    params, opt, metrics = step(*dp.place(before), *dp.put_batch(*batch(data, STEPS)))
    assert not np.asarray(metrics["grads_finite"]).any()
    for i, after in enumerate(per_device(dp, (params, opt))):
        assert_skipped(before, after, f"device {i}")


def test_pmap_unsynced_grads_without_axis_name_diverge(reference, data):
    """The failure `axis_name` prevents: only the poisoned device skips."""
    dp = build("pmap", "fp16")
    step = _unsynced_pmap_step(None, _poison_hook(5, "middle", np.inf))
    before = reference("fp16")
    _, opt, metrics = step(*dp.place(before), *dp.put_batch(*batch(data, STEPS)))
    finite = np.asarray(metrics["grads_finite"])
    np.testing.assert_array_equal(finite, [True] * 5 + [False] + [True] * 2)
    scale = float(before[1].loss_scale.loss_scale)  # counter 1 of 2: a finite step grows it
    np.testing.assert_array_equal(
        dpx.to_host(opt.loss_scale.loss_scale), [2 * scale] * 5 + [scale / 2] + [2 * scale] * 2
    )


@pytest.mark.parametrize("mode,zero", [("pjit", False), ("pjit", True), ("shard_map", False)])
def test_inf_in_one_batch_shard_makes_every_device_skip(mode, zero, reference, data):
    dp = build(mode, "fp16", zero=zero)
    before = reference("fp16")
    x, y = batch(data, STEPS)
    rows = BATCH // N_DEVICES
    for shard, where, value in POISON_CASES:
        bad = x.copy()
        offset = {"first": 0, "middle": rows // 2, "last": rows - 1}[where]
        pixel = {"first": 0, "middle": bad[0].size // 2, "last": bad[0].size - 1}[where]
        bad.reshape(BATCH, -1)[shard * rows + offset, pixel] = value
        xb, yb = dp.put_batch(bad, y)
        for s in xb.addressable_shards:  # the bad value sits on that one device
            on_shard = s.index[0].start == shard * rows
            assert np.isfinite(np.asarray(s.data)).all() != on_shard
        params, opt, metrics = dp.step(*dp.place(before), xb, yb)
        assert not bool(metrics["grads_finite"])
        for i, after in enumerate(per_device(dp, (params, opt))):
            assert_skipped(before, after, f"{mode} shard {shard} device {i}")
    # The same batch without the bad value is a normal step.
    params, opt, metrics = dp.step(*dp.place(before), *dp.put_batch(x, y))
    assert bool(metrics["grads_finite"])
    moved = jax.tree.leaves(jax.tree.map(np.array_equal, dpx.to_host(opt.master), before[1].master))
    assert not all(moved)


def _per_device_bytes(tree) -> dict:
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


@pytest.mark.slow
def test_zero_state_is_one_eighth_per_device_and_matches_replicated(data):
    adam = optax.adam(1e-2)
    zero = build("pjit", "fp16", zero=True, inner=adam)
    replicated = build("pjit", "fp16", inner=adam)
    z_state, r_state = zero.init(0), replicated.init(0)  # created in place by jit
    assert_bitwise_equal(dpx.to_host(z_state), dpx.to_host(r_state), "init")

    def check_memory(opt_z, opt_r):
        shardable = unshardable = 0
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_z)[0]:
            shard_bytes = {s.data.nbytes for s in leaf.addressable_shards}
            if any(d % N_DEVICES == 0 for d in leaf.shape):
                assert shard_bytes == {leaf.nbytes // N_DEVICES}, jax.tree_util.keystr(path)
                shardable += leaf.nbytes
            else:  # scalars and the 10-wide output bias (master, mu, nu)
                assert leaf.size <= 10, jax.tree_util.keystr(path)
                assert shard_bytes == {leaf.nbytes}
                unshardable += leaf.nbytes
        z_bytes, r_bytes = _per_device_bytes(opt_z), _per_device_bytes(opt_r)
        assert len(set(z_bytes.values())) == 1 and len(z_bytes) == N_DEVICES
        total = shardable + unshardable
        assert set(r_bytes.values()) == {total}
        ratio = next(iter(z_bytes.values())) / total
        assert ratio == (shardable / N_DEVICES + unshardable) / total
        assert 1 / N_DEVICES <= ratio < 1.01 / N_DEVICES, ratio  # measured 0.12527
        # fp32 master, Adam's mu and nu: three float32 copies of ~38k params.
        assert total > 3 * 4 * 30_000

    check_memory(z_state[1], r_state[1])
    z_params, z_opt = run(zero, dpx.to_host(z_state), data)
    r_params, r_opt = run(replicated, dpx.to_host(r_state), data)
    check_memory(z_opt, r_opt)  # the step keeps the state sharded
    init = dpx.to_host(r_state)
    z_host, r_host = dpx.to_host((z_params, z_opt)), dpx.to_host((r_params, r_opt))
    assert_bitwise_equal(z_host[1].loss_scale, r_host[1].loss_scale, "loss_scale")
    for what in ("master", "inner_state"):
        got, want, start = (getattr(t[1], what) for t in (z_host, r_host, init))
        assert rel_change_error(got, want, start) < 1e-6, what
    assert rel_change_error(z_host[0], r_host[0], init[0]) < TOLERANCE["fp16"]


def test_cli_pmap_run_saves_a_skip(tmp_path):
    path = tmp_path / "run.npz"
    final = dpx.main(
        ["--mode", "pmap", "--steps", "3", "--batch-size", "16", "--log-every", "0"]
        + ["--inject-inf-step", "1", "--save", str(path)]
    )
    saved = np.load(path)
    np.testing.assert_array_equal(saved["metrics/grads_finite"], [True, False, True])
    np.testing.assert_array_equal(saved["metrics/skipped_steps"], [0, 1, 1])
    assert saved["metrics/loss_scale"][1] == saved["metrics/loss_scale"][0] / 2
    names = [k for k in saved.files if k.startswith(("params/0/", "master/0/"))]
    assert names
    for name in names:
        after_skip = name.replace("/0/", "/1/", 1)
        assert saved[after_skip].tobytes() == saved[name].tobytes(), name
    assert int(final["skipped_steps"]) == 1 and 0.0 <= final["test_accuracy"] <= 1.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'bogus'"):
        dpx.make_data_parallel("bogus")
    with pytest.raises(ValueError, match="'pmap'"):
        dpx.make_data_parallel("pmap", zero=True)
    with pytest.raises(ValueError, match="grad_hook"):
        dpx.make_data_parallel("pjit", grad_hook=lambda g: g)
    with pytest.raises(ValueError, match="'fp8'"):
        dpx.make_data_parallel("pjit", "fp8")
    with pytest.raises(ValueError, match="batch size 30 .* 8 devices"):
        dpx.local_rows(30)
