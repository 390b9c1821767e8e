"""`loss_scaled` on the pytrees real model code uses: Equinox-style modules with `None`
leaves, the JAX MLP tutorial's `[(w, b), ...]`, NamedTuples, mixed int/bool leaves,
checked against a float64 numpy implementation of the inner optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax

LR = 1e-2
SCALE = 256.0  # float16-safe for the gradient range below


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:
    """An Equinox-like module: every field is a pytree child, arrays or not."""

    weight: Any
    bias: Any
    name: Any  # a string: filtered to None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLP:
    layers: Any
    activation: Any  # a function: filtered to None
    step: Any  # an int32 array: kept, never updated
    frozen: Any  # a bool array: kept, never updated
    depth: Any  # a Python int: filtered to None


class Layer(NamedTuple):
    w: jax.Array
    b: jax.Array


def _filter_arrays(tree):
    """What `eqx.filter(model, eqx.is_array)` gives: arrays kept, everything else None."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else None, tree)


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _params(kind: str, dtype, rng):
    w = lambda *s: _normal(rng, s, dtype)  # noqa: E731
    if kind == "equinox":
        model = MLP(
            layers=[Linear(w(5, 4), w(4), "l0"), Linear(w(4, 3), w(3), "l1")],
            activation=jax.nn.relu,
            step=jnp.asarray(7, jnp.int32),
            frozen=jnp.asarray([True, False]),
            depth=2,
        )
        return _filter_arrays(model)
    if kind == "tuples":  # the JAX MLP tutorial: [(w, b), ...]
        return [(w(5, 4), w(4)), (w(4, 3), w(3))]
    if kind == "namedtuple":
        return {"layers": (Layer(w(5, 4), w(4)), Layer(w(4, 3), w(3))), "head": None}
    raise ValueError(kind)


def _scaled_grads(params, rng):
    """Gradients of a scaled loss in each param's dtype; wide dynamic range, both signs."""

    def grad(p):
        if p is None:
            return None
        if not jnp.issubdtype(p.dtype, jnp.floating):
            return np.zeros(p.shape, jax.dtypes.float0)
        mag = np.exp(rng.uniform(np.log(1e-3), np.log(10.0), size=p.shape))
        return jnp.asarray(mag * rng.choice([-1.0, 1.0], size=p.shape) * SCALE, p.dtype)

    return jax.tree.map(grad, params, is_leaf=lambda x: x is None)


class _Reference:
    """The inner optimizer in float64 numpy, on a float64 master of each floating leaf."""

    def __init__(self, kind, params):
        self.kind = kind
        self.master = [np.asarray(p, np.float64) for p in jax.tree.leaves(params) if _floating(p)]
        self.mu = [np.zeros_like(m) for m in self.master]
        self.nu = [np.zeros_like(m) for m in self.master]
        self.t = 0

    def step(self, grads, params):
        gs = [
            np.asarray(g, np.float64) / SCALE
            for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True)
            if _floating(p)
        ]
        self.t += 1
        for i, g in enumerate(gs):
            if self.kind == "sgd":  # optax.sgd(LR, momentum=0.9)
                self.mu[i] = 0.9 * self.mu[i] + g
                self.master[i] = self.master[i] - LR * self.mu[i]
            else:  # optax.adam(LR)
                self.mu[i] = 0.9 * self.mu[i] + 0.1 * g
                self.nu[i] = 0.999 * self.nu[i] + 0.001 * g * g
                mhat = self.mu[i] / (1 - 0.9**self.t)
                vhat = self.nu[i] / (1 - 0.999**self.t)
                self.master[i] = self.master[i] - LR * mhat / (np.sqrt(vhat) + 1e-8)


def _floating(p):
    return jnp.issubdtype(p.dtype, jnp.floating)


def _inner(kind):
    return optax.sgd(LR, momentum=0.9) if kind == "sgd" else optax.adam(LR)


# one rounding of the param's dtype, or float32's rounding over a few steps
_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}


def _assert_close(got, want, rtol, what):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want) / np.maximum(np.abs(want), 1e-3)
    assert err.max() <= rtol, f"{what}: max relative error {err.max():.3g} > {rtol:.3g}"


_KINDS = ["equinox", "tuples", "namedtuple"]
_CASES = (
    # every structure in every dtype under jit, with Adam
    [(k, d, True, "adam") for k in _KINDS for d in (jnp.float32, jnp.bfloat16, jnp.float16)]
    # op by op (no jit) in one half dtype, and SGD with momentum once
    + [(k, jnp.bfloat16, False, "adam") for k in _KINDS]
    + [("equinox", jnp.float16, True, "sgd")]
)


@pytest.mark.parametrize(
    "kind, dtype, jit, inner",
    _CASES,
    ids=[f"{k}-{jnp.dtype(d).name}-{'jit' if j else 'eager'}-{i}" for k, d, j, i in _CASES],
)
def test_pytree_params_match_float64_reference(kind, dtype, jit, inner):
    rng = np.random.default_rng(0)
    params = _params(kind, dtype, rng)
    before = params
    tx = mpjax.loss_scaled(_inner(inner), mpjax.StaticLossScale(SCALE))
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    ref = _Reference(inner, params)
    for _ in range(3):
        grads = _scaled_grads(params, rng)
        ref.step(grads, params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)

    assert jax.tree.structure(params) == jax.tree.structure(before)  # None leaves stay None
    floats = [p for p in jax.tree.leaves(params) if _floating(p)]
    for i, (p, want) in enumerate(zip(floats, ref.master, strict=True)):
        assert p.dtype == dtype
        _assert_close(p, want, max(_RTOL[dtype], 1e-5), f"param {i}")
    masters = [m for m in jax.tree.leaves(state.master)]
    if dtype != jnp.float32:  # a float32 master per half param, on the float64 trajectory
        for i, (m, want) in enumerate(zip(masters, ref.master, strict=True)):
            _assert_close(m, want, 1e-5, f"master {i}")
    else:
        assert masters == []  # float32 params keep no copy
    # int and bool leaves come back bit-identical
    for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
        if not _floating(p):
            assert p.dtype == q.dtype and np.array_equal(p, q)


@pytest.mark.parametrize("kind", ["equinox", "tuples", "namedtuple"])
def test_pytree_params_skip_keeps_everything(kind):
    rng = np.random.default_rng(1)
    params = _params(kind, jnp.bfloat16, rng)
    tx = mpjax.loss_scaled(optax.adam(LR))
    state = tx.init(params)
    grads = _scaled_grads(params, rng)
    leaves, treedef = jax.tree.flatten(grads)
    last = max(i for i, g in enumerate(leaves) if g.dtype == jnp.bfloat16)
    leaves[last] = leaves[last].at[-1].set(jnp.nan)  # NaN in the last floating leaf
    updates, new_state = jax.jit(tx.update)(jax.tree.unflatten(treedef, leaves), state, params)
    new = optax.apply_updates(params, updates)
    assert not bool(new_state.grads_finite)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(new) == jax.tree.structure(params)


def test_tuple_repro_from_issue():
    w, b = jnp.ones((3, 2)), jnp.ones((2,))
    tx = mpjax.loss_scaled(optax.sgd(0.1))
    state = tx.init([(w, b)])
    grads = mpjax.find_loss_scaled_state(state).loss_scale.scale([(w, b)])
    updates, _ = tx.update(grads, state, [(w, b)])
    new = optax.apply_updates([(w, b)], updates)
    np.testing.assert_allclose(np.asarray(new[0][0]), 0.9)
    np.testing.assert_allclose(np.asarray(new[0][1]), 0.9)


@pytest.mark.parametrize(
    "leaf, culprit",
    [
        ("relu", "is a str"),
        (1.5, "is a float"),
        (jnp.ones(2, jnp.complex64), "complex64"),
        (jnp.ones(2, jnp.float8_e4m3fn), "float8_e4m3fn"),
    ],
    ids=["string", "python-float", "complex", "float8"],
)
def test_unsupported_param_leaves_named_by_path(leaf, culprit):
    params = [(jnp.ones((2,)), leaf)]
    with pytest.raises(TypeError, match=rf"param \[0\]\[1\] .*{culprit}"):
        mpjax.loss_scaled(optax.sgd(0.1)).init(params)
