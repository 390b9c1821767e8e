"""Autocast, apply_policy and the fp8 paths on sharded params, Explicit and Auto mesh axes.

8 simulated CPU devices, `jax.make_mesh` + `jax.set_mesh`, a Megatron-style MLP whose weights
are sharded (tests/helpers/sharding.py). Every result equals the unsharded run's. Explicit
axes make shardings part of JAX's types: a value the autocast rewrite re-creates (custom_jvp
tangents, `jnp.where`'s nested jit, cotangents of nested jits) must carry its sharding.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import update_fp8_meta
from tests.helpers.sharding import (
    AXIS,
    SHARD_MAP_SPECS,
    SPECS,
    X_SPEC,
    D,
    H,
    assert_trees_close,
    make_mesh,
    mlp_input,
    mlp_loss,
    mlp_params,
    on_mesh,
    place,
)

BF16 = "p=f32,c=bf16,o=f32"
FP8 = Fp8Recipe(min_dim=16)
# Relative errors vs the unsharded run: sharded GEMMs sum in another order, rounded to bf16.
TOL = {"float32": 1e-6, BF16: 1e-2}
# (policy, fp8 recipe, tolerance)
CASES = {
    "float32": ("float32", None, TOL["float32"]),
    "bf16": (BF16, None, TOL[BF16]),
    "fp8": (BF16, FP8, 5e-2),
}


def _autocast_step(case):
    policy, fp8, _ = CASES[case]
    return jax.value_and_grad(mpjax.autocast(mlp_loss, policy, fp8=fp8))


@functools.cache
def _unsharded(case):
    return on_mesh(_autocast_step(case), None, (mlp_params(), mlp_input()), (SPECS, X_SPEC))


# Auto axes take the path of the bf16 policy only (no sharding in the types: the same rewrite).
@pytest.mark.parametrize(
    ("kind", "case"),
    [("explicit", "float32"), ("explicit", "bf16"), ("explicit", "fp8"), ("auto", "bf16")],
)
def test_autocast_value_and_grad_on_sharded_params_match_unsharded(kind, case):
    step = _autocast_step(case)
    args, specs = (mlp_params(), mlp_input()), (SPECS, X_SPEC)
    got = on_mesh(step, kind, args, specs)
    assert_trees_close(got, _unsharded(case), CASES[case][2], what=f"{kind}/{case}")
    if kind == "explicit":  # each gradient has its param's sharding type
        mesh = make_mesh(kind)
        with jax.set_mesh(mesh):
            _, grads = jax.eval_shape(step, *place(args, specs, mesh))
        assert {k: g.sharding.spec for k, g in grads.items()} == SPECS


# ----------------------------------------------------------------------------- shard_map


def _tp_loss(reduce):
    """The MLP's loss on one device's columns/rows; `reduce` sums the second GEMM."""

    def loss(params, x):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        h = jax.nn.relu(jnp.where(h > -0.1, h, -1e9))
        y = reduce(h @ params["w2"]) + params["b2"]
        return jnp.mean(jnp.square(y - 1.0))

    return loss


def _shard_mapped(fun):
    return jax.shard_map(fun, in_specs=(SHARD_MAP_SPECS, X_SPEC), out_specs=P(), check_vma=True)


def _psum(y):
    return jax.lax.psum(y, AXIS)


SHARD_MAP = {  # how autocast and shard_map compose: (sharded step, unsharded step)
    "autocast_inside": (
        lambda pol: _shard_mapped(mpjax.autocast(_tp_loss(_psum), pol)),
        lambda pol: mpjax.autocast(_tp_loss(lambda y: y), pol),
    ),
    "autocast_around": (
        lambda pol: mpjax.autocast(_shard_mapped(_tp_loss(_psum)), pol),
        lambda pol: mpjax.autocast(_tp_loss(lambda y: y), pol),
    ),
}


# The float32 policy rewrites too: autocast around shard_map failed even there.
@pytest.mark.parametrize(
    ("how", "policy"), [("autocast_inside", BF16), ("autocast_around", "float32")]
)
def test_autocast_with_shard_map_check_vma_matches_unsharded(how, policy):
    sharded, unsharded = (jax.value_and_grad(make(policy)) for make in SHARD_MAP[how])
    args, specs = (mlp_params(), mlp_input()), (SHARD_MAP_SPECS, X_SPEC)
    want = on_mesh(unsharded, None, args, specs)
    got = on_mesh(sharded, "explicit", args, specs)
    assert_trees_close(got, want, TOL[policy], what=how)


# ----------------------------------------------------------------------------- apply_policy


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(H)(x))
        return nn.Dense(D)(jax.nn.relu(jnp.where(h > -0.1, h, -1e9)))


LINEN_SPECS = {
    "Dense_0": {"kernel": SPECS["w1"], "bias": SPECS["b1"]},
    "Dense_1": {"kernel": SPECS["w2"], "bias": SPECS["b2"]},
}


def _linen_step(model, recipe):
    def step(params, meta, x):
        def loss(params, meta):
            variables = {"params": params, **({"fp8_meta": meta} if meta else {})}
            return jnp.mean(jnp.square(model.apply(variables, x).astype(jnp.float32) - 1.0))

        value, (g, meta_g) = jax.value_and_grad(loss, argnums=(0, 1))(params, meta)
        new_meta = update_fp8_meta(meta, meta_g, recipe) if meta else meta
        return value, g, new_meta

    return step


DELAYED = Fp8Recipe(scaling="delayed", min_dim=16)


@pytest.mark.parametrize(
    ("kind", "fp8"),
    [("explicit", DELAYED), ("auto", DELAYED)],
    ids=["explicit-delayed_fp8", "auto-delayed_fp8"],
)
def test_linen_apply_policy_on_sharded_params_matches_unsharded(kind, fp8):
    model = mpjax.apply_policy(_LinenMLP(), BF16, fp8=fp8)
    x = mlp_input()
    variables = model.init(jax.random.key(0), x)
    meta = variables.get("fp8_meta", {})
    args = (variables["params"], meta, x)
    specs = (LINEN_SPECS, jax.tree.map(lambda _: P(), meta), X_SPEC)
    step = _linen_step(model, fp8)
    want = on_mesh(step, None, args, specs)
    got = on_mesh(step, kind, args, specs)
    assert_trees_close(got, want, 5e-2 if fp8 else TOL[BF16], what=kind)


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.l2 = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.l1(x))
        return self.l2(jax.nn.relu(jnp.where(h > -0.1, h, -1e9)))


NNX_SPECS = {
    "l1": {"kernel": SPECS["w1"], "bias": SPECS["b1"]},
    "l2": {"kernel": SPECS["w2"], "bias": SPECS["b2"]},
}


def test_nnx_apply_policy_on_sharded_params_matches_unsharded():
    kind = "explicit"
    model = mpjax.apply_policy(_NnxMLP(nnx.Rngs(0)), BF16)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def step(params, x):
        def loss(params):
            out = nnx.merge(graphdef, params)(x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - 1.0))

        return jax.value_and_grad(loss)(params)

    args, specs = (params, mlp_input()), (NNX_SPECS, X_SPEC)
    want = on_mesh(step, None, args, specs)
    got = on_mesh(step, kind, args, specs)
    assert_trees_close(got, want, TOL[BF16], what=kind)
