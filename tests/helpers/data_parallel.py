"""Shared helpers of the data-parallel tests: builds, runs and tree comparisons."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
from examples import data_parallel as dpx
from examples.digits_cnn import (
    global_batch_indices,
    init_state,
    make_model,
    make_optimizer,
    precision_policy,
)

BATCH = 32  # global batch: 4 rows per device on 8 devices
STEPS = 3
# SGD with momentum is linear in the gradients, so rounding differences between a per-device
# and a global reduction stay of their own size (Adam's g/sqrt(v) turns the sign of a
# near-zero gradient component into a full +-lr step).
INNER = optax.sgd(0.1, momentum=0.9)


def loss_scale(precision: str) -> mpjax.LossScale:
    """Small growth interval so the scale changes within the test's few steps."""
    if precision == "fp16":
        return mpjax.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
    return mpjax.NoOpLossScale()


def build(mode: str, precision: str, **kwargs) -> dpx.DataParallel:
    kwargs.setdefault("inner", INNER)
    return dpx.make_data_parallel(mode, precision, loss_scale=loss_scale(precision), **kwargs)


def initial_host_state(precision: str, inner=INNER):
    """``(params, opt_state)`` on the host, from seed 0."""
    model = make_model(precision_policy(precision))
    tx = make_optimizer(precision, loss_scale=loss_scale(precision), inner=inner)
    return jax.device_get(jax.jit(functools.partial(init_state, model, tx))(jax.random.key(0)))


def batch(data, step: int):
    """The global batch of `step` (numpy)."""
    x, y = data
    idx = global_batch_indices(len(y), BATCH, step, seed=0)
    return x[idx], y[idx]


def run(dp: dpx.DataParallel, state, data, steps: int = STEPS):
    """Places `state` and trains `steps` steps on the global batches 0..steps-1."""
    params, opt_state = dp.place(state)
    for step in range(steps):
        params, opt_state, _ = dp.step(params, opt_state, *dp.put_batch(*batch(data, step)))
    return params, opt_state


def per_device(dp: dpx.DataParallel, tree) -> list:
    """One host copy of `tree` per device: pmap replicas, or the shards of replicated arrays.

    Arrays sharded over devices (ZeRO) appear as their global value in every copy.
    """
    if dp.mode == "pmap":
        host = dpx.to_host(tree)
        n = jax.tree.leaves(host)[0].shape[0]
        return [jax.tree.map(lambda a, i=i: a[i], host) for i in range(n)]

    def on(device):
        def get(a):
            if a.sharding.is_fully_replicated:
                (shard,) = [s for s in a.addressable_shards if s.device == device]
                return np.asarray(shard.data)
            return np.asarray(a)

        return jax.tree.map(get, tree)

    return [on(d) for d in dp.mesh.devices.flat]


def assert_bitwise_equal(got, want, what: str = "") -> None:
    """Same tree structure, and every leaf the same dtype, shape and bytes."""
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
    w_leaves, w_def = jax.tree.flatten(want)
    assert jax.tree.structure(got) == w_def, f"{what}: structures differ"
    for (path, g), w in zip(g_leaves, w_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        name = f"{what}{jax.tree_util.keystr(path)}"
        got_kind, want_kind = f"{g.dtype}{g.shape}", f"{w.dtype}{w.shape}"
        assert got_kind == want_kind, f"{name}: {got_kind} vs {want_kind}"
        assert g.tobytes() == w.tobytes(), f"{name}: values differ (max |d| {_maxdiff(g, w)})"


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def rel_change_error(got, want, start) -> float:
    """``||got - want|| / ||want - start||`` over all floating leaves, in float64.

    The error relative to what training changed, so that params much larger than their
    updates do not hide a wrong update. NaN when the trees hold no floating leaves.
    """
    num = den = 0.0
    trees = (jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(start))
    for g, w, s in zip(*trees, strict=True):
        if not jnp.issubdtype(np.asarray(w).dtype, jnp.floating):
            continue
        g, w, s = (np.asarray(v).astype(np.float64) for v in (g, w, s))
        num += float(np.sum((g - w) ** 2))
        den += float(np.sum((w - s) ** 2))
    return math.sqrt(num / den) if den else math.nan


def assert_skipped(before, after, what: str) -> None:
    """`after` is `before` with one skipped step: params and optimizer state untouched,
    the scale backed off once."""
    params0, opt0 = before
    params, opt = after
    assert_bitwise_equal(params, params0, f"{what} params")
    assert_bitwise_equal(opt.master, opt0.master, f"{what} master")
    assert_bitwise_equal(opt.inner_state, opt0.inner_state, f"{what} inner_state")
    assert float(opt.loss_scale.loss_scale) == float(opt0.loss_scale.loss_scale) / 2, what
    assert int(opt.loss_scale.counter) == 0, what
    assert not bool(opt.grads_finite), what
    assert int(opt.skipped_steps) == int(opt0.skipped_steps) + 1, what
    assert int(opt.consecutive_skips) == 1, what
