"""Issue 34 (17): values a policy must not round, and the documented fixes (policies guide,
"Values a policy must not round").

A diffusion model's float timestep is cast to bfloat16 where it enters the model (999 becomes
1000), so its sinusoidal embedding is wrong; an integer timestep is never cast, and a float32
root keeps a float one. A softmax that a layer calls as a function (Hugging Face's Flax
attention) runs in the compute dtype under `apply_policy`; `mpjax.autocast` runs it in
float32."""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from tests.helpers.policy import eqns, in_dtypes, matmul_dtypes

POLICY = "params=float32,compute=bfloat16,output=float32"
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
STEPS = np.array([999, 998, 517, 3])


class SinusoidalEmbedding(nn.Module):
    dim: int = 32

    @nn.compact
    def __call__(self, t):
        half = self.dim // 2
        freqs = jnp.exp(jnp.arange(half) * -(math.log(10000.0) / (half - 1)))
        angles = t[:, None] * freqs
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Denoiser(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        emb = nn.Dense(16)(nn.gelu(nn.Dense(16)(SinusoidalEmbedding()(t))))
        return nn.Dense(16)(nn.LayerNorm()(nn.Dense(16)(x) + emb))


def _embedding(rules, t):
    """The timestep embedding the model computes under `rules`, and the model's policies."""
    model = mpjax.apply_policy(Denoiser(), rules)
    x = jnp.ones((len(STEPS), 16))
    variables = model.init(jax.random.key(0), x, t)
    _, state = model.apply(
        variables,
        x,
        t,
        capture_intermediates=lambda m, _: isinstance(m, SinusoidalEmbedding),
        mutable=["intermediates"],
    )
    emb = state["intermediates"]["SinusoidalEmbedding_0"]["__call__"][0]
    return emb, mpjax.policy.linen_module_policies(model, variables, x, t)


def _exact():
    half = 16
    freqs = np.exp(np.arange(half) * -(math.log(10000.0) / (half - 1)))
    angles = STEPS[:, None].astype(np.float64) * freqs
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


def _error(emb):
    return float(np.abs(np.asarray(emb, np.float64) - _exact()).max())


def test_float_timestep_is_rounded_at_the_model_input():
    """The trap the guide describes: a float timestep enters in bfloat16 (999 -> 1000), and a
    rule on the embedding module alone does not help (the root cast it already)."""
    t = jnp.asarray(STEPS, jnp.float32)
    assert _error(_embedding(POLICY, t)[0]) > 0.5
    assert _error(_embedding({"*": POLICY, SinusoidalEmbedding: "float32"}, t)[0]) > 0.5


def test_integer_timestep_is_never_cast():
    t = jnp.asarray(STEPS, jnp.int32)
    emb, _ = _embedding(POLICY, t)  # the sines in float32, the embedding leaves in bfloat16
    assert emb.dtype == BF16 and _error(emb) < 2**-8
    emb, policies = _embedding({"*": POLICY, SinusoidalEmbedding: "float32"}, t)
    assert emb.dtype == F32 and _error(emb) < 1e-4
    assert policies["Dense_0"].compute_dtype == BF16


def test_float32_root_keeps_a_float_timestep_and_the_layers_in_bfloat16():
    rules = {"": "float32", nn.Module: "p=f32,c=bf16", SinusoidalEmbedding: "float32"}
    emb, policies = _embedding(rules, jnp.asarray(STEPS, jnp.float32))
    assert emb.dtype == F32 and _error(emb) < 1e-4
    assert policies[""].compute_dtype == F32
    assert policies["LayerNorm_0"].compute_dtype == F32  # the Defaults still apply
    for name in ("Dense_0", "Dense_1", "Dense_2", "Dense_3"):
        assert policies[name].compute_dtype == BF16 and policies[name].output_dtype == BF16


class BertStyleAttention(nn.Module):
    """Attention as Hugging Face's Flax BERT writes it: the weights from a function call."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h):
        shape = h.shape[:2] + (2, 4)
        q, k, v = (nn.Dense(8, dtype=self.dtype)(h).reshape(shape) for _ in range(3))
        weights = nn.dot_product_attention_weights(q, k, dtype=self.dtype)
        return jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(h.shape)


@pytest.mark.parametrize("fix", [None, "autocast(apply_policy)", "autocast"])
def test_softmax_called_as_a_function_runs_in_float32_under_autocast(fix):
    model = BertStyleAttention()
    h = jax.random.normal(jax.random.key(1), (2, 5, 8)) * 4
    variables = model.init(jax.random.key(0), h)
    policed = mpjax.apply_policy(model, POLICY)
    f = {
        None: policed.apply,
        "autocast(apply_policy)": mpjax.autocast(policed.apply, POLICY),
        "autocast": mpjax.autocast(model.apply, POLICY),
    }[fix]
    jaxpr = jax.make_jaxpr(f)(variables, h).jaxpr
    exp = [in_dtypes(e) for e in eqns(jaxpr, "exp")]
    assert len(exp) == 1 and exp[0] == ((BF16,) if fix is None else (F32,)), exp
    if fix is not None:
        assert all(in_dtypes(e) == (F32,) for e in eqns(jaxpr, "reduce_sum", "reduce_max"))
    assert all(d == (BF16, BF16) for d in matmul_dtypes(jaxpr))
    assert f(variables, h).dtype == F32
