"""loss_scaled under FSDP on 8 simulated CPU devices: the finite check reduces every leaf where it
lives (only scalars cross devices) and the sharded update equals the unsharded one bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.analysis.collectives import collectives

# name -> (shape, spec): small transposed leaves split on their second dimension (as LoRA
# adapters are), larger leaves split on either dimension, a bias, a replicated odd-sized leaf.
LEAVES = {
    "lora_a": ((8, 64), P(None, "fsdp")),
    "lora_b": ((64, 8), P(None, "fsdp")),
    "w_in": ((128, 256), P(None, "fsdp")),
    "w_out": ((256, 128), P("fsdp", None)),
    "w_conv": ((3, 3, 16, 32), P(None, None, None, "fsdp")),
    "bias": ((256,), P("fsdp")),
    "odd": ((3,), P()),
}
# The built-in check's impls, and the Pallas unscale-and-check kernel (interpret mode) passed in.
IMPLS = ("xla", "interpret", "auto", "unscale-interpret")
# A scalar all-reduce; XLA:CPU may combine a few into one tuple-shaped all-reduce.
MAX_COLLECTIVE_ELEMENTS = 1


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _params(dtype) -> dict:
    keys = jax.random.split(jax.random.key(0), len(LEAVES))
    return {
        name: jax.random.normal(k, shape, jnp.float32).astype(dtype)
        for k, (name, (shape, _)) in zip(keys, LEAVES.items(), strict=True)
    }


def _grads(dtype, bad: str | None) -> dict:
    keys = jax.random.split(jax.random.key(1), len(LEAVES))
    grads = {
        name: (jax.random.normal(k, shape, jnp.float32) * 100).astype(dtype)
        for k, (name, (shape, _)) in zip(keys, LEAVES.items(), strict=True)
    }
    if bad is not None:
        # The non-finite value in the last element of the smallest split leaf.
        g = grads["lora_a"]
        grads["lora_a"] = g.at[-1, -1].set(jnp.inf if bad == "inf" else jnp.nan)
    return grads


def _shardings(tree: dict, mesh: Mesh):
    """Each leaf of a LEAVES-shaped tree gets its leaf's spec (matched by shape); others are
    replicated."""
    by_shape = {shape: spec for shape, spec in LEAVES.values()}
    return jax.tree.map(lambda x: NamedSharding(mesh, by_shape.get(jnp.shape(x), P())), tree)


def _tx(impl: str):
    scale = mpjax.DynamicLossScale(2.0**10)
    if impl == "unscale-interpret":
        check = functools.partial(mpjax.pallas.unscale_and_check, impl="interpret")
        return mpjax.loss_scaled(optax.adamw(1e-3), scale, unscale_and_check=check)
    return mpjax.loss_scaled(optax.adamw(1e-3), scale, impl=impl)


@functools.cache
def _compiled(impl, param_dtype, grad_dtype, sharded):
    """The update step compiled once per (impl, dtypes, placement): the `bad` cases feed the
    same program different gradients. Returns the compiled step and the shardings (or None)."""
    tx = _tx(impl)
    params = _params(param_dtype)
    state = jax.eval_shape(tx.init, params)
    grads = jax.eval_shape(lambda: _grads(grad_dtype, None))
    if not sharded:
        return tx, jax.jit(tx.update).lower(grads, state, params).compile(), None
    mesh = _mesh()
    shardings = tuple(_shardings(t, mesh) for t in (grads, state, params))
    g_sh, s_sh, p_sh = shardings
    step = jax.jit(tx.update, in_shardings=(g_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    return tx, step.lower(grads, state, params).compile(), shardings


def _compiled_and_outputs(impl, param_dtype, grad_dtype, bad, sharded):
    tx, compiled, shardings = _compiled(impl, param_dtype, grad_dtype, sharded)
    params = _params(param_dtype)
    args = (_grads(grad_dtype, bad), tx.init(params), params)
    if shardings is not None:
        args = jax.device_put(args, shardings)
    return compiled, compiled(*args)


def _bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_sharded_update_moves_only_scalars(impl, grad_dtype):
    compiled, _ = _compiled_and_outputs(impl, jnp.float32, grad_dtype, None, sharded=True)
    moved = collectives(compiled.as_text())
    big = [c for c in moved if c.op != "all-reduce" or np.prod(c.shape) > MAX_COLLECTIVE_ELEMENTS]
    assert not big, f"impl={impl}: collectives beyond scalar all-reduces: {big}"
    assert any(c.op == "all-reduce" for c in moved), "the finiteness flag must be combined"


# Pallas interpret mode runs the kernel grid as a loop: seconds per compile.
SLOW_IMPLS = [pytest.param(i, marks=pytest.mark.slow) if "interpret" in i else i for i in IMPLS]


@pytest.mark.parametrize("impl", SLOW_IMPLS)
@pytest.mark.parametrize("bad", [None, "inf", "nan"])
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [(jnp.float32, jnp.float16), (jnp.float16, jnp.bfloat16)],
)
def test_sharded_update_equals_unsharded_bitwise(impl, bad, param_dtype, grad_dtype):
    _, sharded = _compiled_and_outputs(impl, param_dtype, grad_dtype, bad, sharded=True)
    _, single = _compiled_and_outputs(impl, param_dtype, grad_dtype, bad, sharded=False)
    updates, state = sharded
    assert bool(state.grads_finite) is (bad is None)
    for a, b in zip(_bits(sharded), _bits(single), strict=True):
        np.testing.assert_array_equal(a, b)
