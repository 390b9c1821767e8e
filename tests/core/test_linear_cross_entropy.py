"""`mpjax.nn.linear_cross_entropy`: value and gradients against the unfused float32-softmax
loss in float64, and the compiled program never holding a `[tokens, vocab]` array.

The float64 reference (`tests/helpers/lce.py`) is written from the spec.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax.nn import linear_cross_entropy
from tests.helpers.lce import assert_gemms_bf16, reference

D, V = 16, 37  # a vocabulary that no chunk size below divides


def _inputs(lead, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, D))
    k = rng.standard_normal((D, V)) * 0.5
    labels = rng.integers(0, V, lead)
    return jnp.asarray(x, dtype), jnp.asarray(k, dtype), jnp.asarray(labels, jnp.int32)


CASES = {  # leading shape, chunk_size, ignore_index, z_loss, bias
    "ragged-tokens": ((3, 7), 4, None, 0.0, False),  # 21 tokens in chunks of <= 4
    "ignore-index": ((2, 9), 5, -100, 0.0, False),
    "z-loss": ((2, 9), 8, None, 1e-2, False),
    "all-options-one-chunk": ((16,), 64, 3, 1e-3, True),
}


@pytest.mark.parametrize(
    ("case", "dtype", "jit"),
    [
        ("ragged-tokens", jnp.float32, True),
        ("ragged-tokens", jnp.bfloat16, False),  # eager (slower: one case)
        ("ignore-index", jnp.bfloat16, True),
        ("z-loss", jnp.bfloat16, True),
        ("all-options-one-chunk", jnp.float32, True),
    ],
    ids=lambda v: v if isinstance(v, str) else {True: "jit", False: "eager"}.get(v, None),
)
def test_value_and_gradients_match_the_float64_reference(case, dtype, jit):
    lead, chunk, ignore, z, with_bias = CASES[case]
    x, k, labels = _inputs(lead, dtype)
    if ignore is not None:
        labels = labels.at[..., ::3].set(ignore)
    bias = jnp.linspace(-1.0, 1.0, V, dtype=jnp.float32)

    def loss(x, k, bias):
        b = bias if with_bias else None
        return linear_cross_entropy(
            x, k, labels, bias=b, chunk_size=chunk, ignore_index=ignore, z_loss=z, dtype=dtype
        )

    fn = jax.value_and_grad(loss, (0, 1, 2))
    value, (gx, gk, gb) = (jax.jit(fn) if jit else fn)(x, k, bias)
    want, want_gx, want_gk, want_gb = reference(
        x, k, labels, ignore, z, bias if with_bias else None
    )
    if with_bias:
        assert gb.dtype == jnp.float32
        np.testing.assert_allclose(gb, want_gb, atol=1e-6)
    else:
        assert not np.asarray(gb).any()  # unused
    assert value.dtype == jnp.float32 and gx.dtype == dtype and gk.dtype == dtype
    # float32: summation order only; bfloat16: the inputs are exact, the gradients rounded
    # to bfloat16 (2**-8 relative) once from a float32 accumulation.
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    scale_x, scale_k = np.abs(want_gx).max(), np.abs(want_gk).max()
    got_gx = np.asarray(gx, np.float64).reshape(-1, D)
    np.testing.assert_allclose(got_gx, want_gx, atol=tol * scale_x)
    np.testing.assert_allclose(np.asarray(gk, np.float64), want_gk, atol=tol * scale_k)


def test_bfloat16_gemm_with_a_float32_tied_embedding_transpose():
    """`dtype=` sets the GEMMs' dtype; the float32 table's gradient is float32."""
    x, _, labels = _inputs((2, 6), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(1).standard_normal((V, D)), jnp.float32)

    def loss(x, table):
        return linear_cross_entropy(x, table.T, labels, chunk_size=5, dtype=jnp.bfloat16)

    (value, (gx, gt)) = jax.value_and_grad(loss, (0, 1))(x, table)
    k16 = np.asarray(table.T.astype(jnp.bfloat16), np.float64)  # what the GEMM sees
    want, _, want_gk, _ = reference(x, k16, labels, None, 0.0)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    assert gt.dtype == jnp.float32 and gx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gt).T, want_gk, atol=2**-7 * np.abs(want_gk).max())
    assert_gemms_bf16(jax.jit(jax.grad(loss, (0, 1))).lower(x, table).as_text())


def _f32_buffers_at_least(hlo: str, elements: int) -> list[str]:
    shapes = re.findall(r"f32\[([\d,]+)\]", hlo)
    return [s for s in shapes if np.prod([int(d) for d in s.split(",")]) >= elements]


def test_compiled_step_never_holds_the_float32_logits():
    tokens, vocab, chunk = 512, 1000, 64
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 128, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((D, vocab)), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, vocab, (4, 128)), jnp.int32)

    def fused(x, k):
        return linear_cross_entropy(x, k, labels, chunk_size=chunk)

    def unfused(x, k):
        logits = (x @ k).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.mean(lse - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])

    def hlo(f):
        return jax.jit(jax.value_and_grad(f, (0, 1))).lower(x, k).compile().as_text()

    assert _f32_buffers_at_least(hlo(unfused), tokens * vocab)  # the test can see them
    big = _f32_buffers_at_least(hlo(fused), 2 * chunk * vocab)
    assert not big, big  # nothing larger than a chunk's float32 logits (and the kernel)


def test_autocast_keeps_it_chunked_with_bfloat16_gemms():
    x, k, labels = _inputs((4, 32), jnp.float32)

    def loss(x, k):
        return linear_cross_entropy(x, k, labels, chunk_size=16, dtype=jnp.bfloat16)

    cast = mpjax.autocast(loss, "params=float32,compute=bfloat16,output=float32")
    value, (gx, gk) = jax.value_and_grad(cast, (0, 1))(x, k)
    want, want_gx, want_gk, _ = reference(
        x.astype(jnp.bfloat16), k.astype(jnp.bfloat16), labels, None, 0.0
    )
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    assert gx.dtype == jnp.float32 and gk.dtype == jnp.float32
    np.testing.assert_allclose(gk, want_gk, atol=2**-7 * np.abs(want_gk).max())
    text = jax.jit(jax.grad(cast, (0, 1))).lower(x, k).as_text()
    assert_gemms_bf16(text)
    assert f"x{V}xf32>" in text and f"128x{V}xf32>" not in text  # chunks of 16 only


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fsdp_sharded_batch_and_kernel_match_one_device(axis_type):
    axis_types = (getattr(jax.sharding.AxisType, axis_type),)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=axis_types)
    x, k, labels = _inputs((8, 12), jnp.bfloat16)
    k = jnp.asarray(np.random.default_rng(3).standard_normal((D, 40)), jnp.bfloat16)
    labels = labels % 40

    def loss(x, k, labels):
        return linear_cross_entropy(x, k, labels, chunk_size=16)

    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    want = step(x, k, labels)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
        ks = jax.device_put(k, NamedSharding(mesh, P("fsdp")))
        ls = jax.device_put(labels, NamedSharding(mesh, P("fsdp")))
        got = step(xs, ks, ls)
    if axis_type == "Explicit":  # the kernel's gradient comes back split like the kernel
        assert got[1][1].sharding.is_equivalent_to(ks.sharding, 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-6), got, want)
    assert got[1][0].sharding.is_equivalent_to(xs.sharding, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1, got 0"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int"),
        ({"z_loss": -1.0}, ValueError, "z_loss must be a finite float >= 0"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int or None"),
        ({"dtype": jnp.int32}, ValueError, "dtype: int32 is not a floating dtype"),
        ({"bias": jnp.ones((3,))}, ValueError, r"bias must be None or a floating \[vocab\]"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    x, k, labels = _inputs((2, 3), jnp.bfloat16)
    with pytest.raises(error, match=match):
        linear_cross_entropy(x, k, labels, **kwargs)


def test_bad_shapes_name_the_fix():
    x, k, labels = _inputs((2, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"embedding\.T"):
        linear_cross_entropy(x, k[None], labels)
    with pytest.raises(ValueError, match="d == kernel.shape"):
        linear_cross_entropy(x, k.T, labels)
    with pytest.raises(ValueError, match="labels must have x's leading shape"):
        linear_cross_entropy(x, k, labels[0])
    with pytest.raises(TypeError, match="labels must be an integer array"):
        linear_cross_entropy(x, k, labels.astype(jnp.float32))
