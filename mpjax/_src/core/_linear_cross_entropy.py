"""`linear_cross_entropy`: a float32 cross-entropy loss that never holds the float32 logits.

The mixed-precision recipe computes the logits GEMM in the compute dtype and the softmax and
loss in float32: written directly, that is a float32 `[tokens, vocab]` array (and its
gradient), the largest temporary of a language model's step. Here the tokens are processed
`chunk_size` at a time in a `lax.scan`: each chunk's logits GEMM runs in the compute dtype
with a float32 result, its logsumexp and loss in float32; the backward pass recomputes each
chunk's logits (a `custom_vjp`), forms the float32 softmax gradient, casts it to the compute
dtype for the two backward GEMMs, and accumulates the kernel's gradient in float32 (rounded
to the compute dtype once, at the end). Only one
chunk's `[chunk, vocab]` logits are live at a time (Liger Kernel's fused linear
cross-entropy, Levanter's blockwise cross-entropy).

The chunks are strided (chunk `i` holds tokens `i, i + n, i + 2n, ...` of the flattened
batch, `n` chunks), so a batch sharded over devices stays sharded over the same devices in
every chunk: each device processes its own tokens, with no collective for the loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["linear_cross_entropy"]

_F32 = jnp.float32
_CONTRACT_LAST = (((1,), (0,)), ((), ()))  # [c, d] @ [d, v]
_CONTRACT_VOCAB = (((1,), (1,)), ((), ()))  # [c, v] @ [d, v]^T
_CONTRACT_TOKENS = (((0,), (0,)), ((), ()))  # [c, d]^T @ [c, v]


def _check(x, kernel, labels, chunk_size, ignore_index, z_loss, dtype) -> Any:
    name = "linear_cross_entropy"
    for arg, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            got = getattr(v, "dtype", type(v).__name__)
            raise TypeError(f"{name}: {arg} must be a floating array, got {got}")
    if kernel.ndim != 2:
        raise ValueError(
            f"{name}: kernel must be [d, vocab], got shape {kernel.shape} (for a tied "
            "embedding table [vocab, d], pass its transpose `embedding.T`)"
        )
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"{name}: x must be [..., d] with d == kernel.shape[0] == {kernel.shape[0]}, "
            f"got x.shape={x.shape}"
        )
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        got = getattr(labels, "dtype", type(labels).__name__)
        raise TypeError(f"{name}: labels must be an integer array, got {got}")
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"{name}: labels must have x's leading shape {x.shape[:-1]}, got {labels.shape}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"{name}: chunk_size must be an int, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer)
    ):
        raise TypeError(f"{name}: ignore_index must be an int or None, got {ignore_index!r}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float | np.floating):
        raise TypeError(f"{name}: z_loss must be a Python float, got {z_loss!r}")
    if not np.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"{name}: z_loss must be a finite float >= 0, got {z_loss}")
    if dtype is None:
        return jnp.result_type(x.dtype, kernel.dtype)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name}: dtype must be a floating dtype or None, got {dtype}")
    return dtype


def _chunk_logits(xc, kernel, bias):
    """One chunk's float32 logits: the GEMM in the operands' (compute) dtype, plus the bias."""
    logits = lax.dot_general(xc, kernel, _CONTRACT_LAST, preferred_element_type=_F32)
    return logits + bias[None, :]


def _sharded(a: jax.Array) -> bool:
    """Whether `a`'s type says it is sharded (over Explicit mesh axes)."""
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", ())
    return any(s is not None for s in spec)


def _replicated(ndim: int) -> jax.sharding.PartitionSpec:
    return jax.sharding.PartitionSpec(*([None] * ndim))


def _gathered(a: jax.Array) -> jax.Array:
    """`a` replicated if it is sharded over Explicit axes (FSDP gathers each weight before
    its use; its gradient is reduce-scattered back). A no-op otherwise."""
    return jax.sharding.reshard(a, _replicated(a.ndim)) if _sharded(a) else a


def _label_logit(logits, labels):
    """`logits[i, labels[i]]` as a masked row sum (a fused reduction, no gather)."""
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.sum(jnp.where(vocab == labels[:, None], logits, 0.0), axis=1)


def _make(z_loss: float):
    """The chunked loss as a `custom_vjp` of (x [n, r, d], kernel [d, v], bias [v] float32,
    labels [n, r], valid [n, r]); x and kernel in the compute dtype."""

    def forward(x, kernel, bias, labels, valid):
        def body(total, chunk):
            xc, lc, vc = chunk
            logits = _chunk_logits(xc, kernel, bias)
            lse = jax.nn.logsumexp(logits, axis=1)
            per_token = lse - _label_logit(logits, lc) + z_loss * lse * lse
            return total + jnp.sum(jnp.where(vc, per_token, 0.0)), lse

        return lax.scan(body, jnp.zeros((), _F32), (x, labels, valid))

    @jax.custom_vjp
    def chunked(x, kernel, bias, labels, valid):
        return forward(x, kernel, bias, labels, valid)[0]

    def fwd(x, kernel, bias, labels, valid):
        total, lse = forward(x, kernel, bias, labels, valid)
        return total, (x, kernel, bias, labels, valid, lse)

    def bwd(res, g):
        x, kernel, bias, labels, valid, lse = res
        g = g.astype(_F32)

        def body(acc, chunk):
            dk, db = acc
            xc, lc, vc, lse_c = chunk
            logits = _chunk_logits(xc, kernel, bias)
            p = jnp.exp(logits - lse_c[:, None])
            vocab = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            coef = jnp.where(vc, g, 0.0)[:, None]
            dlogits = coef * ((1.0 + 2.0 * z_loss * lse_c)[:, None] * p)
            dlogits = dlogits - jnp.where(vocab == lc[:, None], coef, 0.0)
            db = db + jnp.sum(dlogits, axis=0)
            dlogits = dlogits.astype(x.dtype)
            dx = lax.dot_general(dlogits, kernel, _CONTRACT_VOCAB, preferred_element_type=_F32)
            dk = dk + lax.dot_general(
                xc,
                dlogits,
                _CONTRACT_TOKENS,
                preferred_element_type=_F32,
                # tokens over Explicit axes: each device's sum is all-reduced
                out_sharding=_replicated(kernel.ndim) if _sharded(xc) else None,
            )
            return (dk, db), dx.astype(x.dtype)

        init = (jnp.zeros(kernel.shape, _F32), jnp.zeros(bias.shape, _F32))
        (dk, db), dx = lax.scan(body, init, (x, labels, valid, lse))
        return dx, dk.astype(kernel.dtype), db, None, None

    chunked.defvjp(fwd, bwd)
    return chunked


def linear_cross_entropy(
    x: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    chunk_size: int = 512,
    ignore_index: int | None = None,
    z_loss: float = 0.0,
    dtype: Any = None,
) -> jax.Array:
    """The mean float32 cross-entropy of `x @ kernel` against `labels`, without the logits.

    Equals `optax.softmax_cross_entropy_with_integer_labels(
    (x @ kernel).astype(float32), labels)` averaged over the non-ignored tokens (plus
    `z_loss * mean(logsumexp(logits) ** 2)`, PaLM's auxiliary loss; logits plus `bias`
    when given), value and gradients,
    but processes `chunk_size` tokens at a time: the logits GEMM runs in the compute dtype
    with a float32 result, the log-softmax and loss in float32, and the backward pass
    recomputes each chunk's logits, so no `[tokens, vocab]` array is ever held. The
    gradients of `x` and `kernel` are accumulated in float32 and rounded to the compute
    dtype (as the GEMMs of the unfused loss give them), then cast to their own dtypes.

    Under `mpjax.autocast`, which traces in float32 and keeps a `custom_vjp` as traced,
    pass `dtype=` the policy's compute dtype so the GEMMs run in it; under `apply_policy`
    the activations already arrive in the compute dtype.

    Args:
      x: `[..., d]` floating: the final hidden states.
      kernel: `[d, vocab]` floating: the output projection (for a tied embedding table
        `[vocab, d]`, its transpose `embedding.T`).
      labels: integer `[...]` (x's leading shape): the target class of each token, in
        `[0, vocab)` (or `ignore_index`).
      bias: None, or the head's `[vocab]` bias (a Flax `Dense` head's), added to the
        logits in float32; its gradient is accumulated in float32.
      chunk_size: tokens per step of the loop (of the global batch: with `x` sharded over
        `n` devices, each device processes about `chunk_size / n` per step). Each step holds
        a float32 `[chunk_size, vocab]` block of logits and reads the whole kernel (and,
        backward, the float32 `[d, vocab]` gradient accumulator): larger chunks are
        faster, smaller ones leaner.
      ignore_index: tokens whose label equals it contribute neither loss nor gradient, and
        are not counted in the mean (None: every token counts).
      z_loss: the weight of `mean(logsumexp(logits) ** 2)` added to the loss (0 disables
        it; PaLM used 1e-4).
      dtype: the compute dtype of the GEMMs; None (default) is the promoted dtype of `x`
        and `kernel` (bfloat16 for bfloat16 activations and a bfloat16 kernel).

    Returns:
      A float32 scalar: the mean loss over the non-ignored tokens (0 when there are none).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.nn import linear_cross_entropy
      >>> x = jax.random.normal(jax.random.key(0), (2, 5, 8), jnp.bfloat16)
      >>> kernel = jax.random.normal(jax.random.key(1), (8, 11), jnp.bfloat16)
      >>> labels = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, -1]])
      >>> loss = linear_cross_entropy(x, kernel, labels, chunk_size=4, ignore_index=-1)
      >>> loss.dtype, loss.shape
      (dtype('float32'), ())
    """
    dtype = _check(x, kernel, labels, chunk_size, ignore_index, z_loss, dtype)
    vocab = kernel.shape[1]
    if bias is not None and (
        not hasattr(bias, "dtype")
        or not jnp.issubdtype(bias.dtype, jnp.floating)
        or bias.shape != (vocab,)
    ):
        got = f"{getattr(bias, 'dtype', type(bias).__name__)}{getattr(bias, 'shape', '')}"
        raise ValueError(
            f"linear_cross_entropy: bias must be None or a floating [vocab] = [{vocab}] "
            f"array, got {got}"
        )
    d = x.shape[-1]
    tokens = int(np.prod(x.shape[:-1], dtype=np.int64))
    chunks = max(1, -(-tokens // chunk_size))
    rows = -(-tokens // chunks) if tokens else 1  # <= chunk_size
    pad = chunks * rows - tokens
    flat_x = x.reshape(tokens, d)
    flat_labels = labels.reshape(tokens).astype(jnp.int32)
    valid = jnp.ones((tokens,), bool)
    if ignore_index is not None:
        valid = labels.reshape(tokens) != ignore_index
    if pad:
        flat_x = jnp.pad(flat_x, ((0, pad), (0, 0)))
        flat_labels = jnp.pad(flat_labels, (0, pad))
        valid = jnp.pad(valid, (0, pad))
    # [rows, chunks] -> [chunks, rows]: chunk i holds tokens i, i + chunks, ... (strided)
    xs = jnp.swapaxes(flat_x.reshape(rows, chunks, d), 0, 1)
    ls = flat_labels.reshape(rows, chunks).T
    vs = valid.reshape(rows, chunks).T
    # Cast outside the custom_vjp: the gradients leave it in the compute dtype (as a GEMM's
    # would), so a sharded kernel's gradient is reduced across devices in that dtype.
    b32 = jnp.zeros((vocab,), _F32) if bias is None else _gathered(bias.astype(_F32))
    kernel = _gathered(kernel.astype(dtype))
    total = _make(float(z_loss))(xs.astype(dtype), kernel, b32, ls, vs)
    count = jnp.sum(valid, dtype=jnp.int32)
    return total / jnp.maximum(count, 1).astype(_F32)
