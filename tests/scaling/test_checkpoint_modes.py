"""Checkpoints across `master_weights` modes: converted exactly, or refused by name, never cast.

An orbax checkpoint of `master_weights="remainder"` restored into a default-mode target used to
cast the int16 remainders to float32 numbers (a zero-gradient step then moved bf16 params by
31744), and the reverse cast float32 masters to int16; restores into or from
`master_weights=False` gave a bare AttributeError. Now a remainder is a pytree node of its own:
orbax refuses the mismatched tree at restore, flax msgpack refuses or converts where exact, and
the first update names any leftover mismatch and the fix, `mpjax.with_master_weights`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import mpjax

MODES = ["auto", "remainder", False]


def _params():
    w = np.random.default_rng(0).normal(size=(8,)).astype(np.float32)
    return {"w": jnp.asarray(w, jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}


def _grads(step):
    rng = np.random.default_rng(step + 1)
    return {
        "w": jnp.asarray(rng.normal(size=(8,)) * 1e-1, jnp.bfloat16),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


def _tx(mode):
    return mpjax.loss_scaled(optax.adam(1e-2), mpjax.StaticLossScale(1.0), master_weights=mode)


@functools.cache
def _step(mode):
    tx = _tx(mode)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


def _train(mode, steps, params=None, state=None):
    params = _params() if params is None else params
    state = _tx(mode).init(params) if state is None else state
    for i in range(steps):
        params, state = _step(mode)(params, state, _grads(i))
    return params, state


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def _zero_step(mode, params, state):
    return _step(mode)(params, state, jax.tree.map(jnp.zeros_like, params))[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One orbax checkpoint and one msgpack blob per mode, after 3 steps."""
    out = {}
    ckpt = ocp.StandardCheckpointer()
    for mode in MODES:
        params, state = _train(mode, 2)
        path = tmp_path_factory.mktemp("ckpt") / str(mode)
        ckpt.save(path, state)
        ckpt.wait_until_finished()
        out[mode] = (params, state, path, serialization.to_bytes(state))
    return out


def _orbax_restore(path, target):
    return ocp.StandardCheckpointer().restore(path, target)


@pytest.mark.parametrize(("src", "dst"), [("remainder", "auto"), ("auto", "remainder")])
def test_orbax_refuses_remainder_float_switch_at_restore(saved, src, dst):
    """Used to cast int16 remainders to float32 (and back): params moved by 31744."""
    params = saved[src][0]
    with pytest.raises(ValueError, match=r"master\.w"):
        _orbax_restore(saved[src][2], _tx(dst).init(params))


def _restore(saved, src, dst, fmt):
    params, _, path, blob = saved[src]
    target = _tx(dst).init(params)
    if fmt == "orbax":
        return _orbax_restore(path, target)
    return serialization.from_bytes(target, blob)


@pytest.mark.parametrize("fmt", ["orbax", "msgpack"])
def test_from_false_into_auto_names_the_fix_at_first_update(saved, fmt):
    """Used to fail with a bare AttributeError ('dict' object has no attribute 'dtype')."""
    state = _restore(saved, False, "auto", fmt)
    with pytest.raises(ValueError, match=r"master_weights=False.*with_master_weights"):
        _zero_step("auto", saved[False][0], state)


def test_orbax_from_false_into_remainder_fails_at_restore(saved):
    with pytest.raises(ValueError, match=r"master\.w"):
        _restore(saved, False, "remainder", "orbax")


def test_msgpack_from_false_into_remainder_converts_exactly(saved):
    """A param without master is its own master: its remainder is zero."""
    state = _restore(saved, False, "remainder", "msgpack")
    assert not np.any(np.asarray(state.master["w"].remainder))
    assert _bits(state.inner_state) == _bits(saved[False][1].inner_state)
    _zero_step("remainder", saved[False][0], state)  # and it trains on


def test_msgpack_into_false_drops_the_master(saved):
    """Used to raise AttributeError inside flax: now the masters are dropped, the rest kept."""
    params, want, _, blob = saved["auto"]
    state = serialization.from_bytes(_tx(False).init(params), blob)
    assert not jax.tree.leaves(state.master)
    assert _bits(state.inner_state) == _bits(want.inner_state)
    _zero_step(False, params, state)


def test_msgpack_float_into_remainder_names_the_fix(saved):
    params, _, _, blob = saved["auto"]
    with pytest.raises(ValueError, match=r"master_weights='remainder'.*with_master_weights"):
        serialization.from_bytes(_tx("remainder").init(params), blob)


def test_msgpack_remainder_into_auto_names_the_fix_at_first_update(saved):
    params, _, _, blob = saved["remainder"]
    state = serialization.from_bytes(_tx("auto").init(params), blob)
    with pytest.raises(ValueError, match=r"int16 remainder.*with_master_weights"):
        _zero_step("auto", params, state)


@pytest.mark.parametrize(
    ("src", "dst"), [("remainder", "auto"), ("auto", "remainder"), (False, "auto")]
)
def test_with_master_weights_converts_exactly(saved, src, dst):
    """Restore into the checkpoint's own mode, convert, resume: bit for bit the same training.

    float32 masters and remainders train alike bit for bit; a run without masters continues
    as a run whose masters start at the params.
    """
    params, state, path, _ = saved[src]
    restored = _orbax_restore(path, _tx(src).init(params))
    converted = mpjax.with_master_weights(restored, params, dst)
    got, _ = _train(dst, 2, params, converted)
    if src is False:  # the same inner state, masters starting at the params
        fresh = restored._replace(master=_tx(dst).init(params).master)
        want, _ = _train(dst, 2, params, fresh)
    else:
        want, _ = _train(src, 2, params, state)
    assert _bits(got) == _bits(want)
    np.testing.assert_array_equal(
        np.asarray(mpjax.master_params(converted, params)["w"]),
        np.asarray(mpjax.master_params(restored, params)["w"]),
    )
