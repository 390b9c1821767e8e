"""Old release states restored the old way meet mpjax's entry points: each names
`mpjax.upgrade_state` (issue 44: flax's and orbax's own restores say nothing of it).

The states are the 6a474e7 fixtures (`tests/fixtures/checkpoints_6a474e7/`), restored without a
target, as orbax and flax msgpack give them, and a `LossScaledState` without `layout_version`
(what unpickling a 6a474e7 state gives today).
"""

from __future__ import annotations

import pathlib
import pickle
import re
import typing

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import mpjax
from mpjax._src.scaling import loss_scaled as loss_scaled_module
from mpjax._src.scaling.loss_scaled import LossScaledState
from tests.fixtures import write_checkpoints as writer

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "checkpoints_6a474e7"
NAMES = ["remainder-int8", "auto-f32"]
UPGRADE = r"restore it through mpjax\.upgrade_state\(old, template\).*docs/guides/migration\.md"


def _restore(name: str, fmt: str):
    if fmt == "orbax":
        return ocp.StandardCheckpointer().restore(FIXTURES / "orbax" / name)
    return fs.msgpack_restore((FIXTURES / "msgpack" / f"{name}.msgpack").read_bytes())


def _grads(p):
    return jax.tree.map(jnp.ones_like, p)


@pytest.mark.parametrize("fmt", ["orbax", "msgpack"])
@pytest.mark.parametrize("name", NAMES)
def test_update_given_an_old_state_dict_names_upgrade_state(name, fmt):
    """It said only "loss_scaled: state must be a LossScaledState, got dict"."""
    tree = _restore(name, fmt)
    p = writer.params()
    with pytest.raises(TypeError, match="6a474e7 or older .*without layout_version") as e:
        writer.tx(name).update(_grads(p), tree["opt_state"], p)
    assert "got dict" in str(e.value)
    assert re.search(UPGRADE, str(e.value))


@pytest.mark.parametrize("fmt", ["orbax", "msgpack"])
@pytest.mark.parametrize("name", NAMES)
def test_train_step_on_an_old_restored_tree_names_upgrade_state(name, fmt):
    """The fixture's own jitted step: `scale_loss` meets the dict first (it said "no
    mpjax.loss_scaled state found")."""
    tree = _restore(name, fmt)
    with pytest.raises(ValueError, match=r"at \['opt_state'\] is a loss_scaled state of mpjax "):
        writer.train_step(name)(writer.params(), tree, writer.targets(0))
    for helper in (mpjax.get_loss_scale, mpjax.scaling_metrics, mpjax.raise_if_diverged):
        with pytest.raises(ValueError, match=UPGRADE):
            helper(tree)


def test_todays_state_restored_without_target_names_upgrade_state_too():
    p = writer.params()
    tx = writer.tx("auto-f32")
    restored = fs.msgpack_restore(fs.to_bytes(tx.init(p)))
    with pytest.raises(TypeError, match=r"restored without a target \(a dict") as e:
        tx.update(_grads(p), restored, p)
    assert "mpjax.upgrade_state" in str(e.value)
    with pytest.raises(ValueError, match="restored without a target"):
        mpjax.scale_loss(1.0, restored)


def test_other_values_keep_their_plain_messages():
    p = {"w": jnp.ones(2)}
    tx = mpjax.loss_scaled(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"got tuple$"):
        tx.update(p, (tx.init(p),), p)
    with pytest.raises(ValueError, match="no mpjax.loss_scaled state found"):
        mpjax.get_loss_scale({"a": {"b": 1}})


def _old_state(name: str) -> LossScaledState:
    """A 6a474e7 state as its six fields: the fixture upgraded, then stripped of the seventh."""
    p = writer.params()
    tree = mpjax.upgrade_state(
        _restore(name, "msgpack"), {"params": p, "opt_state": writer.tx(name).init(p)}
    )
    return LossScaledState(*tree["opt_state"][:6])


def test_state_without_layout_version_is_refused_naming_upgrade_state():
    old = _old_state("auto-f32")
    assert old.layout_version is None
    p = writer.params()
    tx = writer.tx("auto-f32")
    with pytest.raises(ValueError, match="has no layout_version") as e:
        tx.update(_grads(p), old, p)
    assert re.search(UPGRADE, str(e.value))
    with pytest.raises(ValueError, match="has no layout_version"):
        jax.jit(tx.update)(_grads(p), old, p)
    with pytest.raises(ValueError, match="has no layout_version"):
        mpjax.scale_loss(1.0, old)
    upgraded = mpjax.upgrade_state(old, tx.init(p))
    assert int(upgraded.layout_version) == 2
    tx.update(_grads(p), upgraded, p)


def test_unpickled_6a474e7_state_reaches_the_refusal(monkeypatch):
    """A pickle of 6a474e7's six-field LossScaledState unpickles today (it raised Python's
    "missing 1 required positional argument") and is refused at the update, naming the fix."""
    fields = {f: LossScaledState.__annotations__[f] for f in LossScaledState._fields[:6]}
    Old = typing.NamedTuple("LossScaledState", list(fields.items()))
    Old.__module__ = loss_scaled_module.__name__
    state = writer.tx("auto-f32").init(writer.params())
    with monkeypatch.context() as m:
        m.setattr(loss_scaled_module, "LossScaledState", Old)
        blob = pickle.dumps(Old(*state[:6]))
    old = pickle.loads(blob)
    assert type(old) is LossScaledState and old.layout_version is None
    p = writer.params()
    with pytest.raises(ValueError, match="mpjax.upgrade_state"):
        writer.tx("auto-f32").update(_grads(p), old, p)
    np.testing.assert_array_equal(
        mpjax.upgrade_state(old, state).loss_scale.loss_scale, state.loss_scale.loss_scale
    )
