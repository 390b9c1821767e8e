"""`apply_policy` on real layers: NNX decoding with Flax's default cache, FFT layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpjax

BF16 = "params=float32,compute=bfloat16,output=float32"
# What `apply_policy` makes of a module that calls an FFT under BF16: float32 inside, its
# outputs narrow between layers (as for normalisation layers).
FFT_RULE = "params=float32,compute=float32,output=bfloat16"


class TinyDecoder(nnx.Module):
    """Embed -> causal self-attention (decode cache) -> logits."""

    def __init__(self, vocab, d, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=d, qkv_features=d, decode=True, rngs=rngs
        )
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.attn(h))


def _greedy(model, first, steps):
    model.attn.init_cache((1, steps, 16))  # Flax's default: a float32 cache
    tokens, tok = [], first
    for _ in range(steps):
        logits = model(tok)
        tok = jnp.argmax(logits[:, -1:], -1)
        tokens.append(int(tok[0, 0]))
    return tokens, logits


def test_nnx_decoding_with_default_cache_under_bf16_policy_matches_float32():
    """Old code: TypeError in dynamic_update_slice (float32 cache, bfloat16 keys)."""
    ref_model = TinyDecoder(32, 16, nnx.Rngs(0))
    model = mpjax.apply_policy(TinyDecoder(32, 16, nnx.Rngs(0)), BF16)
    first = jnp.array([[3]])
    ref, _ = _greedy(ref_model, first, 8)
    got, logits = _greedy(model, first, 8)
    assert got == ref
    assert logits.dtype == jnp.float32
    assert model.attn.cached_key.get_value().dtype == jnp.float32  # kept as it was made


class SpectralLinen(nn.Module):
    """An FNO spectral layer: norm, pointwise mix, dropout, rfft2, low modes, irfft2."""

    modes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.Dense(16)(x))
        w = self.param("w", nn.initializers.normal(0.5), (self.modes, self.modes, 2))
        xf = jnp.fft.rfft2(x)
        low = xf[:, : self.modes, : self.modes] * (w[..., 0] + 1j * w[..., 1])
        self.sow("intermediates", "low_modes", low)
        xf = jnp.zeros_like(xf).at[:, : self.modes, : self.modes].set(low)
        return jnp.fft.irfft2(xf, s=x.shape[1:])


class FNOLinen(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(16)(x)
        return nn.Dense(1)(SpectralLinen()(h, train))[..., 0]


class SpectralNNX(nnx.Module):
    def __init__(self, rngs, modes=4):
        self.modes = modes
        self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        self.mix = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (modes, modes, 2)) * 0.5)

    def __call__(self, x):
        x = self.drop(self.mix(self.norm(x)))
        xf = jnp.fft.rfft2(x)
        m = self.modes
        low = xf[:, :m, :m] * (self.w[..., 0] + 1j * self.w[..., 1])
        return jnp.fft.irfft2(jnp.zeros_like(xf).at[:, :m, :m].set(low), s=x.shape[1:])


class FNONNX(nnx.Module):
    def __init__(self, rngs):
        self.lift = nnx.Linear(16, 16, rngs=rngs)
        self.spectral = SpectralNNX(rngs)
        self.proj = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.proj(self.spectral(self.lift(x)))[..., 0]


def _data():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 16)), jnp.float32)
    return x, jnp.roll(x, 1, axis=1).mean(-1)


def _equal(a, b):
    return jax.tree.all(jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b))


def _linen_train(model, steps, use_jit):
    """`steps` AdamW steps of an FNO (BatchNorm, dropout, sow inside the FFT module)."""
    x, y = _data()
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    def step(params, stats, opt, key):
        def loss_fn(p):
            out, upd = model.apply(
                {"params": p, "batch_stats": stats},
                x,
                rngs={"dropout": key},
                mutable=["batch_stats", "intermediates"],
            )
            return jnp.mean((out - y) ** 2), (out, upd)

        (loss, (out, upd)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), upd["batch_stats"], opt, loss, out, upd

    step = jax.jit(step) if use_jit else step
    losses = []
    for i in range(steps):
        params, stats, opt, loss, out, upd = step(params, stats, opt, jax.random.key(10 + i))
        losses.append(float(loss))
    return losses, (params, stats, out, upd["intermediates"])


@pytest.mark.parametrize("use_jit", [True, False])
def test_linen_fft_module_trains_under_one_string_policy_as_under_a_float32_rule(use_jit):
    """Old code: ValueError (RFFT of bfloat16). Now the FFT module runs in float32.

    Bit for bit what the rule `{SpectralLinen: FFT_RULE}` gives: the failed bfloat16
    attempt leaves no trace (BatchNorm statistics updated once, one `sow`, the same
    dropout masks and initial params).
    """
    losses, got = _linen_train(mpjax.apply_policy(FNOLinen(), BF16), 15, use_jit)
    rule = mpjax.apply_policy(FNOLinen(), {"*": BF16, SpectralLinen: FFT_RULE})
    ref_losses, ref = _linen_train(rule, 15, use_jit)
    assert losses == ref_losses
    assert _equal(got, ref)
    assert len(got[3]["SpectralLinen_0"]["low_modes"]) == 1  # sown once per call
    assert losses[-1] < 0.5 * losses[0]
    f32_losses, _ = _linen_train(FNOLinen(), 15, use_jit)
    np.testing.assert_allclose(losses, f32_losses, rtol=0.05)


def test_linen_fft_module_reports_float32_and_its_children_inherit_it():
    x, _ = _data()
    model = mpjax.apply_policy(FNOLinen(), BF16)
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    policies = mpjax.policy.linen_module_policies(
        model, variables, x, mutable=["batch_stats"], rngs={"dropout": jax.random.key(2)}
    )
    assert policies["SpectralLinen_0"].compute_dtype == jnp.float32
    assert policies["SpectralLinen_0"].output_dtype == jnp.bfloat16  # between layers narrow
    assert policies["SpectralLinen_0/Dense_0"].compute_dtype == jnp.float32
    assert policies["Dense_0"].compute_dtype == jnp.bfloat16


class ScannedFNO(nn.Module):
    """Three residual spectral blocks under `nn.scan` (and `nn.remat`), MaxText style."""

    remat: bool

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Block) if self.remat else _Block
        scanned = nn.scan(
            block,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True, "dropout": True},
            length=3,
        )
        return scanned()(x, None)[0].sum(-1)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + SpectralLinen()(x), None


@pytest.mark.parametrize("remat", [False, True])
def test_linen_fft_module_under_scan_and_remat_matches_the_float32_rule(remat):
    x, _ = _data()
    results = []
    for rules in (BF16, {"*": BF16, SpectralLinen: FFT_RULE}):
        model = mpjax.apply_policy(ScannedFNO(remat), rules)
        variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

        def loss(p, variables=variables, model=model):
            out, upd = model.apply(
                {**variables, "params": p},
                x,
                rngs={"dropout": jax.random.key(3)},
                mutable=["batch_stats"],
            )
            return jnp.mean(out**2), upd

        results.append(
            (variables, jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"]))
        )
    assert _equal(results[0], results[1])


def _nnx_train(model, steps):
    x, y = _data()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)], nnx.state(model)


def test_nnx_fft_module_trains_under_one_string_policy_as_under_a_float32_rule():
    losses, state = _nnx_train(mpjax.apply_policy(FNONNX(nnx.Rngs(0)), BF16), 15)
    rule = {"*": BF16, SpectralNNX: FFT_RULE}
    ref_losses, ref_state = _nnx_train(mpjax.apply_policy(FNONNX(nnx.Rngs(0)), rule), 15)
    assert losses == ref_losses
    assert _equal(state, ref_state)  # batch statistics, RNG counts, params
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_fft_module_that_fails_in_float32_too_names_module_and_rule(framework):
    """Children with their own bfloat16 rules feed the FFT: float32 cannot help; say so."""
    x, _ = _data()
    if framework == "linen":
        model = mpjax.apply_policy(
            FNOLinen(), {"*": BF16, nn.Dense: "bfloat16", nn.Dropout: "bfloat16"}
        )
        with pytest.raises(ValueError, match=r"SpectralLinen.*SpectralLinen: \"float32\""):
            model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    else:
        model = mpjax.apply_policy(FNONNX(nnx.Rngs(0)), {"*": BF16, nnx.Dropout: "bfloat16"})
        with pytest.raises(ValueError, match=r"SpectralNNX.*SpectralNNX: \"float32\""):
            model(x)
