"""Block-scaled GEMMs on 8 CPU devices with Explicit mesh axes: the unsharded run's numbers.

The block quantisation reshapes whole rows, so sharded operands are gathered for it and the
results given the shardings JAX's own `dot_general` (forward) and transpose rule (gradients:
each operand's sharding) would give them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import Fp8Recipe
from tests.helpers.sharding import AXIS, make_mesh


def _loss(x, w):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
@pytest.mark.parametrize(
    "x_spec, w_spec", [(P(AXIS, None), P()), (P(), P(None, AXIS))], ids=["batch", "columns"]
)
def test_sharded_block_gemms_match_the_unsharded_run(scaling, x_spec, w_spec):
    x = jax.random.normal(jax.random.key(0), (64, 128))
    w = jax.random.normal(jax.random.key(1), (128, 256)) * 0.1
    step = jax.jit(
        jax.value_and_grad(
            mpjax.autocast(_loss, "float32", fp8=Fp8Recipe(scaling, min_dim=16)), (0, 1)
        )
    )
    want = step(x, w)
    with jax.set_mesh(make_mesh("explicit")):
        xs, ws = jax.sharding.reshard(x, x_spec), jax.sharding.reshard(w, w_spec)
        got = step(xs, ws)
        assert jax.typeof(got[1][0]).sharding.spec == jax.typeof(xs).sharding.spec
        assert jax.typeof(got[1][1]).sharding.spec == jax.typeof(ws).sharding.spec
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
