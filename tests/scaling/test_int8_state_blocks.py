"""8-bit optimizer state: blocks from the shape, size-0 leaves, MultiSteps.

`low_precision_state(inner, jnp.int8)` with the default `block_size=None` cuts each leaf's
last axis into power-of-two many equal segments of whole blocks (`default_pieces`), from its
shape alone, so an even split of it over up to 8 devices never straddles a block; a state of
another layout is refused at `update`, naming `upgrade_state`; `block_size=` still overrides.
Leaves of size 0 just work. `optax.MultiSteps`' gradient accumulator keeps its dtype.
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
    default_pieces,
    dequantize,
    geometry,
    quantize,
    scales_shape,
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
    assert mu.scales.shape == (384, 8)  # 8 segments of one 125-block: one per device and row
    # block_size= overrides: 256-element blocks straddle the devices and need collectives
    straddling = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8, block_size=256)
    assert len(_step_collectives(straddling, params)) > len(f32)


def test_default_layout_keeps_whole_blocks_on_every_even_split():
    """For every width up to 5000: an even power-of-two split of the last axis into up to 8
    pieces of at least 32 elements (up to 64 of at least 128) cuts no block, and blocks are
    at most 256 long."""
    for last in range(1, 5001):
        pieces, b = geometry((2, last))
        assert pieces == default_pieces(last) and last % pieces == 0 and 1 <= b <= 256
        count = scales_shape((2, last))[-1]
        starts = {(last // pieces) * s + b * j for s in range(pieces) for j in range(count)}
        for k in (2, 4, 8, 16, 32, 64):
            if last % k or last // k < (32 if k <= 8 else 128):
                continue
            assert count % k == 0, (last, k)
            # each device's first element starts a block, and it holds count / k of them
            assert all(last // k * d in starts for d in range(k)), (last, k)
    widths = (768, 1024, 4096, 50257, 64, 3)
    assert [scales_shape((4, n))[-1] for n in widths] == [8, 8, 32, 197, 2, 1]


def test_update_refuses_a_state_of_another_layout_naming_upgrade_state():
    """A 256-long state (3d03840's default where no sharding was seen) is not read as if it
    were today's: the update names the shapes and `mpjax.upgrade_state`, which converts it."""
    rng = np.random.default_rng(2)
    g = {"w": jnp.asarray(rng.standard_normal((3, 1000)), jnp.float32)}
    old = mpjax.low_precision_state(optax.adam(1e-2), jnp.int8, block_size=256)
    new = mpjax.low_precision_state(optax.adam(1e-2), jnp.int8)
    state = old.update(g, old.init(g), g)[1]
    assert state.inner_state[0].mu["w"].scales.shape == (3, 4)
    with pytest.raises(ValueError, match=r"scales of shape \(3, 4\), not \(3, 8\).*upgrade_state"):
        new.update(g, state, g)
    with pytest.raises(ValueError, match="upgrade_state"):
        jax.jit(new.update)(g, state, g)
    upgraded = mpjax.upgrade_state(state, new.init(g))
    assert upgraded.inner_state[0].mu["w"].scales.shape == (3, 8)
    new.update(g, upgraded, g)


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


def test_layout_is_the_same_under_explicit_and_auto_axes_and_eval_shape():
    """The layout follows the shape: Explicit axes under `jit`, Auto axes, no sharding."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8)
    w = jax.ShapeDtypeStruct(
        (384, 1000), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))
    )
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, {"w": w})
    assert state.inner_state[0].mu["w"].scales.shape == (384, 8)
    auto = jax.ShapeDtypeStruct((384, 1000), jnp.float32)  # no sharding: the same layout
    assert jax.eval_shape(tx.init, {"w": auto}).inner_state[0].mu["w"].scales.shape == (384, 8)


EDGE_VALUES = {
    "wide": np.random.default_rng(0).standard_normal((16, 700))
    * np.exp2(np.random.default_rng(1).integers(-60, 60, (16, 700))),
    "tiny": np.full((3, 5), 1e-38),
    "non-finite": np.array([[1.0, -np.inf, np.nan, 2.0]]),
    "size-0": np.zeros((0, 4)),
    "scalar": np.array(3.5),
}


@pytest.mark.parametrize(
    ("name", "seeded"), [(name, False) for name in sorted(EDGE_VALUES)] + [("wide", True)]
)
def test_eager_quantise_is_one_jit_with_the_bits_of_op_by_op(name, seeded):
    """Called eagerly, `quantize` and `dequantize` run as one jit per shape: the codes, scales
    and values of running them op by op (`jax.disable_jit`), bit for bit."""
    from mpjax._src.scaling import blockwise8

    x = jnp.asarray(EDGE_VALUES[name], jnp.float32)
    seed = jnp.uint32(7) if seeded else None
    with jax.disable_jit():  # the bodies op by op
        want = blockwise8._quantize(x, None, seed)
        want_values = blockwise8._dequantize(want, x.shape, None)
    got = blockwise8.quantize(x, None, seed)
    for a, b in [*zip(got, want, strict=True), (blockwise8.dequantize(got, x.shape), want_values)]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
