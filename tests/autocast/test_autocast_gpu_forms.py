"""Autocast emits the forms XLA:GPU keeps narrow; names survive into the HLO metadata.

Jaxpr-level facts behind the H100 cost model (the `cost` cases of `benchmarks/run.py`): convolutions
and GEMMs on compute-dtype operands in both directions, BatchNorm/LayerNorm returning the
compute dtype (statistics in float32), embeddings gathered in the compute dtype, and the
traced function's name stack on every emitted op.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

import mpjax
from tests.helpers.policy import eqns

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
POLICY = "params=float32,compute=bfloat16,output=float32"


def named(jaxpr, *names):
    return eqns(getattr(jaxpr, "jaxpr", jaxpr), *names)


def dtypes(vars_):
    return [np.dtype(v.aval.dtype) for v in vars_ if not isinstance(v, Literal)]


class ResBlock(nn.Module):
    """conv -> BatchNorm -> relu -> max-pool -> + a 1x1 conv branch -> Dense."""

    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x)))
        y = nn.max_pool(y, (2, 2), (2, 2))
        y = y + nn.Conv(8, (1, 1), name="proj")(y)
        return nn.Dense(4)(y.mean((1, 2)))


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        h = nn.Dense(16, name="mlp")(nn.LayerNorm()(x))
        x = x + h
        return nn.Dense(32, name="head")(nn.LayerNorm()(x))


def resnet_setup():
    model = ResBlock()
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3)) * 30
    variables = model.init(jax.random.key(1), x)

    def loss(params, x):
        out, _ = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            mutable=["batch_stats"],
        )
        return (out**2).mean()

    return model, variables, x, loss


def lm_setup():
    model = TinyLM()
    tokens = jax.random.randint(jax.random.key(0), (2, 6), 0, 32)
    params = model.init(jax.random.key(1), tokens)["params"]

    def loss(params, tokens):
        return (model.apply({"params": params}, tokens) ** 2).mean()

    return params, tokens, loss


def test_convs_forward_and_backward_take_and_return_bf16():
    _, variables, x, loss = resnet_setup()
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, POLICY)))(variables["params"], x)
    convs = named(jaxpr, "conv_general_dilated")
    assert len(convs) == 2 * 3 - 1  # forward, input and kernel cotangents (none for x)
    for e in convs:
        assert dtypes(e.invars) == [BF16, BF16] and dtypes(e.outvars) == [BF16], e


def test_gemms_take_and_return_bf16():
    """GEMMs are bound as Flax's bf16 `Dense` binds them: bf16 in, bf16 out.

    Every XLA backend accumulates a bf16 GEMM in float32; a `preferred_element_type=float32`
    request makes XLA:GPU write a float32 result and convert it in a separate pass (the
    GPT-2 train step was 1.021x the Flax bf16 roofline on the H100 cost model).
    """
    params, tokens, loss = lm_setup()
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, POLICY))(params, tokens)
    dots = named(jaxpr, "dot_general")
    assert len(dots) == 2
    for e in dots:
        assert dtypes(e.invars) == [BF16, BF16], e
        assert e.params["preferred_element_type"] is None and dtypes(e.outvars) == [BF16], e
    grad = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, POLICY)))(params, tokens)
    for e in named(grad, "dot_general"):
        assert dtypes(e.invars) == [BF16, BF16], e


def test_batchnorm_returns_the_compute_dtype_and_what_follows_stays_narrow():
    _, variables, x, loss = resnet_setup()
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, POLICY))(variables["params"], x)
    # Statistics in float32 ...
    for e in named(jaxpr, "reduce_sum", "rsqrt"):
        assert dtypes(e.outvars) == [F32], e
    # ... but the max-pool after BatchNorm + relu, and the residual add, run in bf16.
    (pool,) = named(jaxpr, "reduce_window_max")
    assert dtypes(pool.invars) == [BF16] and dtypes(pool.outvars) == [BF16]
    full = [e for e in named(jaxpr, "add") if e.outvars[0].aval.shape == (2, 4, 4, 8)]
    assert full and all(dtypes(e.outvars) == [BF16] for e in full)
    # Exactly one convert back to bf16 of the normalised activations (where they end).
    ends = [
        e
        for e in named(jaxpr, "convert_element_type")
        if e.outvars[0].aval.shape == (2, 8, 8, 8) and dtypes(e.outvars) == [BF16]
    ]
    assert len(ends) == 1


def test_batchnorm_under_autocast_matches_float64():
    _, variables, x, loss = resnet_setup()
    grad = jax.jit(jax.grad(mpjax.autocast(loss, POLICY)))(variables["params"], x)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), variables["params"])
        ref = jax.jit(jax.grad(loss))(p64, jnp.asarray(x, jnp.float64))
    refs = [np.asarray(r, np.float64) for r in jax.tree.leaves(ref)]
    total = np.sqrt(sum(np.sum(r**2) for r in refs))
    for g, r in zip(jax.tree.leaves(grad), refs, strict=True):
        # The conv bias before BatchNorm has a vanishing gradient: measured against the tree.
        scale = max(np.linalg.norm(r), 1e-3 * total)
        assert np.linalg.norm(np.asarray(g, np.float64) - r) <= 0.05 * scale


def test_embedding_gathers_bf16_rows_and_the_residual_stream_is_bf16():
    params, tokens, loss = lm_setup()
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, POLICY))(params, tokens)
    (gather,) = named(jaxpr, "gather")
    assert dtypes(gather.invars)[0] == BF16 and dtypes(gather.outvars) == [BF16]
    shape = (2, 6, 16)
    residual = [
        e for e in named(jaxpr, "add") if all(v.aval.shape == shape for v in e.invars)
    ]  # x + mlp(ln(x)) (LayerNorm's own steps add broadcast statistics)
    assert len(residual) == 1 and dtypes(residual[0].outvars) == [BF16]
    grad = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, POLICY)))(params, tokens)
    scatters = named(grad, "scatter-add", "scatter_add")
    assert scatters and all(dtypes(e.outvars) == [BF16] for e in scatters)


def _op_names(text):
    """The `op_name`s of the HLO's ops (argument names such as `params['Conv_0']` left out)."""
    return {n for n in re.findall(r'op_name="([^"]*)"', text) if not n.startswith("params")}


def test_hlo_metadata_carries_module_names():
    _, variables, x, loss = resnet_setup()
    compiled = jax.jit(jax.grad(mpjax.autocast(loss, POLICY))).lower(variables["params"], x)
    names = _op_names(compiled.compile().as_text())
    for op in (
        "Conv_0/conv_general_dilated",
        "BatchNorm_0/rsqrt",
        "proj/conv_general_dilated",
        "Dense_0/dot_general",
    ):  # e.g. "jit(loss)/jvp(ResBlock)/Conv_0/conv_general_dilated"
        assert any("ResBlock" in n and n.endswith("/" + op) for n in names), (op, sorted(names))
    # The backward pass too (the transposed convolutions of the named layer).
    assert any("transpose(jvp(ResBlock))/Conv_0/" in n for n in names), sorted(names)
    params, tokens, lm_loss = lm_setup()
    text = jax.jit(mpjax.autocast(lm_loss, POLICY)).lower(params, tokens).as_text(debug_info=True)
    for op in ("TinyLM/Embed_0/", "TinyLM/mlp/dot_general", "TinyLM/head/dot_general"):
        assert op in text, op
