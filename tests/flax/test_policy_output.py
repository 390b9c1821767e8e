"""What `output` in a policy means: the boundary of what the user wrapped (linen, NNX, autocast)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from tests.helpers.policy import walk

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
ONE_STRING = "params=float32,compute=bfloat16,output=float32"


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "dense", h)
        n = nn.LayerNorm()(h)  # a float32 module under the defaults
        self.sow("intermediates", "norm", n)
        return nn.Dense(4)(nn.relu(n) + h)


def _linen_dtypes(policy):
    model = mpjax.apply_policy(LinenNet(), policy)
    x = jax.random.normal(jax.random.key(0), (2, 5)) * 100
    variables = model.init(jax.random.key(1), x)
    out, state = model.apply({"params": variables["params"]}, x, mutable=["intermediates"])
    inter = state["intermediates"]
    return out.dtype, inter["dense"][0].dtype, inter["norm"][0].dtype


def test_linen_one_string_output_cast_only_at_the_root():
    out, dense, norm = _linen_dtypes(ONE_STRING)
    assert out == F32  # the wrapped model's outputs
    assert dense == BF16  # was float32 at every submodule before
    assert norm == BF16  # the float32 LayerNorm returns the compute dtype to its parent


def test_linen_per_module_rules_keep_per_module_outputs():
    out, dense, norm = _linen_dtypes({"*": ONE_STRING, nn.Dense: ONE_STRING})
    assert (out, dense, norm) == (F32, F32, BF16)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        h = self.dense(x)
        self.sow(nnx.Intermediate, "dense_out", h)
        n = self.norm(h)
        self.sow(nnx.Intermediate, "norm_out", n)
        return self.head(nnx.relu(n) + h)


@pytest.mark.parametrize(
    "policy,dense",
    [(ONE_STRING, BF16), ({"*": ONE_STRING, nnx.Linear: ONE_STRING}, F32)],
    ids=["one-string", "per-module"],
)
def test_nnx_output_cast_at_the_boundary_of_what_the_rule_selects(policy, dense):
    model = mpjax.apply_policy(NnxNet(nnx.Rngs(0)), policy)
    x = jax.random.normal(jax.random.key(0), (2, 5)) * 100
    out = model(x)
    inter = nnx.state(model, nnx.Intermediate)
    assert out.dtype == F32
    assert inter["dense_out"].get_value()[0].dtype == dense
    assert inter["norm_out"].get_value()[0].dtype == BF16


def test_autocast_output_is_the_wrapped_functions_boundary():
    def f(x, w):
        h = x @ w
        return h, jnp.tanh(h)

    x, w = np.float32(np.random.default_rng(0).normal(size=(3, 4))), np.ones((4, 4), np.float32)
    jaxpr = jax.make_jaxpr(mpjax.autocast(f, ONE_STRING))(x, w)
    (dot,) = [e for e in walk(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for v in dot.invars] == [BF16, BF16]
    assert [v.aval.dtype for v in jaxpr.jaxpr.outvars] == [F32, F32]
