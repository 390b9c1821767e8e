"""Checkpoints written by mpjax 6a474e7 resume, through `mpjax.upgrade_state`, as 6a474e7 went on.

The fixtures (`tests/fixtures/checkpoints_6a474e7/`) were written by the old release itself with
`tests/fixtures/write_checkpoints.py`: `loss_scaled` states of every `master_weights` mode with
float32, bfloat16 and int8 optimizer state, saved with orbax and flax msgpack after 2 steps,
and the params, float32 masters and loss scale that 6a474e7 computed in the 3 steps after.
6a474e7 kept bare int16 remainders (orbax refused them in a `Remainder` target) and int8 scales
per block of the flattened leaf (orbax refused the shapes; msgpack restored them and the first
update failed in `lax.cond`).
"""

from __future__ import annotations

import functools
import pathlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import mpjax
from mpjax._src.scaling.loss_scaled import STATE_LAYOUT_VERSION
from mpjax._src.scaling.master import Remainder
from tests.fixtures import write_checkpoints as writer

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "checkpoints_6a474e7"
LR = 1e-2  # the writer's Adam learning rate


def _restore_raw(name: str, fmt: str):
    """The checkpoint restored as a user would without a target (orbax, or flax msgpack)."""
    if fmt == "orbax":
        return ocp.StandardCheckpointer().restore(FIXTURES / "orbax" / name)
    return flax.serialization.msgpack_restore(
        (FIXTURES / "msgpack" / f"{name}.msgpack").read_bytes()
    )


def _template(name: str):
    p = writer.params()
    return {"params": p, "opt_state": writer.tx(name).init(p)}


@functools.cache
def _step(name: str):
    return writer.train_step(name)


def _resume(restored, name: str) -> list[dict]:
    tree = mpjax.upgrade_state(restored, _template(name))
    p, state = tree["params"], tree["opt_state"]
    records = []
    for i in range(writer.STEPS_BEFORE, writer.STEPS_BEFORE + writer.STEPS_AFTER):
        p, state = _step(name)(p, state, writer.targets(i))
        records.append(writer.record(p, state))
    return records


def _bf16_ulp(x: np.ndarray) -> np.ndarray:
    x = np.abs(x.astype(np.float32))
    return np.exp2(np.floor(np.log2(np.maximum(x, np.finfo(np.float32).tiny))) - 7)


@pytest.mark.parametrize("fmt", ["orbax", "msgpack"])
@pytest.mark.parametrize("name", writer.names())
def test_resumes_as_6a474e7_went_on(name, fmt):
    expected = np.load(FIXTURES / "expected" / f"{name}.npz")
    records = _resume(_restore_raw(name, fmt), name)
    int8 = name.endswith("int8")
    for i, record in enumerate(records, start=writer.STEPS_BEFORE):
        for key, got in record.items():
            want = expected[f"{i}/{key}"]
            assert got.dtype.itemsize == want.dtype.itemsize, (name, key)
            if int8 and key.endswith("/w"):
                # The 2-row leaf's int8 moments changed layout (per-row blocks now): they are
                # quantized once more, and today's per-row scales differ from 6a474e7's, so
                # training follows today's int8 code: close to the old run, not bitwise.
                got, want = got.astype(np.float32), want.view(got.dtype).astype(np.float32)
                # 5% of the 3 steps' largest move; a bfloat16 value may round the other way.
                rounds = key.startswith("params/") or name.startswith("false")
                bound = 0.05 * LR * writer.STEPS_AFTER + (_bf16_ulp(want) if rounds else 0.0)
                assert np.all(np.abs(got - want) <= bound), (name, fmt, i, key)
            else:  # every other leaf (the int8 1-D leaf too): bit for bit
                assert got.tobytes() == want.tobytes(), (name, fmt, i, key)


@pytest.mark.parametrize("name", ["remainder-f32", "auto-int8", "auto-f32"])
def test_old_layouts_do_not_restore_into_todays_target_directly(name):
    """Why the upgrade is needed: orbax refuses the old tree against today's target (bare
    remainders, int8 scale shapes, and in every mode the `layout_version` it lacks)."""
    with pytest.raises(ValueError):
        ocp.StandardCheckpointer().restore(FIXTURES / "orbax" / name, _template(name))


def test_upgraded_state_has_todays_layout():
    state = mpjax.upgrade_state(
        _restore_raw("remainder-int8", "msgpack"), _template("remainder-int8")
    )
    opt = state["opt_state"]
    assert int(opt.layout_version) == STATE_LAYOUT_VERSION
    assert isinstance(opt.master["w"], Remainder)
    mu_w = opt.inner_state.inner_state[0].mu["w"]
    assert mu_w.scales.shape == (2, 1)  # was (1,): one block of the flattened leaf


@pytest.mark.parametrize(
    ("name", "mode", "says"),
    [
        ("remainder-f32", "auto", "master_weights='remainder'"),
        ("auto-f32", "remainder", "master_weights='auto' or True"),
        ("false-f32", "auto", "master_weights=False"),
        ("true-f32", False, "master_weights='auto' or True"),
    ],
)
def test_another_mode_is_named_with_the_conversion(name, mode, says):
    p = writer.params()
    other = mpjax.loss_scaled(optax.adam(LR), master_weights=mode).init(p)
    with pytest.raises(ValueError, match="another master_weights mode") as e:
        mpjax.upgrade_state(_restore_raw(name, "orbax"), {"params": p, "opt_state": other})
    assert says in str(e.value) and "with_master_weights" in str(e.value)


def test_converting_after_upgrade_resumes_exactly():
    """The documented path across modes: upgrade in the checkpoint's mode, then convert."""
    name = "remainder-f32"
    tree = mpjax.upgrade_state(_restore_raw(name, "orbax"), _template(name))
    p = tree["params"]
    auto = mpjax.with_master_weights(tree["opt_state"], p, "auto")
    np.testing.assert_array_equal(
        mpjax.master_params(auto, p)["w"], mpjax.master_params(tree["opt_state"], p)["w"]
    )


def test_newer_layout_is_refused():
    tree = _template("auto-f32")
    newer = jax.tree.map(lambda x: x, tree)
    newer["opt_state"] = newer["opt_state"]._replace(layout_version=jnp.int32(99))
    with pytest.raises(ValueError, match="layout version 99, newer than this mpjax reads"):
        mpjax.upgrade_state(newer, tree)


@pytest.mark.parametrize("mode", ["remainder", "int8"])
def test_upgraded_state_is_placed_like_the_template_under_explicit_axes(mode):
    """A restored checkpoint is on one device; under Explicit mesh axes with sharded params the
    upgraded state takes the template's shardings, so the jitted update runs (it raised
    "select cases must have the same shardings")."""
    import flax.serialization as fs
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((16, 64), jnp.bfloat16), NamedSharding(mesh, P(None, "d")))
        p = {"w": w}
        inner = optax.adam(1e-3)
        if mode == "int8":
            inner = mpjax.low_precision_state(inner, jnp.int8)
        tx = mpjax.loss_scaled(inner, master_weights="remainder" if mode == "remainder" else "auto")
        state = tx.init(p)
        upgraded = mpjax.upgrade_state(fs.msgpack_restore(fs.to_bytes(state)), tx.init(p))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(upgraded), strict=True):
            assert a.sharding == b.sharding and bool(jnp.array_equal(a, b))
        updates, _ = jax.jit(tx.update)(p, upgraded, p)
        assert bool(jnp.all(jnp.isfinite(updates["w"])))
