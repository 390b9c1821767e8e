"""`Fp8Recipe.high_precision_last`: NVFP4 keeps the program's last GEMMs in the compute dtype.

Structural, on the jaxpr of the training gradient under `autocast`: a layer whose GEMMs
run in NVFP4 quantises to float4_e2m1fn inside its name scope (forward and both gradient
GEMMs); a layer kept in the compute dtype has no low-precision value at all, and its
`dot_general`s take bfloat16 operands.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import fp8_ops

LAYERS, WIDTH = 10, 64
E2M1, E4M3 = np.dtype(jnp.float4_e2m1fn), np.dtype(jnp.float8_e4m3fn)
LOW = (E2M1, E4M3, np.dtype(jnp.float8_e5m2))


def _mlp(x, ws):
    for i in range(ws.shape[0]):
        with jax.named_scope(f"layer{i}"):
            x = jnp.tanh(x @ ws[i])
    return x


def _args(layers=LAYERS):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, WIDTH)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((layers, WIDTH, WIDTH)) / 8, jnp.float32)
    return x, ws


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _layer_dtypes(fn, recipe, *args):
    """{layer index: (low-precision dtypes made in its scope, dtypes of its dots' operands)}
    over the jaxpr of the gradient of `sum(autocast(fn)(...))`."""
    cast = mpjax.autocast(fn, "params=float32,compute=bfloat16,output=float32", fp8=recipe)
    loss = lambda *a: jnp.sum(cast(*a))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr
    found: dict[int, tuple[set, set]] = {}
    for eqn in _eqns(jaxpr):
        scope = str(eqn.source_info.name_stack)
        layers = [p for p in scope.replace("(", "/").replace(")", "/").split("/") if p]
        layer = next((int(p[5:]) for p in layers if p.startswith("layer")), None)
        if layer is None:
            continue
        low, dots = found.setdefault(layer, (set(), set()))
        low.update(v.aval.dtype for v in eqn.outvars if v.aval.dtype in LOW)
        if eqn.primitive.name == "dot_general":
            dots.update(v.aval.dtype for v in eqn.invars)
    return found


def _nvfp4_layers(found):
    return sorted(i for i, (low, _) in found.items() if E2M1 in low)


def test_nvfp4_default_keeps_the_last_gemms_in_bf16():
    """10 GEMMs: round(0.15 * 10) = 2, the last two layers, forward and backward."""
    recipe = Fp8Recipe("nvfp4", min_dim=16, block_lowering="emulated")
    found = _layer_dtypes(_mlp, recipe, *_args())
    assert sorted(found) == list(range(LAYERS))
    assert _nvfp4_layers(found) == list(range(LAYERS - 2))  # was every layer
    assert recipe.high_precision_rule == 0.15
    for i in (LAYERS - 2, LAYERS - 1):
        low, dots = found[i]
        assert not low, (i, low)  # no float4 / float8 value anywhere in the layer
        assert dots == {np.dtype(jnp.bfloat16)}, (i, dots)


@pytest.mark.parametrize(
    "rule, kept",
    [(0, 0), (0.0, 0), (3, 3), (0.25, 3), (0.5, 5), (99, LAYERS)],  # 0.25 * 10: halves up
)
def test_the_rule_is_overridable(rule, kept):
    recipe = Fp8Recipe("nvfp4", min_dim=16, block_lowering="emulated", high_precision_last=rule)
    found = _layer_dtypes(_mlp, recipe, *_args())
    assert _nvfp4_layers(found) == list(range(LAYERS - kept))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "mxfp8", "blockwise"])
def test_other_recipes_keep_every_gemm_in_low_precision_by_default(scaling):
    recipe = Fp8Recipe(scaling, min_dim=16, block_lowering="emulated")
    assert recipe.high_precision_rule == 0 and recipe.high_precision_count(100) == 0
    found = _layer_dtypes(_mlp, recipe, *_args())
    assert all(low & {E4M3} for low, _ in found.values()), found
    assert all(op.fp8 for op in fp8_ops(_mlp, recipe, *_args()))
    # and they take the rule when asked
    two = Fp8Recipe(scaling, min_dim=16, block_lowering="emulated", high_precision_last=2)
    assert [op.fp8 for op in fp8_ops(_mlp, two, *_args())] == [True] * 8 + [False] * 2


def test_fp8_ops_says_which_gemms_stay_and_why():
    ops = fp8_ops(_mlp, Fp8Recipe("nvfp4", min_dim=16), *_args())
    assert [op.fp8 for op in ops] == [True] * 8 + [False] * 2
    for op in ops[-2:]:
        assert "high_precision_last=None (0.15 for nvfp4)" in op.reason, op.reason
        assert "one of the last 2 of 10 eligible GEMMs" in op.reason, op.reason
        assert "high_precision_last=0 runs it in nvfp4" in op.reason
    assert all(op.lowering == "emulated nvfp4" for op in ops[:-2])
    # user exclusions come first: the rule counts the GEMMs left, and keeps the last of those
    skip_last = Fp8Recipe("nvfp4", min_dim=16, exclude=("*layer9*",), high_precision_last=1)
    ops = fp8_ops(_mlp, skip_last, *_args())
    assert [op.fp8 for op in ops] == [True] * 8 + [False] * 2
    assert "excluded by" in ops[-1].reason and "last 1 of 9" in ops[-2].reason


def test_high_precision_first_keeps_the_first_gemms():
    """Megatron's `--num-layers-at-start-in-bf16` equivalent, alone and with the last ones."""
    first = Fp8Recipe("nvfp4", min_dim=16, high_precision_first=2, high_precision_last=0)
    found = _layer_dtypes(_mlp, dataclasses.replace(first, block_lowering="emulated"), *_args())
    assert _nvfp4_layers(found) == list(range(2, LAYERS))
    ops = fp8_ops(_mlp, first, *_args())
    assert [op.fp8 for op in ops] == [False] * 2 + [True] * 8
    assert all("high_precision_first=2: one of the first 2 of 10" in op.reason for op in ops[:2])
    both = Fp8Recipe("nvfp4", min_dim=16, high_precision_first=0.2, high_precision_last=3)
    assert [op.fp8 for op in fp8_ops(_mlp, both, *_args())] == [False] * 2 + [True] * 5 + [
        False
    ] * 3
    overlap = Fp8Recipe("nvfp4", min_dim=16, high_precision_first=6, high_precision_last=6)
    assert not any(op.fp8 for op in fp8_ops(_mlp, overlap, *_args()))
    assert Fp8Recipe("mxfp8").high_precision_first_rule == 0


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(WIDTH)(x)), None


class _Scanned(nn.Module):
    """Stacked layers under `nn.scan`, then an unscanned head."""

    @nn.compact
    def __call__(self, x):
        body = nn.scan(
            _Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        x, _ = body()(x, None)
        return nn.Dense(WIDTH, name="head")(x)


def test_scanned_layers_stay_nvfp4_and_the_head_after_them_is_kept():
    """The scan body is one GEMM for all 10 layers: the kept tail (round(0.15 * 11) = 2)
    stops at it, so only the head, after the scan, keeps bf16."""
    model = _Scanned()
    x = _args()[0]
    params = model.init(jax.random.key(0), x)
    ops = fp8_ops(model.apply, Fp8Recipe("nvfp4", min_dim=16), params, x)
    assert [(op.name.split("/")[-1], op.fp8) for op in ops] == [("Dense_0", True), ("head", False)]
    assert "stopped at a GEMM inside a lax.scan / while body" in ops[1].reason
    assert "after 1 of 2" in ops[1].reason
    # and autocast does what fp8_ops says: the body's GEMM quantises, the head's does not
    cast = mpjax.autocast(model.apply, "c=bf16", fp8=Fp8Recipe("nvfp4", min_dim=16))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(cast(p, x))))(params).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    body = [e for s in scans for e in _eqns(s.params["jaxpr"].jaxpr)]
    assert any(v.aval.dtype == E2M1 for e in body for v in e.outvars)
    head = [e for e in _eqns(jaxpr) if "head" in str(e.source_info.name_stack)]
    assert head and not any(v.aval.dtype in LOW for e in head for v in e.outvars)


def test_a_jitted_layer_called_twice_is_not_split():
    """Both calls share one jaxpr: keeping the last call alone is impossible, so the tail
    stops there (the unshared last GEMM is kept)."""
    layer = jax.jit(lambda x, w: jnp.tanh(x @ w))

    def fn(x, ws):
        x = layer(layer(x, ws[0]), ws[1])
        return x @ ws[2]

    ops = fp8_ops(fn, Fp8Recipe("nvfp4", min_dim=16, high_precision_last=2), *_args(3))
    assert [op.fp8 for op in ops] == [True, True, False]
    assert "shared jitted function" in ops[-1].reason


@pytest.mark.parametrize(
    "value, error, culprit",
    [
        (-1, ValueError, "high_precision_last=-1: a count"),
        (1.0, ValueError, r"high_precision_last=1.0: a fraction .* \[0, 1\)"),
        (float("nan"), ValueError, "high_precision_last=nan"),
        (-0.1, ValueError, "high_precision_last=-0.1"),
        (True, TypeError, "high_precision_last=True must be"),
        ("last", TypeError, "high_precision_last='last' must be"),
    ],
)
def test_bad_values_are_refused_naming_the_field(value, error, culprit):
    with pytest.raises(error, match=culprit):
        Fp8Recipe("nvfp4", high_precision_last=value)
    first = culprit.replace("high_precision_last", "high_precision_first")
    with pytest.raises(error, match=first):
        Fp8Recipe("nvfp4", high_precision_first=value)


def test_apply_policy_refuses_a_rule_it_cannot_apply():
    with pytest.raises(ValueError, match="cannot tell which GEMMs are last"):
        mpjax.apply_policy(nn.Dense(WIDTH), "c=bf16", fp8=Fp8Recipe(high_precision_last=1))
    with pytest.raises(ValueError, match="cannot tell which GEMMs are last"):
        mpjax.apply_policy(
            nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0)),
            "c=bf16",
            fp8=Fp8Recipe("nvfp4", high_precision_first=2),
        )
    # NVFP4's default rule is not applied module by module: code that ran before it existed
    # still runs (every covered GEMM in NVFP4), as with high_precision_last=0
    x = _args()[0]
    for recipe in (Fp8Recipe("nvfp4"), Fp8Recipe("nvfp4", high_precision_last=0)):
        ok = mpjax.apply_policy(nn.Dense(WIDTH), "c=bf16", fp8=recipe)
        assert ok.apply(ok.init(jax.random.key(0), x), x).shape == x.shape


def test_report_names_the_gemms_kept_by_the_rule():
    """`mpjax.report` of the gradient: the last two layers' forward, input- and weight-gradient
    GEMMs (6) carry `high_precision_last`, and the summary says so."""
    cast = mpjax.autocast(_mlp, "c=bf16", fp8=Fp8Recipe("nvfp4", min_dim=16))
    r = mpjax.report(jax.grad(lambda x, ws: jnp.sum(cast(x, ws)), argnums=1), *_args())
    kept = [g for g in r.gemms if g.high_precision_last]
    assert len(kept) == 6, [(g.path, g.direction) for g in kept]
    assert sorted(g.direction for g in kept) == ["backward"] * 4 + ["forward"] * 2
    assert all(g.asks_for == jnp.bfloat16 for g in kept)
    assert "6 GEMMs kept by Fp8Recipe.high_precision_last" in str(r)
    assert all("mpjax_high_precision_last" not in g.path for g in r.gemms)
