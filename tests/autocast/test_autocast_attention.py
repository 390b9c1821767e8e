"""`jax.nn.dot_product_attention` under `mpjax.autocast`: the hand-written compute-dtype call.

On CPU (the XLA implementation); the cuDNN kernel under autocast is checked on the deviceless
H100 compile in tests/flax/test_attention_gpu.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.analysis.target import target_cudnn
from tests.helpers.numerics import f64_reference, tree_rel_err
from tests.helpers.policy import eqns

B, T, N, H = 2, 16, 2, 8
CUDNN = ("dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper")


def attention(q, k, v, bias, mask):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)


def reference64(q, k, v, bias, mask):
    """softmax(q k^T / sqrt(H) + bias, masked, causal) v in float64, from the definition."""
    q, k, v, bias = (np.asarray(x, np.float64) for x in (q, k, v, bias))
    logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H) + bias
    keep = np.asarray(mask) & np.tril(np.ones((T, T), bool))
    logits = np.where(keep, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", weights, v)


@pytest.fixture(scope="module")
def inputs():
    kq, kk, kv, kb = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in (kq, kk, kv))
    bias = 0.5 * jax.random.normal(kb, (1, N, T, T))
    mask = (jnp.arange(T)[None, :] < jnp.array([T, T // 2])[:, None])[:, None, None, :]
    return q, k, v, bias, mask


def hand_written(q, k, v, bias, mask):
    return attention(*(x.astype(jnp.bfloat16) for x in (q, k, v, bias)), mask)


def test_autocast_attention_is_the_hand_written_compute_dtype_attention(inputs):
    ours = jax.jit(mpjax.autocast(attention, "params=float32,compute=bfloat16,output=float32"))(
        *inputs
    )
    # Bit for bit (before: the logits GEMM rounded to bfloat16, up to 2^-7 apart).
    np.testing.assert_array_equal(ours, jax.jit(hand_written)(*inputs).astype(jnp.float32))
    assert tree_rel_err(ours, reference64(*inputs)) < 2e-2


def test_autocast_attention_gradients_are_the_hand_written_ones(inputs):
    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, *inputs[3:]).astype(jnp.float32) ** 2)

    ours = jax.jit(jax.grad(loss(mpjax.autocast(attention)), argnums=(0, 1, 2)))(*inputs[:3])
    hand = jax.jit(jax.grad(loss(hand_written), argnums=(0, 1, 2)))(*inputs[:3])
    for a, b in zip(ours, hand, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)


def test_attention_outside_autocast_and_in_a_float32_autocast_is_untouched(inputs):
    plain = jax.jit(attention)(*inputs)
    assert plain.dtype == jnp.float32
    f32 = jax.jit(mpjax.autocast(attention, "params=float32,compute=float32,output=float32"))(
        *inputs
    )
    np.testing.assert_array_equal(f32, plain)


def test_a_function_jitted_inside_autocast_is_traced_again_outside_it(inputs):
    # Before: jax.jit's cache handed back the bfloat16 trace (result bfloat16, rounded).
    jitted = jax.jit(attention)
    mpjax.autocast(lambda *a: jitted(*a))(*inputs)
    after = jitted(*inputs)
    assert after.dtype == jnp.float32
    np.testing.assert_array_equal(after, jax.jit(lambda *a: attention(*a))(*inputs))


def definition(q, k, v, bias):
    """softmax(q k^T / sqrt(H) + bias) v, from the definition (any float dtype)."""
    logits = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(logits, axis=-1), v)


def autocast_grads(loss, policy, grad):
    """`value_and_grad(loss, (0, 1, 2), has_aux=True)` under autocast: `grad` inside or around."""
    vg = functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    return (
        mpjax.autocast(vg(loss), policy) if grad == "inside" else vg(mpjax.autocast(loss, policy))
    )


@pytest.mark.parametrize("grad", ["around", "inside"])
def test_a_float32_min_bias_masking_whole_rows_gives_finite_gradients(inputs, grad):
    # Left padding (batch row 1's first T // 2 positions) and causality as an additive
    # finfo(float32).min bias: row 1's first queries see no key. Before: the bias was cast to
    # bfloat16 as -inf, those rows were NaN and so were 192 gradient entries (the loss,
    # which leaves the padded queries out, was finite); with the gradient taken inside
    # autocast, the rewrite of softmax's backward raised "data type bool not inexact".
    q, k, v, noise, _ = inputs
    valid = jnp.arange(T)[None, :] >= jnp.array([0, T // 2])[:, None]  # [B, T]
    keep = valid[:, None, None, :] & jnp.tril(jnp.ones((T, T), bool))
    bias = jnp.where(keep, noise, jnp.finfo(jnp.float32).min)
    ct = jax.random.normal(jax.random.key(1), (B, T, N, H)) * valid[:, :, None, None]

    def loss(attn):
        return lambda q, k, v, bias: (jnp.sum(attn(q, k, v, bias) * ct), ())

    f32 = jax.value_and_grad(loss(jax.nn.dot_product_attention), (0, 1, 2), has_aux=True)
    (f32_loss, _), f32_grads = jax.jit(f32)(q, k, v, bias)
    assert np.isfinite(f32_loss) and all(np.isfinite(g).all() for g in f32_grads)
    run = autocast_grads(loss(jax.nn.dot_product_attention), "p=f32,c=bf16,o=f32", grad)
    (ours_loss, _), ours = jax.jit(run)(q, k, v, bias)
    assert np.isfinite(ours_loss)
    for g in ours:
        assert g.dtype == jnp.float32 and np.isfinite(g).all()
    ref = f64_reference(jax.grad(loss(definition), (0, 1, 2), has_aux=True), q, k, v, bias)[0]
    assert tree_rel_err(ours, ref) < 2e-2


def shard_mapped(fn):
    """`fn(q, k, v, mask)` in `shard_map(check_vma=True)` over the batch, on an Explicit mesh."""
    mesh = jax.make_mesh((B,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:B])
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P("d"),) * 4, out_specs=P("d"), check_vma=True)

    def run(*args):
        with jax.set_mesh(mesh):
            return jax.jit(mapped)(*(jax.device_put(a, NamedSharding(mesh, P("d"))) for a in args))

    return run


@pytest.mark.parametrize(
    ("where", "grad"), [("jit", "around"), ("jit", "inside"), ("shard_map", "inside")]
)
def test_float16_autocast_attention_runs_on_cpu(inputs, where, grad):
    # Before: "The precision 'F16_F16_F32' is not supported by dot_general on CPU" (JAX's
    # float16 XLA form asks for it); on CPU it now runs on the float16 values widened. With
    # the gradient inside autocast, the rewrite kept both branches of the platform choice.
    q, k, v, bias, mask = inputs

    def loss(q, k, v, mask):
        out = jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)
        return jnp.sum(out * v), out

    run = autocast_grads(loss, "p=f32,c=f16,o=f32", grad)

    def out_and_grads(*args):
        (_, out), grads = run(*args)
        return out, grads

    step = jax.jit(out_and_grads) if where == "jit" else shard_mapped(out_and_grads)
    out, grads = step(q, k, v, mask)
    assert out.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in grads)
    assert tree_rel_err(out, reference64(*inputs)) < 2e-3

    def ref_loss(q, k, v):
        masked = jnp.where(mask & jnp.tril(jnp.ones((T, T), bool)), bias, -jnp.inf)
        return jnp.sum(definition(q, k, v, masked) * v)

    assert tree_rel_err(grads, f64_reference(jax.grad(ref_loss, (0, 1, 2)), q, k, v)) < 5e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_autocast_traces_cudnn_attention_on_float32_in_the_compute_dtype(inputs, dtype):
    # `implementation="cudnn"` raises on float32 operands; under autocast it is cuDNN's
    # kernel in the compute dtype, forward and backward (traced here; compiled for an H100 in
    # tests/flax/test_attention_gpu.py). The cuDNN version is declared: no GPU here.
    q, k, v, _, _ = inputs

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out)

    policy = mpjax.Policy(jnp.float32, dtype, jnp.float32)
    with target_cudnn():
        jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, policy), (0, 1, 2)))(q, k, v)
    calls = eqns(jaxpr.jaxpr, *CUDNN)
    assert sorted(e.primitive.name for e in calls) == sorted(CUDNN)
    for e in calls:
        assert {np.dtype(x.aval.dtype) for x in e.invars if x.aval.ndim == 4} == {np.dtype(dtype)}
