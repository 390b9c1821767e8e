"""`Fp8Recipe(exclude=...)` for an NNX model under `mpjax.autocast`.

NNX modules push no name scope, so autocast names a GEMM whose weight is a Variable of an NNX
model passed as an argument by its module path (`"Model/head"`, `"Model/layers/1"`): the
excluded GEMMs run in the compute dtype (bfloat16 operands, no quantise call for them), the
others in fp8, forward and backward. A model closed over (no path to name its GEMMs by) with
an `exclude` that matched nothing is refused at the call, naming the patterns and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import mpjax
from mpjax._src.fp8.orientations import QUANTIZE_NAME

TOKENS, D, H = 256, 64, 128


class Model(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(D, H, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(H, H, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.body(x))
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)


def _recipe(scaling, exclude):
    return mpjax.Fp8Recipe(scaling, exclude=exclude, high_precision_last=0, high_precision_first=0)


def _walk(jaxpr, dots, quantised):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            dots.append(tuple((str(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.invars))
        if eqn.params.get("name") == QUANTIZE_NAME:
            quantised.append(tuple(eqn.invars[0].aval.shape))
            continue
        for sub in jaxprs_in_params(eqn.params):
            _walk(sub, dots, quantised)
    return dots, quantised


def _loss(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def _programs(scaling, exclude):
    model, x = Model(nnx.Rngs(0)), jnp.ones((TOKENS, D))
    fn = mpjax.autocast(_loss, fp8=_recipe(scaling, exclude))
    forward = _walk(jax.make_jaxpr(fn)(model, x).jaxpr, [], [])
    backward = _walk(jax.make_jaxpr(jax.grad(fn))(model, x).jaxpr, [], [])
    nnx_grad = _walk(jax.make_jaxpr(nnx.grad(fn))(model, x).jaxpr, [], [])
    return forward, backward, nnx_grad


HEAD_FORWARD = (("bfloat16", (TOKENS, H)), ("bfloat16", (H, D)))


@pytest.mark.parametrize("scaling", ["tensorwise", "mxfp8", "nvfp4", "blockwise"])
def test_an_excluded_nnx_head_runs_in_bfloat16_and_the_others_in_fp8(scaling):
    for dots, quantised in _programs(scaling, ("*/head",)):
        assert HEAD_FORWARD in dots  # the head's own GEMM, bfloat16 operands as laid out
        if scaling == "tensorwise":
            fp8 = [d for d in dots if d[0][0].startswith("float8")]
            shapes = {d[1][1] for d in fp8}
            assert (D, H) in shapes and (H, H) in shapes  # body and layers: fp8 weights
            assert (H, D) not in shapes  # the head: none
        else:
            # the block recipes quantise each fp8 GEMM's operands in named calls: the body's
            # and the layers' weights ([K, N]), none of the head's (kernel [H, D], its input)
            assert (D, H) in quantised and (H, H) in quantised
            assert (H, D) not in quantised
    # without the exclusion the head runs fp8 too (the programs differ by the head alone)
    for dots, quantised in _programs(scaling, ()):
        assert HEAD_FORWARD not in dots
        if scaling != "tensorwise":
            assert (H, D) in quantised


def test_a_layer_in_an_nnx_list_is_excluded_by_its_index():
    (dots, quantised), _, _ = _programs("mxfp8", ("Model/layers/1",))
    assert quantised.count((H, H)) == 1  # layers/0 quantised, layers/1 not
    assert (("bfloat16", (TOKENS, H)), ("bfloat16", (H, H))) in dots


def test_an_exclude_matching_nothing_of_a_closed_over_nnx_model_is_refused():
    model, x = Model(nnx.Rngs(0)), jnp.ones((TOKENS, D))
    fn = mpjax.autocast(lambda x: _loss(model, x), fp8=_recipe("mxfp8", ("*/head",)))
    with pytest.raises(ValueError, match=r"exclude=\('\*/head',\)\) matched no GEMM") as info:
        fn(x)
    assert "pass the NNX model as an argument" in str(info.value)
    # without exclude, or with a pattern that matches a named GEMM, nothing is refused
    mpjax.autocast(lambda x: _loss(model, x), fp8=_recipe("mxfp8", ()))(x)
    named = mpjax.autocast(lambda m, x: _loss(m, x), fp8=_recipe("mxfp8", ("*/head",)))
    named(model, x)


def test_fp8_ops_lists_nnx_gemms_by_module_path():
    from mpjax.fp8 import fp8_ops

    model, x = Model(nnx.Rngs(0)), jnp.ones((TOKENS, D))
    ops = fp8_ops(_loss, _recipe("mxfp8", ("*/head",)), model, x)
    assert [op.name for op in ops] == [
        "Model/body",
        "Model/layers/0",
        "Model/layers/1",
        "Model/head",
    ]
    assert [op.fp8 for op in ops] == [True, True, True, False]
    assert "excluded" in ops[-1].reason
