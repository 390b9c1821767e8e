"""fp8 and block-scaled GEMMs inside `jax.shard_map(check_vma=True)`: the weight gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax import Fp8Recipe
from mpjax.fp8 import fp8_dot_general

DIMS = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise", "mxfp8"])
def test_invariant_weight_gets_the_summed_gradient(scaling):
    # Activations split over "x", the weight replicated (invariant): the custom-VJP GEMM's
    # weight gradient is summed over the devices, as JAX's own dot_general's is (it failed
    # with "the manual axis types do not match" before).
    mesh = jax.make_mesh((8,), ("x",))
    recipe = Fp8Recipe(scaling, min_dim=16)
    x = jax.random.normal(jax.random.key(0), (64, 256))
    w = jax.random.normal(jax.random.key(1), (256, 128)) * 0.1

    def loss(x, w, dot):
        return jnp.sum(dot(x, w) ** 2)

    fp8 = lambda a, b: fp8_dot_general(a, b, DIMS, recipe, jnp.float32)
    plain = lambda a, b: jax.lax.dot_general(a, b, DIMS)

    def grads(dot):
        f = jax.shard_map(
            lambda x, w: jax.grad(loss, 1)(x, w, dot),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=P(),
            check_vma=True,
        )
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        return np.asarray(jax.jit(f)(put(x, P("x")), put(w, P())))

    got, want = grads(fp8), grads(plain)
    # the plain sharded gradient is the unsharded one up to float32 summation order (relative
    # to the gradient's scale: an entry near zero among entries near 100 differs in ~1e-5)
    unsharded = np.asarray(jax.grad(loss, 1)(x, w, plain))
    np.testing.assert_allclose(want, unsharded, rtol=1e-5, atol=1e-6 * np.abs(unsharded).max())
    # each device quantises its own rows (per-shard scales): the sum over the 8 devices is
    # the plain gradient to fp8 accuracy; one device's share alone would be ~1/8 of it
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.2 * scale
    assert np.abs(got - want / 8).max() > 0.5 * scale
