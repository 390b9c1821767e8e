"""The examples' XLA:CPU compiler options keep a bf16 network's jitted program finite.

jaxlib 0.12's XLA:CPU fuses convolutions, bf16 ReLUs and a reduction into one YNNPACK graph
that computes NaN when the two ReLUs share one broadcast zero (eagerly, and on jaxlib 0.10,
the same function is finite). `examples.common.jit_on_this_backend` turns those fusions off
on CPU; this is the smallest program that showed it, found through the digits ResNet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from examples.common import XLA_CPU_OPTIONS, jit_on_this_backend


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _two_relus(x, w1, w2):
    h = jnp.maximum(_conv(x, w1), 0)
    h = jnp.maximum(_conv(h, w2), 0)
    return h.astype(jnp.float32).sum(axis=(1, 2))


@pytest.mark.parametrize("batch", [2, 8, 64])
def test_bf16_convs_relus_and_a_reduction_jit_to_the_eager_numbers(batch):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((batch, 8, 8, 1)), jnp.bfloat16)
    w1 = jnp.asarray(rng.normal(size=(3, 3, 1, 32)) * 0.3, jnp.bfloat16)
    w2 = jnp.asarray(rng.normal(size=(3, 3, 32, 32)) * 0.1, jnp.bfloat16)
    with jax.disable_jit():
        eager = np.asarray(_two_relus(x, w1, w2))
    jitted = np.asarray(jit_on_this_backend(_two_relus)(x, w1, w2))
    assert np.isfinite(eager).all()
    # same bf16 products, summed in another order: within a few bf16 roundings of the sums
    np.testing.assert_allclose(jitted, eager, rtol=2e-2, atol=1e-2 * np.abs(eager).max())


def test_the_options_apply_on_cpu_only_and_keep_the_callers():
    compiled = jit_on_this_backend(
        lambda v: v + 1, compiler_options={"xla_cpu_enable_fast_math": False}
    )
    assert float(compiled(jnp.float32(1))) == 2.0
    assert XLA_CPU_OPTIONS == {"xla_cpu_experimental_ynn_fusion_type": ""}
