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
    """An FNO spectral layer: rfft2, a learned complex weight on low modes, irfft2."""

    modes: int = 4

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.5), (self.modes, self.modes, 2))
        xf = jnp.fft.rfft2(x)
        low = xf[:, : self.modes, : self.modes] * (w[..., 0] + 1j * w[..., 1])
        xf = jnp.zeros_like(xf).at[:, : self.modes, : self.modes].set(low)
        return jnp.fft.irfft2(xf, s=x.shape[1:])


class FNOLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x[..., None])[..., 0]
        return nn.Dense(1)(SpectralLinen()(h)[..., None])[..., 0]


class SpectralNNX(nnx.Module):
    def __init__(self, rngs, modes=4):
        self.modes = modes
        self.w = nnx.Param(jax.random.normal(rngs.params(), (modes, modes, 2)) * 0.5)

    def __call__(self, x):
        xf = jnp.fft.rfft2(x)
        m = self.modes
        low = xf[:, :m, :m] * (self.w[..., 0] + 1j * self.w[..., 1])
        return jnp.fft.irfft2(jnp.zeros_like(xf).at[:, :m, :m].set(low), s=x.shape[1:])


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_fft_module_under_one_string_policy_names_module_and_rule(framework):
    """The error names the FFT module and the one-line rule; that rule makes it train."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 16)), jnp.float32)
    y = jnp.roll(x, 1, axis=1)
    if framework == "linen":
        spectral = SpectralLinen
        model = mpjax.apply_policy(FNOLinen(), BF16)
        with pytest.raises(ValueError, match=r"SpectralLinen.*SpectralLinen: \"float32\""):
            model.init(jax.random.key(0), x)
        model = mpjax.apply_policy(FNOLinen(), {"*": BF16, spectral: "float32"})
        params = model.init(jax.random.key(0), x)
        loss = lambda p: jnp.mean((model.apply(p, x) - y) ** 2)  # noqa: E731
    else:
        spectral = SpectralNNX
        with pytest.raises(ValueError, match=r"SpectralNNX.*SpectralNNX: \"float32\""):
            mpjax.apply_policy(SpectralNNX(nnx.Rngs(0)), BF16)(x)
        module = mpjax.apply_policy(SpectralNNX(nnx.Rngs(0)), {"*": BF16, spectral: "float32"})
        graph, params = nnx.split(module)
        loss = lambda p: jnp.mean((nnx.merge(graph, p)(x) - y) ** 2)  # noqa: E731
    tx = optax.adam(1e-2)
    state = tx.init(params)
    first = float(loss(params))
    for _ in range(20):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert np.isfinite(float(loss(params))) and float(loss(params)) < first
