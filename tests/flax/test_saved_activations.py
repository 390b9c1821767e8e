"""`apply_policy` with `Policy.saved_activations`: Dense/Conv inputs kept in fp8 (linen, NNX)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mpjax
from mpjax.fp8 import saved_activations_policy
from tests.helpers.saved import (
    BF16,
    E4M3,
    PLAIN,
    SAVED,
    bf16_exact,
    residuals,
    weight_grad_bound,
)

M, K, D, H = 8, 16, 32, 64


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(nn.Dense(H)(nn.Dense(D)(x)))


def test_linen_dense_and_conv_inputs_saved_in_fp8_only():
    """Each Dense/Conv input is an e4m3 residual; no bf16 copy of the hidden is kept."""
    model, x = Mlp(), jnp.ones((M, K))
    v = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes suffice: no compiles

    def kept(policy, model=model, v=v, x=x):
        m = mpjax.apply_policy(model, policy)
        return residuals(lambda v: m.apply(v, x).sum(), v)

    plain, saved = kept(PLAIN), kept(SAVED)
    assert (BF16, (M, H)) in plain and (BF16, (M, D)) in plain
    assert (E4M3, (M, H)) in saved and (E4M3, (M, D)) in saved and (E4M3, (M, K)) in saved
    assert (BF16, (M, H)) not in saved and (BF16, (M, D)) not in saved

    conv, img = nn.Conv(8, (3, 3)), jnp.ones((2, 6, 6, 4))
    cv = jax.eval_shape(conv.init, jax.random.key(0), img)
    assert (E4M3, (2, 6, 6, 4)) in kept(SAVED, conv, cv, img)
    assert all(d != E4M3 for d, _ in kept(PLAIN, conv, cv, img))


def test_linen_kernel_gradient_within_e4m3_bound():
    rng = np.random.default_rng(0)
    x, c = bf16_exact(rng, (M, K)), bf16_exact(rng, (M, D))
    layer = nn.Dense(D, use_bias=False)
    v = {"params": {"kernel": jnp.asarray(bf16_exact(rng, (K, D)))}}
    m = mpjax.apply_policy(layer, SAVED)
    dw = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x) * c)))(v)["params"]["kernel"]
    ref = x.astype(np.float64).T @ c.astype(np.float64)
    assert np.all(np.abs(np.asarray(dw, np.float64) - ref) <= weight_grad_bound(x, c))


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(D)(nn.gelu(nn.Dense(H)(h))), None


class Stack(nn.Module):
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block, policy=saved_activations_policy()) if self.remat else Block
        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan()(x, None)[0]


def test_linen_remat_scan_keeps_stacked_fp8_inputs():
    """`nn.scan` of `nn.remat(Block, policy=saved_activations_policy())`: the layers' Dense
    inputs are kept stacked over the layers in e4m3 (the MLP hidden not in bf16); without
    the option the same remat policy keeps nothing but the block inputs."""
    model, x = Stack(), jnp.ones((M, D))
    v = jax.eval_shape(model.init, jax.random.key(0), x)

    def kept(policy):
        m = mpjax.apply_policy(model, policy)
        return residuals(lambda v: m.apply(v, x).sum(), v)

    saved = kept(SAVED)
    assert (E4M3, (3, M, D)) in saved and (E4M3, (3, M, H)) in saved
    assert (BF16, (3, M, H)) not in saved
    assert [d for d, _ in kept(PLAIN) if d == E4M3] == []


def test_nnx_linear_inputs_saved_in_fp8():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(K, H, rngs=rngs), nnx.Linear(H, D, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    net = mpjax.apply_policy(nnx.eval_shape(lambda: Net(nnx.Rngs(0))), SAVED)
    graph, state = nnx.split(net)
    x = jnp.ones((M, K))
    kept = residuals(lambda s: nnx.merge(graph, s)(x).sum(), state)
    assert (E4M3, (M, H)) in kept and (BF16, (M, H)) not in kept
