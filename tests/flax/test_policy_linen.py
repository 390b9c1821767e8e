"""Per-module policies on Flax linen models: dtypes read from the jaxpr, rules, numerics."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax._src.analysis.param_casts import param_casts  # noqa: E402
from mpjax._src.flax.linen_attention import float32_softmax_attention
from mpjax.policy import linen_module_policies
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


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class TiedBlock(nn.Module):
    """Tied embeddings, LayerNorm, attention and an MLP; written with `setup`."""

    vocab: int = 16
    dim: int = 8

    def setup(self):
        self.embed = nn.Embed(self.vocab, self.dim)
        self.ln1 = nn.LayerNorm()
        self.attn = nn.MultiHeadDotProductAttention(num_heads=2)
        self.ln2 = nn.LayerNorm()
        self.up = nn.Dense(2 * self.dim)
        self.down = nn.Dense(self.dim)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(self.ln1(h))
        h = h + self.down(nn.relu(self.up(self.ln2(h))))
        return self.embed.attend(h)

    def encode(self, tokens):
        return self.up(self.embed(tokens))


CNN_X = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
TOKENS = jax.random.randint(jax.random.key(1), (2, 5), 0, 16)


@pytest.fixture(scope="module")
def cnn():
    """The CNN, an input, and its variables (the same with or without a float32-param policy)."""
    return CNN(), CNN_X, jax.jit(CNN().init)(jax.random.key(0), CNN_X)


@pytest.fixture(scope="module")
def block():
    return TiedBlock(), TOKENS, jax.jit(TiedBlock().init)(jax.random.key(0), TOKENS)


def make_jaxpr(fn, variables, *args):
    return jax.make_jaxpr(fn)(variables, *args)


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("jit", [False, True])
def test_cnn_dtypes(cnn, compute, jit):
    model, x, variables = cnn
    wrapped = mpjax.apply_policy(model, mixed(compute))

    def fwd(v, x):
        return wrapped.apply(v, x, mutable=["batch_stats"])

    closed = make_jaxpr(jax.jit(fwd) if jit else fwd, variables, x)
    dt = jnp.dtype(compute)
    mm = matmul_dtypes(closed.jaxpr)
    assert len(mm) == 2  # one conv, one dense
    assert all(d == (dt, dt) for d in mm), mm
    stats = eqns(closed.jaxpr, "reduce_sum", "rsqrt")
    assert stats and all(in_dtypes(e) == (F32,) for e in stats)
    (out, new_state) = jax.eval_shape(fwd, variables, x)
    assert out.dtype == F32  # final logits stay float32
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(new_state))
    if not jit:
        # Conv and Dense params are cast to compute once each; BatchNorm params never.
        names = paths(variables)
        conv = param_converts(closed, len(names))
        for name, casts in zip(names, conv, strict=True):
            expected = [] if ("BatchNorm" in name or "batch_stats" in name) else [dt]
            assert casts == expected, (name, casts)


@pytest.mark.parametrize("compute", COMPUTE)
def test_transformer_block_dtypes_and_softmax(block, compute):
    model, tokens, variables = block
    wrapped = mpjax.apply_policy(model, mixed(compute))
    closed = make_jaxpr(wrapped.apply, variables, tokens)
    dt = jnp.dtype(compute)
    mm = matmul_dtypes(closed.jaxpr)
    # q, k, v, q.k, w.v, out, up, down, attend
    assert len(mm) == 9 and all(d == (dt, dt) for d in mm), mm
    softmax = eqns(closed.jaxpr, "exp", "reduce_max")
    assert softmax and all(in_dtypes(e) == (F32,) for e in softmax)
    norms = eqns(closed.jaxpr, "reduce_sum", "rsqrt")
    assert norms and all(in_dtypes(e) == (F32,) for e in norms)
    names = paths(variables)
    for name, casts in zip(names, param_converts(closed, len(names)), strict=True):
        # every param cast at most once (the tied embedding too); LayerNorm params never
        assert casts == ([] if "ln" in name else [dt]), (name, casts)
    assert jax.eval_shape(wrapped.apply, variables, tokens).dtype == F32

    # Without the default lists the softmax runs in the compute dtype.
    bare = mpjax.apply_policy(model, mixed(compute), defaults=mpjax.NO_DEFAULTS)
    closed = make_jaxpr(bare.apply, variables, tokens)
    assert all(in_dtypes(e) == (dt,) for e in eqns(closed.jaxpr, "exp"))
    assert jax.eval_shape(bare.apply, variables, tokens).dtype == dt


def test_tied_embedding_cast_once_in_hlo(block):
    model, tokens, variables = block
    wrapped = mpjax.apply_policy(model, mixed("bfloat16"))
    names = paths(variables["params"])
    emb = names.index("['embed']['embedding']")

    def loss(params):
        return jnp.mean(wrapped.apply({"params": params}, tokens) ** 2)

    lowered = jax.jit(jax.grad(loss)).lower(variables["params"])
    low = param_casts(lowered.as_text(dialect="hlo"), len(names))
    assert low[emb][0] == 1  # the program casts the tied embedding once per step
    assert all(c <= 1 for c, _ in low)
    opt = param_casts(lowered.compile().as_text(), len(names))
    assert 1 <= opt[emb][1] <= 1 and all(m <= 1 for _, m in opt)

    # The counter does see a parameter cast twice.
    def twice(w, x):
        return x @ w.astype(jnp.bfloat16) + jnp.tanh(x) @ w.astype(jnp.bfloat16)

    w = jnp.ones((4, 4))
    text = jax.jit(twice).lower(w, jnp.ones((2, 4), jnp.bfloat16)).as_text(dialect="hlo")
    assert param_casts(text, 1)[0][0] == 2


def test_variable_tree_is_identical_and_checkpoints_interchange(cnn):
    model, x, plain = cnn
    wrapped = mpjax.apply_policy(model, mixed("bfloat16"))
    policied = jax.jit(wrapped.init)(jax.random.key(0), x)
    chex.assert_trees_all_equal(plain, policied)
    out = jax.jit(wrapped.apply, static_argnames="train")(plain, x, train=False)
    assert out.shape == (2, 10) and out.dtype == F32


def test_params_created_in_param_dtype(cnn):
    model, x, _ = cnn
    variables = jax.jit(mpjax.apply_policy(model, "bfloat16").init)(jax.random.key(0), x)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(variables["params"]))
    assert all(s.dtype == F32 for s in jax.tree.leaves(variables["batch_stats"]))


def _f64_reference(model, variables, *args, **kwargs):
    with jax.enable_x64(True):
        v64 = jax.tree.map(lambda a: np.asarray(a, np.float64), variables)
        a64 = jax.tree.map(
            lambda a: np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
            args,
        )
        return np.asarray(jax.jit(model.apply)(v64, *a64, **kwargs))


@pytest.mark.parametrize("compute", ["float32", *COMPUTE])
@pytest.mark.parametrize("jit", [False, True])
def test_outputs_match_float64_reference(block, compute, jit):
    model, tokens, variables = block
    wrapped = mpjax.apply_policy(model, mixed(compute))
    apply = jax.jit(wrapped.apply) if jit else wrapped.apply
    out = apply(variables, tokens)
    ref = _f64_reference(model, variables, tokens)
    assert rel_error(out, ref) < TOL[compute]


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_grads_match_float64_reference(cnn, compute):
    model, x, variables = cnn
    wrapped = mpjax.apply_policy(model, mixed(compute))

    def loss(params, m, v, x):
        return jnp.sum(jnp.sin(m.apply(dict(v, params=params), x, train=False)))

    grads = jax.jit(jax.grad(loss), static_argnums=1)(variables["params"], wrapped, variables, x)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    with jax.enable_x64(True):
        v64 = jax.tree.map(lambda a: np.asarray(a, np.float64), variables)
        ref = jax.jit(jax.grad(loss), static_argnums=1)(
            v64["params"], model, v64, np.asarray(x, np.float64)
        )
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert rel_error(g, r) < 2 * TOL[compute]


class Sub(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="b")(nn.Dense(8, name="a")(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="inp")(x)
        x = Sub(name="enc")(x)
        return nn.Dense(4, name="head")(x)


def _net_dots(rules, defaults=mpjax.NO_DEFAULTS):
    x = jax.random.normal(jax.random.key(1), (2, 8))
    wrapped = mpjax.apply_policy(Net(), rules, defaults=defaults)
    variables = wrapped.init(jax.random.key(0), x)
    closed = make_jaxpr(wrapped.apply, variables, x)
    table = linen_module_policies(wrapped, variables, x)
    return [d[0].name for d in matmul_dtypes(closed.jaxpr)], table


def test_rules_by_class_path_and_default():
    dots, table = _net_dots({"*": "float32", nn.Dense: mixed("bfloat16"), "enc/b": "float16"})
    assert dots == ["bfloat16", "bfloat16", "float16", "bfloat16"]
    assert table[""] == mpjax.get_policy("float32")
    assert table["enc"] == mpjax.get_policy("float32")
    assert table["enc/b"] == mpjax.get_policy("float16")


def test_parent_policy_covers_children():
    dots, table = _net_dots({"*": "float32", "enc": "float16"})
    assert dots == ["float32", "float16", "float16", "float32"]
    assert table["enc/a"] == table["enc"] == mpjax.get_policy("float16")
    dots, _ = _net_dots({"enc": "float16"})  # no default: the rest is left alone
    assert dots == ["float32", "float16", "float16", "float32"]


def test_ambiguous_rules_error_names_both():
    with pytest.raises(ValueError) as info:
        _net_dots({"enc/.*": "bfloat16", ".*/b": "float16"})
    assert "'enc/.*'" in str(info.value) and "'.*/b'" in str(info.value)


def test_bad_rules_are_refused_by_apply_policy():
    with pytest.raises(TypeError, match="Linear"):
        mpjax.apply_policy(Net(), {nnx.Linear: "bfloat16"})
    with pytest.raises(TypeError, match="str"):
        mpjax.apply_policy(Net(), {str: "bfloat16"})
    with pytest.raises(ValueError, match="regular expression"):
        mpjax.apply_policy(Net(), {"enc/(": "bfloat16"})
    with pytest.raises(ValueError, match="float17"):
        mpjax.apply_policy(Net(), {"enc": "compute=float17"})
    with pytest.raises(TypeError, match="flax.linen.Module or a flax.nnx.Module"):
        mpjax.apply_policy(lambda x: x, "bfloat16")


class RawCompact(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 4))
        return x @ w


class RawSetup(nn.Module):
    def setup(self):
        self.w = self.param("w", nn.initializers.lecun_normal(), (8, 4))
        self.inner = RawCompact()

    def __call__(self, x):
        return self.inner(x @ self.w)


@pytest.mark.parametrize("compute", COMPUTE)
def test_user_modules_with_raw_params(compute):
    x = jax.random.normal(jax.random.key(1), (2, 8))
    wrapped = mpjax.apply_policy(RawSetup(), mixed(compute))
    variables = wrapped.init(jax.random.key(0), x)
    closed = make_jaxpr(wrapped.apply, variables, x)
    dt = jnp.dtype(compute)
    assert matmul_dtypes(closed.jaxpr) == [(dt, dt), (dt, dt)]


def test_method_argument(block):
    model, tokens, variables = block
    wrapped = mpjax.apply_policy(model, mixed("bfloat16"))
    ref = wrapped.apply(variables, tokens, method="encode")
    assert ref.dtype == F32 and ref.shape == (2, 5, 16)
    for method in (TiedBlock.encode, lambda m, t: m.encode(t)):
        chex.assert_trees_all_close(wrapped.apply(variables, tokens, method=method), ref)
    closed = jax.make_jaxpr(lambda v, t: wrapped.apply(v, t, method="encode"))(variables, tokens)
    assert matmul_dtypes(closed.jaxpr) == [(jnp.bfloat16, jnp.bfloat16)]


class Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(8, name="rem")(x)

        class Layer(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.Dense(8)(c), None

        scan = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = scan(name="layers")(x, None)
        return nn.LayerNorm(name="ln")(x)


def test_lifted_transforms():
    x = jax.random.normal(jax.random.key(1), (2, 8))
    wrapped = mpjax.apply_policy(Lifted(), mixed("bfloat16"))
    variables = wrapped.init(jax.random.key(0), x)

    def loss(v):
        return jnp.sum(wrapped.apply(v, x) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss))(variables)
    mm = matmul_dtypes(closed.jaxpr)
    assert len(mm) >= 4 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in mm), mm
    assert all(in_dtypes(e) == (F32,) for e in eqns(closed.jaxpr, "rsqrt"))
    table = linen_module_policies(wrapped, variables, x)
    assert table["ln"].compute_dtype == F32
    assert table["layers/Dense_0"].compute_dtype == jnp.bfloat16


class Outer(nn.Module):
    policy: bool = True

    @nn.compact
    def __call__(self, x):
        sub = Sub()
        x = (mpjax.apply_policy(sub, mixed("bfloat16")) if self.policy else sub)(x)
        return nn.Dense(4)(x)


def test_policy_module_as_a_submodule():
    x = jax.random.normal(jax.random.key(1), (2, 8))
    variables = Outer().init(jax.random.key(0), x)
    # the wrapped submodule keeps its own place in the variable tree
    plain = Outer(policy=False).init(jax.random.key(0), x)
    chex.assert_trees_all_equal(variables, plain)
    closed = make_jaxpr(Outer().apply, variables, x)
    bf = jnp.dtype(jnp.bfloat16)
    assert matmul_dtypes(closed.jaxpr) == [(bf, bf), (bf, bf), (F32, F32)]


def test_nested_policy_modules_are_refused():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="inside another"):
        mpjax.apply_policy(Outer(), "float32").init(jax.random.key(0), x)


@pytest.mark.parametrize("mask", [False, True])
def test_float32_softmax_attention_matches_flax(mask):
    k = jax.random.split(jax.random.key(2), 4)
    q, kk, v = (jax.random.normal(k[i], (2, 5, 2, 4)) for i in range(3))
    m = jax.random.bernoulli(k[3], 0.8, (2, 1, 5, 5)) if mask else None
    kwargs = dict(mask=m, dropout_rate=0.3, dropout_rng=jax.random.key(7), deterministic=False)
    ours = float32_softmax_attention(q, kk, v, **kwargs)
    chex.assert_trees_all_close(ours, nn.dot_product_attention(q, kk, v, **kwargs), rtol=1e-5)
    kwargs["deterministic"] = True  # float64 would draw other dropout masks
    low = float32_softmax_attention(*(a.astype(jnp.bfloat16) for a in (q, kk, v)), **kwargs)
    assert low.dtype == jnp.bfloat16
    with jax.enable_x64(True):
        ref = nn.dot_product_attention(
            *(np.asarray(a.astype(jnp.bfloat16), np.float64) for a in (q, kk, v)), **kwargs
        )
    assert rel_error(low, ref) < TOL["bfloat16"]


class CustomAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        attn = nn.MultiHeadDotProductAttention(
            num_heads=2, attention_fn=lambda q, k, v, **kw: nn.dot_product_attention(q, k, v)
        )
        return attn(x)


def test_user_attention_fn_is_left_alone():
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    wrapped = mpjax.apply_policy(CustomAttention(), mixed("bfloat16"))
    variables = wrapped.init(jax.random.key(0), x)
    closed = make_jaxpr(wrapped.apply, variables, x)
    assert {in_dtypes(e)[0].name for e in eqns(closed.jaxpr, "exp")} == {"bfloat16"}


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_inputs_propagate_like_float32(bad):
    x = jax.random.normal(jax.random.key(3), (5, 8))
    x = x.at[0, 0].set(bad).at[2, 4].set(bad).at[4, 7].set(bad)  # first, middle, last
    wrapped = mpjax.apply_policy(Net(), mixed("bfloat16"))
    variables = Net().init(jax.random.key(0), x)
    out = jax.jit(wrapped.apply)(variables, x)
    ref = Net().apply(variables, x)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    finite = np.isfinite(np.asarray(out)).all(axis=1)
    np.testing.assert_array_equal(finite, [False, True, False, True, False])
