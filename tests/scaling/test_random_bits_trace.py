"""The stochastic-rounding hashes trace without a `jit` dispatch per operator.

They run once per optimizer-state leaf per step; written with `jnp` operators (each a
jitted function) they cost a `jit` dispatch per operator while tracing, the bulk of the
trace time of a GPT-2 step with bfloat16 state. The values are pinned by the checkpoint
fixtures (`test_checkpoints_6a474e7.py` resumes them bit for bit).
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import pjit

from mpjax._src.scaling import low_precision, random_bits


def _jit_dispatches(fun, *args) -> int:
    """How many `jit` calls tracing `fun(*args)` makes, beyond make_jaxpr's own."""
    with mock.patch.object(pjit, "_infer_params", wraps=pjit._infer_params) as spy:
        jax.make_jaxpr(fun)(*args)
        baseline = jax.make_jaxpr(lambda *a: a)
        before = spy.call_count
        baseline(*args)
    return before - (spy.call_count - before)


def test_stochastic_rounding_of_a_leaf_traces_without_jit_calls():
    x = jnp.ones((8, 16), jnp.float32)

    def round_leaf(x, count):
        return low_precision.stochastic_round(x, low_precision._leaf_seed(7, count, 3))

    assert _jit_dispatches(round_leaf, x, jnp.int32(5)) == 0
    assert _jit_dispatches(lambda s: random_bits.random_bits16((4, 8), s), jnp.uint32(3)) == 0


def test_random_bits16_is_murmur3s_finaliser_of_the_counter():
    """The hash itself, against a NumPy uint32 reference (wrapping arithmetic)."""
    seed, shape = np.uint32(0xDEADBEEF), (3, 5)
    h = np.arange(15, dtype=np.uint32).reshape(shape) * np.uint32(0x9E3779B9) + seed
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    got = jax.jit(lambda s: random_bits.random_bits16(shape, s))(jnp.uint32(seed))
    np.testing.assert_array_equal(np.asarray(got), h >> 16)
