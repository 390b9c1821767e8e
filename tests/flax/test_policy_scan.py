"""Issue 34 (13): layers run by `nn.scan` / `nnx.scan` under a policy, their carry entering in
float32 (Flax's lm1b decoder casts `y = y.astype(config.dtype)` with the config left float32).

`lax.scan` needs the carry to leave the body in the dtype it entered; the policy computes the
body in bfloat16, so the carry the scanned module returns is cast back at the loop boundary.
The scanned model matches the Python loop over the same layers and a float64 reference, and
its GEMMs run in bfloat16."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from tests.helpers.policy import TOL, matmul_dtypes, rel_error

POLICY = "params=float32,compute=bfloat16,output=float32"
LAYERS, DIM, VOCAB = 3, 16, 32
BF16, F32, F64 = (jnp.dtype(d) for d in ("bfloat16", "float32", "float64"))
TOKENS = (np.arange(10, dtype=np.int32) % VOCAB).reshape(2, 5)


class Block(nn.Module):
    """A pre-norm MLP block with a residual connection, `(carry, _) -> (carry, None)`."""

    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(2 * DIM)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h)), None


class Decoder(nn.Module):
    """lm1b-style: embeddings, upcast to `carry_dtype`, the layers, a final norm, logits."""

    scan: bool = True
    remat: bool = False
    carry_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        y = nn.Embed(VOCAB, DIM)(tokens).astype(self.carry_dtype)
        if self.scan:
            block = nn.remat(Block) if self.remat else Block
            kw = dict(variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
            y, _ = nn.scan(block, **kw)(name="layers")(y, None)
        else:
            for i in range(LAYERS):
                y, _ = Block(name=f"layer_{i}")(y, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(y))


def _unstacked(params):
    """The scanned model's params as the Python loop's (`layers` split into `layer_i`)."""
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(LAYERS):
        out[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    return out


def _float64_reference(params):
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
        out = jax.jit(Decoder(scan=False, carry_dtype=jnp.float64).apply)({"params": p64}, TOKENS)
        return np.asarray(out, np.float64)


@pytest.mark.parametrize("remat", [False, True])
def test_linen_scan_with_float32_carry_matches_the_loop(remat):
    scanned = mpjax.apply_policy(Decoder(remat=remat), POLICY)
    loop = mpjax.apply_policy(Decoder(scan=False), POLICY)
    params = jax.jit(scanned.init)(jax.random.key(0), TOKENS)["params"]

    def loss(p):
        return jnp.mean(scanned.apply({"params": p}, TOKENS) ** 2)

    @jax.jit
    def run(p, loop_p):  # lax.scan refused the bf16 carry before
        return scanned.apply({"params": p}, TOKENS), loop.apply({"params": loop_p}, TOKENS)

    loop_params = _unstacked(params)
    out, loop_out = run(params, loop_params)
    assert out.dtype == F32
    ref = _float64_reference(loop_params)
    assert rel_error(out, ref) < TOL["bfloat16"]
    assert rel_error(loop_out, ref) < TOL["bfloat16"]
    np.testing.assert_allclose(np.asarray(out), np.asarray(loop_out), rtol=2e-2, atol=2e-2)
    assert all(g.dtype == F32 for g in jax.tree.leaves(jax.eval_shape(jax.grad(loss), params)))
    # 2 GEMMs per layer in the scan body and the logits; their transposes under grad
    forward = matmul_dtypes(jax.make_jaxpr(loss)(params).jaxpr)
    backward = matmul_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert len(forward) == 3 and len(backward) >= 9
    assert all(d == (BF16, BF16) for d in forward + backward), forward + backward


class Step(nn.Module):
    @nn.compact
    def __call__(self, c):
        return c + nn.Dense(4)(c)


class Loop(nn.Module):
    """A carry entering `nn.while_loop` in float32, the body a policy-covered module."""

    @nn.compact
    def __call__(self, x):
        step = Step()
        c = step(x).astype(jnp.float32)
        _, c = nn.while_loop(lambda m, c: c[0] < 3, lambda m, c: (c[0] + 1, m(c[1])), step, (0, c))
        return c


def test_linen_while_loop_body_keeps_the_carry_dtype():
    model = mpjax.apply_policy(Loop(), POLICY)
    x = jnp.ones((2, 4))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    out, plain = jax.jit(lambda v: (model.apply(v, x), Loop().apply(v, x)))(variables)
    assert out.dtype == F32
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=3e-2, atol=3e-2)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxDecoder(nnx.Module):
    """The NNX form: layers stacked by `nnx.vmap` and run by `nnx.scan`, or an `nnx.List`."""

    def __init__(self, rngs, scan=True, carry_dtype=jnp.float32):
        self.scan, self.carry_dtype = scan, carry_dtype
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        if scan:
            make = nnx.vmap(lambda r: NnxBlock(r), in_axes=0, out_axes=0)
            self.blocks = nnx.split_rngs(splits=LAYERS)(make)(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        y = self.embed(tokens).astype(self.carry_dtype)
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(y, block):
                return block(y)

            y = body(y, self.blocks)
        else:
            for block in self.blocks:
                y = block(y)
        return self.head(self.norm(y))


def _nnx_loop_like(scanned, carry_dtype=jnp.float32):
    """A Python-loop `NnxDecoder` holding the scanned model's parameters, layer by layer."""
    loop = NnxDecoder(nnx.Rngs(1), scan=False, carry_dtype=carry_dtype)
    for name in ("embed", "norm", "head"):
        nnx.update(getattr(loop, name), nnx.state(getattr(scanned, name)))
    stacked = nnx.state(scanned.blocks)
    for i, block in enumerate(loop.blocks):
        nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stacked))
    return loop


def test_nnx_scan_with_float32_carry_matches_the_loop():
    scanned = NnxDecoder(nnx.Rngs(0))
    with jax.enable_x64(True):
        ref_model = _nnx_loop_like(scanned, jnp.float64)
        nnx.update(ref_model, jax.tree.map(lambda a: a.astype(F64), nnx.state(ref_model)))
        ref = np.asarray(nnx.jit(lambda m, t: m(t))(ref_model, TOKENS), np.float64)
    loop = mpjax.apply_policy(_nnx_loop_like(scanned), POLICY)
    mpjax.apply_policy(scanned, POLICY)
    # lax.scan refused the bf16 carry before
    out, loop_out = nnx.jit(lambda m, n: (m(TOKENS), n(TOKENS)))(scanned, loop)
    assert out.dtype == F32
    assert rel_error(out, ref) < TOL["bfloat16"]
    assert rel_error(loop_out, ref) < TOL["bfloat16"]
    np.testing.assert_allclose(np.asarray(out), np.asarray(loop_out), rtol=2e-2, atol=2e-2)

    graphdef, state = nnx.split(scanned)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(TOKENS) ** 2)

    forward = matmul_dtypes(jax.make_jaxpr(loss)(state).jaxpr)
    backward = matmul_dtypes(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
    assert len(forward) == 3 and len(backward) >= 9
    assert all(d == (BF16, BF16) for d in forward + backward), forward + backward


class NnxStep(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, c):
        return c + self.lin(c)


class NnxLoops(nnx.Module):
    """A float32 carry through `nnx.fori_loop`, then `lax.fori_loop` over a closed-over layer."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 4, rngs=rngs)
        self.step = NnxStep(rngs)

    def __call__(self, x):
        c = self.inp(x).astype(jnp.float32)
        _, c = nnx.fori_loop(0, 2, lambda i, s: (s[0], s[0](s[1])), (self.step, c))
        return jax.lax.fori_loop(0, 2, lambda i, c: self.step(c), c)


def test_nnx_fori_loops_keep_the_carry_dtype():
    model = NnxLoops(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    plain = model(x)  # float32 throughout
    mpjax.apply_policy(model, POLICY)
    out = nnx.jit(lambda m: m(x))(model)
    assert out.dtype == F32
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=3e-2, atol=3e-2)
