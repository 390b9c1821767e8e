"""Per-module policies on Flax NNX models: dtypes read from the jaxpr, rules, training."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpjax
from mpjax._src.analysis.param_casts import param_casts  # noqa: E402
from mpjax._src.flax.nnx import float32_softmax_attention
from mpjax.policy import module_policies
from tests.helpers.policy import (
    TOL,
    eqns,
    in_dtypes,
    matmul_dtypes,
    param_converts,
    paths,
    rel_error,
)

F32 = jnp.dtype(jnp.float32)
COMPUTE = ["bfloat16", "float16"]


def mixed(compute):
    return f"params=float32,compute={compute}"


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(6 * 6 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(x.reshape(x.shape[0], -1))


class TiedBlock(nnx.Module):
    def __init__(self, rngs, dropout=0.0, vocab=16, dim=8):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=dim, dropout_rate=dropout, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, tokens, deterministic=True):
        h = self.embed(tokens)
        h = h + self.attn(self.ln1(h), deterministic=deterministic)
        h = h + self.down(nnx.relu(self.up(self.ln2(h))))
        return self.embed.attend(h)


X = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
TOKENS = jax.random.randint(jax.random.key(1), (2, 5), 0, 16)


def traced(model, *args, jit=False, **kwargs):
    """The jaxpr of `model(*args)` with the model state as explicit inputs, and state paths.

    The jaxpr's first output is the model output, the rest the updated state.
    """
    graphdef, state = nnx.split(model)

    def fwd(state, *args):
        m = nnx.merge(graphdef, state)
        out = m(*args, **kwargs)
        return out, nnx.state(m)

    closed = jax.make_jaxpr(jax.jit(fwd) if jit else fwd)(state, *args)
    return closed, paths(state)


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("jit", [False, True])
def test_cnn_dtypes(compute, jit):
    model = mpjax.apply_policy(CNN(nnx.Rngs(0)), mixed(compute))
    closed, names = traced(model, X, jit=jit)
    dt = jnp.dtype(compute)
    mm = matmul_dtypes(closed.jaxpr)
    assert len(mm) == 2 and all(d == (dt, dt) for d in mm), mm
    stats = eqns(closed.jaxpr, "reduce_sum", "rsqrt")
    assert stats and all(in_dtypes(e) == (F32,) for e in stats)
    if not jit:
        for name, casts in zip(names, param_converts(closed, len(names)), strict=True):
            expected = [] if name.startswith("['bn']") else [dt]
            assert casts == expected, (name, casts)
    out, *state = closed.out_avals
    assert out.dtype == F32 and all(leaf.dtype == F32 for leaf in state)


@pytest.mark.parametrize("compute", COMPUTE)
def test_transformer_block_dtypes_and_softmax(compute):
    model = mpjax.apply_policy(TiedBlock(nnx.Rngs(0)), mixed(compute))
    closed, names = traced(model, TOKENS)
    dt = jnp.dtype(compute)
    mm = matmul_dtypes(closed.jaxpr)
    assert len(mm) == 9 and all(d == (dt, dt) for d in mm), mm
    softmax = eqns(closed.jaxpr, "exp", "reduce_max")
    assert softmax and all(in_dtypes(e) == (F32,) for e in softmax)
    norms = eqns(closed.jaxpr, "reduce_sum", "rsqrt")
    assert all(in_dtypes(e) == (F32,) for e in norms)
    for name, casts in zip(names, param_converts(closed, len(names)), strict=True):
        assert casts == ([] if name.startswith("['ln") else [dt]), (name, casts)
    assert model(TOKENS).dtype == F32


@pytest.mark.parametrize("defaults, softmax", [(mpjax.DEFAULTS, "float32"), (None, "bfloat16")])
def test_softmax_with_attention_dropout(defaults, softmax):
    # With dropout Flax's attention runs the softmax in the input dtype; the default
    # lists swap in the float32-softmax attention.
    defaults = defaults or mpjax.NO_DEFAULTS
    model = TiedBlock(nnx.Rngs(0, dropout=1), dropout=0.25)
    mpjax.apply_policy(model, mixed("bfloat16"), defaults=defaults)
    closed, _ = traced(model, TOKENS, deterministic=False)
    assert {in_dtypes(e)[0].name for e in eqns(closed.jaxpr, "exp")} == {softmax}
    bf = jnp.dtype(jnp.bfloat16)
    assert all(d == (bf, bf) for d in matmul_dtypes(closed.jaxpr))


@pytest.mark.parametrize("mask, causal", [(False, False), (True, False), (False, True)])
def test_float32_softmax_attention_matches_flax(mask, causal):
    k = jax.random.split(jax.random.key(2), 4)
    q, kk, v = (jax.random.normal(k[i], (2, 5, 2, 4)) for i in range(3))
    m = jax.random.bernoulli(k[3], 0.8, (2, 1, 5, 5)) if mask else None
    kwargs = dict(mask=m, is_causal=causal, dropout_rate=0.3, dropout_rng=jax.random.key(7))
    ours = float32_softmax_attention(q, kk, v, **kwargs)
    ref = nnx.dot_product_attention(q, kk, v, **kwargs)
    chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)
    # in bfloat16 it stays within bf16 tolerance of a float64 reference (same code path:
    # dropout configured but deterministic, as float64 would draw other dropout masks)
    kwargs["deterministic"] = True
    low = float32_softmax_attention(*(a.astype(jnp.bfloat16) for a in (q, kk, v)), **kwargs)
    assert low.dtype == jnp.bfloat16
    with jax.enable_x64(True):
        ref64 = nnx.dot_product_attention(
            *(np.asarray(a.astype(jnp.bfloat16), np.float64) for a in (q, kk, v)), **kwargs
        )
    assert rel_error(low, ref64) < TOL["bfloat16"]


def test_tied_embedding_cast_once_in_hlo():
    model = mpjax.apply_policy(TiedBlock(nnx.Rngs(0)), mixed("bfloat16"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    names = paths(params)
    emb = names.index("['embed']['embedding'].value")

    def loss(params):
        return jnp.mean(nnx.merge(graphdef, params, rest)(TOKENS) ** 2)

    lowered = jax.jit(jax.grad(loss)).lower(params)
    low = param_casts(lowered.as_text(dialect="hlo"), len(names))
    assert low[emb][0] == 1
    assert all(c <= 1 for c, _ in low)
    opt = param_casts(lowered.compile().as_text(), len(names))
    assert opt[emb][1] == 1 and all(m <= 1 for _, m in opt)


def _f64(model):
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(lambda a: np.asarray(a, np.float64), state)


# (jax's attention does not compile float16 with float32 accumulation on CPU, with or
# without a policy, so float16 runs eagerly only)
@pytest.mark.parametrize(
    "compute, jit",
    [
        ("float32", False),
        ("float32", True),
        ("bfloat16", False),
        ("bfloat16", True),
        ("float16", False),
    ],
)
def test_outputs_match_float64_reference(compute, jit):
    plain = TiedBlock(nnx.Rngs(0))
    graphdef, state64 = _f64(plain)
    with jax.enable_x64(True):
        ref = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state64, TOKENS)
    model = mpjax.apply_policy(plain, mixed(compute))
    out = nnx.jit(lambda m, t: m(t))(model, TOKENS) if jit else model(TOKENS)
    assert out.dtype == F32
    assert rel_error(out, ref) < TOL[compute]


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_grads_match_float64_reference(compute):
    plain = CNN(nnx.Rngs(0))
    plain.eval()  # BatchNorm on running statistics

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)))

    graphdef, state64 = _f64(plain)
    with jax.enable_x64(True):
        ref = jax.jit(jax.grad(lambda s: loss(nnx.merge(graphdef, s), X.astype(np.float64))))(
            state64
        )
    model = mpjax.apply_policy(plain, mixed(compute))
    grads = nnx.jit(nnx.grad(loss))(model, X)
    ref = nnx.state(ref, nnx.Param)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert rel_error(g, r) < 2 * TOL[compute]


def _train(model, tx, scaled=False, steps=5):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def loss_fn(m):
            loss = jnp.mean((m(x) - 1.0) ** 2)
            return mpjax.scale_loss(loss, optimizer.opt_state) if scaled else loss, loss

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, X)) for _ in range(steps)], optimizer


def test_optimizer_training_step():
    model = mpjax.apply_policy(CNN(nnx.Rngs(0)), mixed("bfloat16"))
    losses, _ = _train(model, optax.adam(1e-2))
    assert losses[-1] < losses[0]
    params = nnx.state(model, nnx.Param)
    assert all(isinstance(p, jax.Array) and p.dtype == F32 for p in jax.tree.leaves(params))
    assert all(s.dtype == F32 for s in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))


def test_optimizer_with_loss_scaling_and_bf16_params():
    model = mpjax.apply_policy(CNN(nnx.Rngs(0)), "params=bfloat16,compute=bfloat16")
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    losses, optimizer = _train(model, mpjax.loss_scaled(optax.adam(1e-2)), scaled=True)
    assert losses[-1] < losses[0]
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    metrics = mpjax.scaling_metrics(optimizer.opt_state)
    assert bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 0
    master = mpjax.scaling.find_loss_scaled_state(optimizer.opt_state).master
    assert all(m.dtype == F32 for m in jax.tree.leaves(master))


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, rngs=rngs)
        self.b = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(8, 8, rngs=rngs)
        self.layers = nnx.List([Layer(rngs), Layer(rngs)])
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net_dots(rules):
    model = mpjax.apply_policy(Net(nnx.Rngs(0)), rules, defaults=mpjax.NO_DEFAULTS)
    closed, _ = traced(model, jnp.ones((2, 8)))
    return [d[0].name for d in matmul_dtypes(closed.jaxpr)], module_policies(model)


def test_rules_by_class_path_and_default():
    rules = {"*": "float32", nnx.Linear: mixed("bfloat16"), "layers/1/b": "float16"}
    dots, table = _net_dots(rules)
    assert dots == ["bfloat16"] * 4 + ["float16", "bfloat16"]
    assert table[""] == table["layers/0"] == mpjax.get_policy("float32")
    assert table["layers/1/b"] == mpjax.get_policy("float16")


def test_parent_policy_covers_children():
    dots, table = _net_dots({"*": "float32", "layers/0": "float16"})
    assert dots == ["float32", "float16", "float16", "float32", "float32", "float32"]
    dots, _ = _net_dots({"layers": "float16"})  # a rule on the container reaches its elements
    assert dots == ["float32"] + ["float16"] * 4 + ["float32"]


def test_ambiguity_and_bad_rules_are_refused():
    with pytest.raises(ValueError) as info:
        _net_dots({"layers/.*": "bfloat16", ".*/b": "float16"})
    assert "'layers/.*'" in str(info.value) and "'.*/b'" in str(info.value)
    model = Net(nnx.Rngs(0))
    with pytest.raises(TypeError, match="Dense"):
        mpjax.apply_policy(model, {nn.Dense: "bfloat16"})
    with pytest.raises(ValueError, match="regular expression"):
        mpjax.apply_policy(model, {"layers/[": "bfloat16"})
    with pytest.raises(ValueError, match="bfloat61"):
        mpjax.apply_policy(model, {nnx.Linear: "p=f32,c=bfloat61"})


def test_in_place_reapply_and_state_unchanged():
    plain = Net(nnx.Rngs(0))
    before = nnx.state(plain)
    model = mpjax.apply_policy(plain, mixed("bfloat16"))
    assert model is plain and isinstance(model.inp, nnx.Linear)
    assert type(model.inp).__name__ == "Linear" and type(model.inp) is not nnx.Linear
    chex.assert_trees_all_equal(nnx.state(model), before)  # checkpoints interchange
    mpjax.apply_policy(model, {"head": "float16"})  # replaces the previous policy
    assert type(model.inp) is nnx.Linear and set(module_policies(model)) == {"head"}
    dots = [d[0].name for d in matmul_dtypes(traced(model, jnp.ones((2, 8)))[0].jaxpr)]
    assert dots == ["float32"] * 5 + ["float16"]


class Raw(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)))

    def __call__(self, x):
        return x @ self.w[...]


def test_user_module_raw_params_and_plain_jax_jit():
    model = mpjax.apply_policy(Raw(nnx.Rngs(0)), mixed("bfloat16"))
    x = jax.random.normal(jax.random.key(1), (2, 8))
    bf = jnp.dtype(jnp.bfloat16)
    assert matmul_dtypes(jax.make_jaxpr(lambda x: model(x))(x).jaxpr) == [(bf, bf)]
    # closed over, or passed as a pytree, under jax.jit; the parameter is left unchanged
    y1 = jax.jit(lambda x: model(x))(x)
    y2 = jax.jit(lambda m, x: m(x))(model, x)
    chex.assert_trees_all_close(y1, y2)
    assert model.w[...].dtype == F32 and isinstance(model.w[...], jax.Array)


class ScanBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.ln = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, x):
        return x + self.lin(self.ln(x))


class Stacked(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScanBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return nnx.remat(lambda b, x: b(x))(block, x)

        return self.head(body(x, self.blocks))


def test_scan_and_remat_over_stacked_layers():
    model = mpjax.apply_policy(Stacked(nnx.Rngs(0)), mixed("bfloat16"))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    graphdef, state = nnx.split(model)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss))(state)
    bf = jnp.dtype(jnp.bfloat16)
    mm = matmul_dtypes(closed.jaxpr)
    assert len(mm) >= 4 and all(d == (bf, bf) for d in mm), mm
    assert all(in_dtypes(e) == (F32,) for e in eqns(closed.jaxpr, "rsqrt"))
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(model)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    assert jax.tree.leaves(grads)[0].shape[0] == 3  # stacked layer grads


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_inputs_propagate_like_float32(bad):
    x = jax.random.normal(jax.random.key(3), (5, 8))
    x = x.at[0, 0].set(bad).at[2, 4].set(bad).at[4, 7].set(bad)  # first, middle, last
    plain = Net(nnx.Rngs(0))
    ref = plain(x)
    out = nnx.jit(lambda m, x: m(x))(mpjax.apply_policy(plain, mixed("bfloat16")), x)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    finite = np.isfinite(np.asarray(out)).all(axis=1)
    np.testing.assert_array_equal(finite, [False, True, False, True, False])
