"""ConvBN's Pallas kernels under data parallelism on 8 simulated CPU devices (interpret mode).

The batch is split over the devices and the step is one global jit program (the statistics are
over the global batch). The kernels run on each device's rows: the compiled forward + backward
moves no activation, only all-reduces of per-channel sums and the conv kernel's gradient, and its
outputs, gradients and running statistics equal the unsharded layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.analysis.collectives import collectives
from mpjax.nn import ConvBN

N_DEV, PER_DEV, HW, C_IN, C_OUT = 8, 2, 6, 4, 16
KERNEL_ELEMENTS = 3 * 3 * C_IN * C_OUT  # the largest parameter: its gradient is all-reduced
SHARD_ELEMENTS = PER_DEV * HW * HW * C_OUT  # one device's activation
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# Interpret mode runs the kernel grids as loops: bfloat16 in the slow set only.
DTYPES = [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)]


def _inputs(dtype, residual: bool):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N_DEV * PER_DEV, HW, HW, C_IN)) + 0.3, dtype)
    shape = (N_DEV * PER_DEV, HW, HW, C_OUT)
    res = jnp.asarray(rng.standard_normal(shape), dtype) if residual else None
    cot = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return x, res, cot


def _step(layer):
    """Loss-weighted forward + backward in train mode: (out, new stats, grads of params, x)."""

    def step(variables, x, res, cot):
        def loss(params, x, res):
            out, upd = layer.apply({**variables, "params": params}, x, res, mutable=["batch_stats"])
            return jnp.sum(out.astype(jnp.float32) * cot), (out, upd["batch_stats"])

        grad_fn = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        grads, (out, stats) = grad_fn(variables["params"], x, res)
        return out, stats, grads

    return step


def _run(dtype, residual: bool, sharded: bool):
    layer = ConvBN(C_OUT, dtype=dtype, impl="interpret", use_running_average=False)
    x, res, cot = _inputs(dtype, residual)
    variables = layer.init(jax.random.key(0), x, res)
    step = jax.jit(_step(layer))
    args = (variables, x, res, cot)
    if sharded:
        mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("data",))
        batch, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        shardings = (jax.tree.map(lambda _: rep, variables), batch, batch, batch)
        args = jax.device_put(args, shardings)
    return step.lower(*args).compile(), step(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_batch_sharded_pallas_convbn_moves_no_activation(dtype, residual):
    compiled, _ = _run(dtype, residual, sharded=True)
    moved = collectives(compiled.as_text())
    big = [c for c in moved if c.op != "all-reduce" or np.prod(c.shape) > KERNEL_ELEMENTS]
    assert not big, f"collectives beyond channel sums and the weight gradient: {big}"
    assert KERNEL_ELEMENTS < SHARD_ELEMENTS  # the bound above excludes activations
    # The batch statistics are combined across the devices: channel-sized all-reduces.
    assert any(c.op == "all-reduce" and c.shape == (C_OUT,) for c in moved), moved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_batch_sharded_pallas_convbn_equals_unsharded(dtype, residual):
    _, sharded = _run(dtype, residual, sharded=True)
    _, single = _run(dtype, residual, sharded=False)
    tol = TOL[dtype]
    flat_s, tree_s = jax.tree.flatten(sharded)
    flat_1, tree_1 = jax.tree.flatten(single)
    assert tree_s == tree_1
    for a, b in zip(flat_s, flat_1, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)
