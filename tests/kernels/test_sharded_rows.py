"""The channel kernels (`channel_stats`, `conv_epilogue`) on sharded inputs, 8 simulated CPU
devices, interpret mode: each device runs the kernel on its own rows (and channels), the only
collectives are all-reduces of per-channel sums, and the results equal the unsharded ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.analysis.collectives import collectives
from mpjax.pallas import channel_stats, conv_epilogue

C = 24
# (mesh shape, y's spec, y's shape): the batch over 8, batch x channels over 2 x 4, and the
# height over 8 (not a block of the flattened rows: resharded first, correct but not local).
LAYOUTS = {
    "rows": ((8,), P("a"), (16, 3, 5, C)),
    "rows-channels": ((2, 4), P("a", None, None, "b"), (16, 3, 5, C)),
    "height": ((8,), P(None, "a"), (2, 8, 5, C)),
}


def _mesh(shape):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b")[: len(shape)])


def _loss(y, scale, shift, cot):
    s, ss = channel_stats(y, impl="interpret")
    out = conv_epilogue(y, scale * s, shift + ss, y, activation="silu", impl="interpret")
    return jnp.sum(out.astype(jnp.float32) * cot), (s, ss)


def _inputs(shape, dtype):
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal(shape), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, C) / 100, jnp.float32)
    shift = jnp.asarray(rng.standard_normal(C) / 100, jnp.float32)
    cot = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    return y, scale, shift, cot


def _run(layout, dtype, sharded):
    mesh_shape, spec, shape = LAYOUTS[layout]
    args = _inputs(shape, dtype)
    step = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2), has_aux=True))
    if sharded:
        mesh = _mesh(mesh_shape)
        y_sh = NamedSharding(mesh, spec)
        vec = NamedSharding(mesh, P(spec[3] if len(spec) > 3 else None))
        args = jax.device_put(args, (y_sh, vec, vec, y_sh))
    return step.lower(*args).compile(), step(*args)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sharded_kernels_equal_unsharded(layout, dtype):
    compiled, sharded = _run(layout, dtype, sharded=True)
    _, single = _run(layout, dtype, sharded=False)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.max(np.abs(b))))
    if layout != "height":
        moved = collectives(compiled.as_text())
        big = [c for c in moved if c.op != "all-reduce" or np.prod(c.shape) > C]
        assert not big, big
        assert any(c.op == "all-reduce" for c in moved), "the channel sums must be combined"


def test_vmapped_kernels_run_per_member():
    """`custom_partitioning` has no batching rule: under vmap the kernels run vmapped."""
    y = _inputs((4, 3, 5, C), jnp.float32)[0]
    ys = jnp.stack([y, 2 * y])
    stats = jax.jit(jax.vmap(functools.partial(channel_stats, impl="interpret")))(ys)
    for i in range(2):
        want = channel_stats(ys[i], impl="xla")
        for a, b in zip((s[i] for s in stats), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)
