"""8-bit optimizer state: block lengths from the sharding, size-0 leaves, MultiSteps.

`low_precision_state(inner, jnp.int8)` with the default `block_size=None` picks each leaf's
block length from its sharding at `init` (a divisor of the last axis's piece on each device,
so no block straddles two devices) and reads it back from the stored scales at each update;
`block_size=` still overrides. Leaves of size 0 just work. `optax.MultiSteps`' gradient
accumulator keeps its dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.analysis.collectives import collectives
from mpjax._src.scaling.blockwise8 import (
    Blockwise8,
    dequantize,
    quantize,
    sharded_block_length,
    stored_block_length,
)

is_q = lambda x: isinstance(x, Blockwise8)  # noqa: E731


def _kernel_on_last_axis():
    """A [384, 1000] kernel split along its last axis over 8 devices (125 columns each)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = np.random.default_rng(0).standard_normal((384, 1000)).astype(np.float32)
    return jax.device_put(w, NamedSharding(mesh, P(None, "fsdp")))


def _step_collectives(tx, params) -> list:
    mesh = params["w"].sharding.mesh
    split = lambda x: P(None, "fsdp") if np.ndim(x) == 2 and x.shape[-1] % 8 == 0 else P()  # noqa: E731
    state = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, split(x))), tx.init(params)
    )

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    shardings = jax.tree.map(lambda x: x.sharding, (params, state))
    compiled = jax.jit(step, out_shardings=shardings).lower(params, state, params).compile()
    return sorted((c.op, c.dtype, c.bytes) for c in collectives(compiled.as_text()))


def test_int8_state_of_a_kernel_split_on_its_last_axis_adds_no_collective():
    params = {"w": _kernel_on_last_axis()}
    f32 = _step_collectives(optax.adam(1e-3), params)
    int8 = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8)
    assert _step_collectives(int8, params) == f32
    mu = int8.init(params).inner_state[0].mu["w"]
    assert mu.scales.shape == (384, 8)  # blocks of 125: one per device and row
    # block_size= overrides: 256-element blocks straddle the devices and need collectives
    straddling = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8, block_size=256)
    assert len(_step_collectives(straddling, params)) > len(f32)


def test_sharded_block_length_divides_each_piece_and_reads_back():
    for shape, piece in [((384, 1000), 125), ((4, 1000), 250), ((64,), 8), ((3, 512), 256)]:
        b = sharded_block_length(shape, piece)
        assert piece % b == 0 and b <= 256
        q = jax.eval_shape(lambda x, b=b: quantize(x, b), jax.ShapeDtypeStruct(shape, jnp.float32))
        assert stored_block_length(shape, q.scales.shape) == b
    # 4 devices of 250: 250-long blocks would count 4, as 256-long ones do; 125 reads back
    assert sharded_block_length((4, 1000), 250) == 125


def test_default_reads_back_256_long_blocks():
    """States written with the old default (`block_size=256`) are read as they were."""
    rng = np.random.default_rng(2)
    g = {"w": jnp.asarray(rng.standard_normal((3, 1000)), jnp.float32)}
    old = mpjax.low_precision_state(optax.adam(1e-2), jnp.int8, block_size=256)
    new = mpjax.low_precision_state(optax.adam(1e-2), jnp.int8)
    state = old.init(g)
    state = old.update(g, state, g)[1]
    np.testing.assert_array_equal(new.update(g, state, g)[0]["w"], old.update(g, state, g)[0]["w"])


@pytest.mark.parametrize("block_size", [None, 64])
def test_size_zero_leaves_init_update_and_round_trip(block_size):
    params = {
        "a": jnp.zeros((0,)),
        "b": jnp.zeros((3, 0)),
        "c": jnp.zeros((0, 4)),
        "d": jnp.arange(5.0),
    }
    tx = mpjax.low_precision_state(optax.adam(1e-2), jnp.int8, block_size=block_size)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
    assert np.isfinite(updates["d"]).all() and (np.asarray(updates["d"]) != 0).all()
    for leaf in jax.tree.leaves(state.inner_state[0].mu, is_leaf=is_q):
        assert isinstance(leaf, Blockwise8)
    for shape in [(0,), (3, 0), (0, 4), (2, 0, 5)]:
        q = quantize(jnp.zeros(shape), block_size or 256)
        assert dequantize(q, shape, block_size or 256).shape == shape


def test_multisteps_accumulator_keeps_its_dtype():
    params = {"w": jnp.ones((4, 8))}
    inner = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    for dtype in (jnp.int8, jnp.bfloat16):
        state = mpjax.low_precision_state(inner, dtype).init(params).inner_state
        assert state.acc_grads["w"].dtype == jnp.float32  # summed gradients, kept
        assert isinstance(state.inner_opt_state[0].mu["w"], Blockwise8) or (
            state.inner_opt_state[0].mu["w"].dtype == jnp.bfloat16
        )
    # accumulating two micro-batches in float32 gives the exact mean, as without the wrapper
    tx = mpjax.low_precision_state(inner, jnp.int8)
    state = tx.init(params)
    g1, g2 = {"w": jnp.full((4, 8), 1e-3)}, {"w": jnp.full((4, 8), 3e-3)}
    state = tx.update(g1, state, params)[1]
    acc = state.inner_state.acc_grads["w"]
    np.testing.assert_array_equal(acc, jnp.full((4, 8), 1e-3))
    updates = tx.update(g2, state, params)[0]
    plain = inner.init(params)
    plain = inner.update(g1, plain, params)[1]
    want = inner.update(g2, plain, params)[0]
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)


def test_default_block_length_from_explicit_axes_under_jit():
    """Under `jit` the sharding is seen where the axes are Explicit (the type carries it)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8)
    w = jax.ShapeDtypeStruct(
        (384, 1000), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))
    )
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, {"w": w})
    assert state.inner_state[0].mu["w"].scales.shape == (384, 8)
    auto = jax.ShapeDtypeStruct((384, 1000), jnp.float32)  # no sharding seen: 256 long
    assert jax.eval_shape(tx.init, {"w": auto}).inner_state[0].mu["w"].scales.shape == (384, 4)
