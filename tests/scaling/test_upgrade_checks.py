"""`mpjax.upgrade_state` under real set-ups: meshes without `jax.set_mesh`, abstract templates,
dtypes, int8 codes and `layout_version` checked (each refused naming the leaf and the fix).

The 8 simulated devices come from tests/conftest.py.
"""

from __future__ import annotations

import re

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax


def _roundtrip(tree):
    """`tree` saved and restored without a target (NumPy leaves on the host), as msgpack does."""
    return fs.msgpack_restore(fs.to_bytes(tree))


def _fsdp(axis_type, shape=(16, 64)):
    """Params split over 8 devices along their first axis (FSDP), no `jax.set_mesh`."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
    w = jax.device_put(
        jnp.linspace(-1, 1, np.prod(shape)).reshape(shape).astype(jnp.bfloat16),
        NamedSharding(mesh, P("d", None)),
    )
    return mesh, {"w": w}


def _tx(state):
    inner = optax.adam(1e-3)
    if state == "int8":
        inner = mpjax.low_precision_state(inner, jnp.int8)
    return mpjax.loss_scaled(inner)


def _assert_same_values(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()


# 1. A template sharded over a mesh without jax.set_mesh.


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("state", ["f32", "int8"])
def test_upgraded_state_on_a_mesh_without_set_mesh_runs_the_jitted_update(axis_type, state):
    """tx.init's scalars are uncommitted on device 0; the upgrade used to commit them there and
    the jitted update failed with "incompatible devices"."""
    mesh, p = _fsdp(axis_type)
    tx = _tx(state)
    template = tx.init(p)
    upgraded = mpjax.upgrade_state(_roundtrip(template), template)
    devices = set(mesh.devices.flat)
    for t, u in zip(jax.tree.leaves(template), jax.tree.leaves(upgraded), strict=True):
        assert u.sharding.device_set == devices  # every leaf over the mesh
        if t.committed:
            assert u.sharding == t.sharding  # the template's own sharding
        else:
            assert u.ndim == 0 and u.sharding.is_fully_replicated  # tx.init's scalars
    _assert_same_values(upgraded, template)
    step = jax.jit(tx.update)
    want_u, want_s = step(p, template, p)
    got_u, got_s = step(p, upgraded, p)
    _assert_same_values((got_u, got_s), (want_u, want_s))


def test_scalars_committed_to_one_device_are_replicated_over_the_template_mesh():
    """An orbax-style abstract template records tx.init's scalars on device 0."""
    mesh, p = _fsdp(AxisType.Auto)
    tx = _tx("f32")
    state = tx.init(p)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    upgraded = mpjax.upgrade_state(_roundtrip(state), abstract)
    assert all(x.sharding.device_set == set(mesh.devices.flat) for x in jax.tree.leaves(upgraded))
    jax.jit(tx.update)(p, upgraded, p)


def test_single_device_template_stays_as_tx_init_leaves_it():
    p = {"w": jnp.ones((4, 8), jnp.bfloat16)}
    tx = _tx("f32")
    template = tx.init(p)
    upgraded = mpjax.upgrade_state(_roundtrip(template), template)
    for t, u in zip(jax.tree.leaves(template), jax.tree.leaves(upgraded), strict=True):
        assert u.committed == t.committed and u.sharding.device_set == t.sharding.device_set
    _assert_same_values(upgraded, template)


# 2. An abstract template (jax.eval_shape, orbax's usual target).


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_eval_shape_template_gives_concrete_arrays_laid_out_like_it(axis_type):
    """It crashed with a bare `TypeError: int() ... ShapeDtypeStruct`. Explicit axes: the
    template built as documented, under `jax.set_mesh` (jax 0.12's `eval_shape` outside it
    drops Adam's moments' shardings), used without it."""
    mesh, p = _fsdp(axis_type)
    tx = _tx("f32")
    state = tx.init(p)
    if axis_type == AxisType.Explicit:
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(tx.init, p)
    else:
        abstract = jax.eval_shape(tx.init, p)
    tree = mpjax.upgrade_state(
        _roundtrip({"params": p, "opt_state": state}), {"params": p, "opt_state": abstract}
    )
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree))
    _assert_same_values(tree["opt_state"], state)
    for a, u in zip(jax.tree.leaves(abstract), jax.tree.leaves(tree["opt_state"]), strict=True):
        if a.sharding is not None:  # Explicit axes: the abstract mesh, resolved to `mesh`
            assert u.sharding == NamedSharding(mesh, a.sharding.spec)
        elif u.ndim == 0:  # tx.init's scalars: replicated over the params' mesh
            assert u.sharding == NamedSharding(mesh, P()) and u.committed
        else:  # Auto axes: eval_shape gives no sharding; placed by the jitted step
            assert not u.committed and axis_type == AxisType.Auto
    jax.jit(tx.update)(p, tree["opt_state"], tree["params"])


def test_eval_shape_template_alone_resolves_its_abstract_mesh_under_set_mesh():
    mesh, p = _fsdp(AxisType.Explicit)
    tx = _tx("f32")
    state = tx.init(p)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(tx.init, p)
    with pytest.raises(ValueError, match=r"abstract mesh .*jax.set_mesh\(mesh\)"):
        mpjax.upgrade_state(_roundtrip(state), abstract)  # no concrete mesh to be found
    with jax.set_mesh(mesh):
        upgraded = mpjax.upgrade_state(_roundtrip(state), abstract)
        _assert_same_values(upgraded, state)
        assert upgraded.inner_state[0].mu["w"].sharding == NamedSharding(mesh, P("d", None))
        jax.jit(tx.update)(p, upgraded, p)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_abstract_leaves_without_sharding_beside_a_mesh(axis_type):
    """An abstract template of no shardings beside the params on a mesh: the scalars are
    replicated over the mesh, the other leaves come back uncommitted (as the template says
    nothing of their placement); under Auto axes the jitted update runs on them."""
    mesh, p = _fsdp(axis_type)
    tx = _tx("f32")
    state = tx.init(p)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    tree = mpjax.upgrade_state(
        _roundtrip({"params": p, "opt_state": state}), {"params": p, "opt_state": abstract}
    )
    _assert_same_values(tree["opt_state"], state)
    for x in jax.tree.leaves(tree["opt_state"]):
        if x.ndim == 0:
            assert x.sharding == NamedSharding(mesh, P()) and x.committed
        else:
            assert not x.committed
    if axis_type == AxisType.Auto:
        jax.jit(tx.update)(p, tree["opt_state"], tree["params"])


def test_eval_shape_template_without_shardings_on_one_device():
    p = {"w": jnp.ones((4, 8), jnp.float16), "b": jnp.zeros((3,), jnp.float32)}
    tx = mpjax.loss_scaled(optax.adam(1e-3), master_weights="remainder")
    state = tx.init(p)
    upgraded = mpjax.upgrade_state(_roundtrip(state), jax.eval_shape(tx.init, p))
    _assert_same_values(upgraded, state)
    tx.update(p, upgraded, p)


# 3. Dtypes: nothing is cast.


def _tree(dtype, mode="auto", state="f32"):
    p = {"w": jnp.ones((4, 8), dtype), "b": jnp.zeros((3,), jnp.float32)}
    inner = optax.adam(1e-3)
    if state != "f32":
        inner = mpjax.low_precision_state(inner, state, rounding="nearest")
    return {"params": p, "opt_state": mpjax.loss_scaled(inner, master_weights=mode).init(p)}


@pytest.mark.parametrize(
    ("saved", "template"),
    [
        (jnp.bfloat16, jnp.float16),  # f16 params came back bf16
        (jnp.float16, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16),  # refused as "another master_weights mode"
        (jnp.bfloat16, jnp.float32),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "remainder"])
def test_params_of_another_dtype_are_refused_naming_both_dtypes(saved, template, mode):
    restored = _roundtrip(_tree(saved, mode))
    with pytest.raises(ValueError) as e:
        mpjax.upgrade_state(restored, _tree(template, mode))
    msg = str(e.value)
    assert "params/w is " + jnp.dtype(saved).name in msg
    assert "template's " + jnp.dtype(template).name in msg
    assert "Upgrade with a template built with the dtypes that wrote the checkpoint" in msg
    assert "another master_weights mode" not in msg


def test_optimizer_state_of_another_dtype_is_refused_naming_the_leaf():
    restored = _roundtrip(_tree(jnp.bfloat16, state="bf16"))
    with pytest.raises(
        ValueError, match=r"inner_state/0/mu/[bw] is bfloat16, the template's float32"
    ):
        mpjax.upgrade_state(restored, _tree(jnp.bfloat16, state="float32"))


def test_master_of_another_kind_without_params_names_the_dtype_rule_too():
    """Only the optimizer state: a float32 param's absent master reads as master_weights=False."""
    restored = _roundtrip(_tree(jnp.float32)["opt_state"])
    with pytest.raises(ValueError, match="another master_weights mode") as e:
        mpjax.upgrade_state(restored, _tree(jnp.bfloat16)["opt_state"])
    assert "or for params of another dtype" in str(e.value)


# 4. int8 codes of the wrong shape.


@pytest.mark.parametrize(
    ("codes", "says"),
    [
        (
            np.zeros((4, 4), np.int8),
            r"codes of shape \(4, 4\) and dtype int8, the template's \(4, 8\)",
        ),
        (np.zeros((8, 4), np.int8), r"codes of shape \(8, 4\)"),
        (np.zeros((4, 8), np.int16), r"codes is int16, the template's int8"),
    ],
)
def test_int8_codes_of_another_shape_or_dtype_are_refused_at_upgrade(codes, says):
    """They passed, and the first update failed inside `lax.cond` ("branches must have equal
    output types")."""
    p = {"w": jnp.ones((4, 8), jnp.bfloat16)}
    tx = _tx("int8")
    template = tx.init(p)
    restored = _roundtrip(template)
    restored["inner_state"]["inner_state"]["0"]["mu"]["w"]["codes"] = codes
    with pytest.raises(ValueError, match=says) as e:
        mpjax.upgrade_state(restored, template)
    assert "inner_state/inner_state/0/mu/w" in str(e.value)


# 5. A corrupt layout_version.


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (-1, "negative"),
        (np.int32(-1), "negative"),
        (1.5, "a float"),
        (np.float32(1.0), "a float32 scalar"),
        ("1", "a str"),
        ("abc", "a str"),
        (np.ones(3, np.int32), r"an array of shape \(3,\)"),
        (np.ones((1,), np.int32), r"an array of shape \(1,\)"),
        (True, "a bool"),
        (np.bool_(True), "a bool"),
        ({"v": 1}, "a dict"),
    ],
    ids=repr,
)
def test_corrupt_layout_version_is_refused(value, why):
    template = _tree(jnp.bfloat16)["opt_state"]
    restored = _roundtrip(template)
    restored["layout_version"] = value
    with pytest.raises(ValueError, match="not a state layout version") as e:
        mpjax.upgrade_state(restored, template)
    assert "the checkpoint's layout_version is" in str(e.value)
    assert re.search(why, str(e.value))


@pytest.mark.parametrize("value", [0, 1, np.int64(1), np.asarray(1, np.int32), jnp.int32(1)])
def test_valid_layout_versions_are_read(value):
    template = _tree(jnp.bfloat16)["opt_state"]
    restored = _roundtrip(template)
    restored["layout_version"] = value
    upgraded = mpjax.upgrade_state(restored, template)
    assert upgraded.layout_version.dtype == jnp.int32 and int(upgraded.layout_version) == 2
